"""FedAvg + FFC (``run.strategy = "fedavg_ffc"``): FedAvg's training, then SphereFed's calibration.

The control row for SphereFed + FFC: a run trains FedAvg's models and ends with the least-squares
classifier on all clients' unit features in a sphere head, evaluated, checkpointed and exported
like SphereFed + FFC's, with the extra pass's participations and bytes in the row and the summary.
Small in-process federations on digits with a tiny mlp.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from coordinator.config import ConfigError, load_config
from coordinator.runtime.run import run_federated
from coordinator.strategy_setup import make_strategy
from edge_client.registry import build_model
from methods.spherefed.strategy import TRAINED_HEAD, FedAvgFfc
from storage.checkpoint import latest_checkpoint, load_checkpoint

DIGITS = {"num_classes": 10, "in_channels": 1, "image_size": 8}
CLIENTS = 4


def config(out: Path, strategy: str = "fedavg_ffc", **sets):
    base = {"run.strategy": strategy, "run.rounds": 2, "run.out": str(out), "model.name": "mlp",
            "model.hidden": [32], "data.eval": "digits", "data.partition": "dirichlet:0.5",
            "clients.expected": CLIENTS, "clients.spawn": CLIENTS, "clients.per_round": 2,
            "transport.kind": "inproc", "export.enabled": False, **sets}
    return load_config(None, [(*k.split(".", 1), v) for k, v in base.items()])


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_fedavg_ffc_settings_are_checked_with_what_to_change(tmp_path):
    assert isinstance(make_strategy(config(tmp_path)), FedAvgFfc)
    for key, value, message in [("ffc.enabled", False, "needs ffc.enabled = true"),
                                ("ffc.every", 1, "set ffc.every = 0"),
                                ("ffc.personalize", True, "set ffc.personalize = false")]:
        with pytest.raises(ConfigError, match=message):
            config(tmp_path, **{key: value, "data.local_test_fraction": 0.2})
    with pytest.raises(ConfigError, match="without noise"):   # local DP would send the statistics without noise
        config(tmp_path, **{"privacy.mode": "local", "privacy.clip_norm": 1.0})
    private = make_strategy(config(tmp_path, **{"privacy.mode": "central", "clients.max_attempts": 1}))
    assert private.privacy is not None   # central DP covers the FFC pass (tests/test_ffc_dp.py)
    strategy = make_strategy(config(tmp_path))
    sphere = build_model({"name": "mlp", "hidden": [32], **DIGITS, "head": "sphere"})
    with pytest.raises(ConfigError, match='model.head = "linear"'):
        strategy.initialize({"name": "mlp", "head": "sphere"}, dict(sphere.state_dict()))


def test_fedavg_ffc_run_ends_with_a_calibrated_sphere_head_and_counts_the_extra_pass(tmp_path):
    result = run_federated(config(tmp_path / "ffc", **{"export.enabled": True}), say=lambda s: None)
    rows = rows_of(result.out_dir)
    last = rows[-1]
    # the calibration's accuracy is the row's test accuracy, beside the trained head's, as for SphereFed + FFC
    assert last["test_accuracy"] == last["ffc_accuracy_after"] and "ffc_accuracy_before" in last
    assert last["ffc_accuracy_after"] > 0.5 and last["ffc_clients"] == CLIENTS
    # the extra pass: every client (not the round's 2), its bytes inside the row's totals and in the summary
    assert (last["selected"], last["ffc_selected"], last["ffc_returned"]) == (2, CLIENTS, CLIENTS)
    assert 0 < last["ffc_bytes_up"] < last["bytes_up"] and 0 < last["ffc_bytes_down"] <= last["bytes_down"]
    summary = result.summary
    for key in ("ffc_round", "ffc_selected", "ffc_returned", "ffc_bytes_up", "ffc_bytes_down",
                "ffc_accuracy_before", "ffc_accuracy_after"):
        assert summary[key] == last[key.replace("ffc_round", "round")], key
    assert not any("ffc_selected" in r for r in rows[:-1])   # one calibration, after the last round

    # the checkpoint holds the calibrated model: a sphere head, no bias, a classifier unlike the trained one
    state, _ = load_checkpoint(latest_checkpoint(result.out_dir / "checkpoints"))
    assert state.spec["head"] == "sphere" and "classifier.bias" not in state.params
    trained, calibrated = state.buffers[TRAINED_HEAD + "weight"], state.params["classifier.weight"]
    assert trained.shape == calibrated.shape and not torch.allclose(trained, calibrated)
    model = build_model(state.spec)
    model.load_state_dict(state.params, strict=False)
    assert torch.equal(model.classifier.weight, calibrated)

    # and so does the export (the sphere head's card; parity with torch checked before the file is written)
    card = json.loads(next((result.out_dir / "export").glob("*.json")).read_text())
    assert card["output"]["head"] == "sphere"


def test_fedavg_ffc_trains_fedavgs_models(tmp_path):
    """Before calibration FedAvg + FFC is FedAvg: the trained head scores what FedAvg's last round does."""
    ffc = rows_of(run_federated(config(tmp_path / "ffc"), say=lambda s: None).out_dir)
    avg = rows_of(run_federated(config(tmp_path / "avg", "fedavg"), say=lambda s: None).out_dir)
    losses = [[r["train_loss"] for r in rows if r["round"] > 0] for rows in (ffc, avg)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)
    assert ffc[-1]["ffc_accuracy_before"] == pytest.approx(avg[-1]["test_accuracy"], abs=2 / 360)
