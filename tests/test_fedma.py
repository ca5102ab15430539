"""FedMA end to end: phases over Mosquitto with client processes, a coordinator killed mid-pass and resumed,
the grown model checkpointed and exported; the strategy's refusals; a pass in process, checked layer by layer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coordinator.config import ConfigError, load_config
from coordinator.strategy_setup import make_strategy
from coordinator.runtime.run import run_federated
from methods.fedma.strategy import MATCHED
from methods.fedma.device import weight_layers
from edge_client.registry import build_model


def _config(**sets):
    return load_config(None, [(*k.split("__", 1), v) for k, v in sets.items()])


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


FIRST_WIDTHS = (16, 32, 64)   # a narrow cnn: matching cost grows with the width, the behaviour does not


def _cmd(out: Path, broker: str, prefix: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "coordinator.ui.cli", "run", "--strategy", "fedma", "--data", "digits",
            "--model", "cnn", "--partition", "dirichlet:0.5", "--rounds", "8", "--clients", "2",
            "--spawn-clients", "2", "--broker", broker, "--seed", "3", "--out", str(out),
            "--set", f"transport.prefix={prefix}", "--set", "train.epochs=2",
            "--set", f"model.widths={list(FIRST_WIDTHS)}", *extra]


def test_fedma_over_mosquitto_resumes_mid_pass_and_exports_the_grown_model(tmp_path, mosquitto, prefix,
                                                                          kill_after_checkpoint):
    ref = subprocess.run(_cmd(tmp_path / "ref", mosquitto, prefix + "-ref"), capture_output=True, text=True,
                         timeout=300)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    out = tmp_path / "resumed"
    proc = subprocess.Popen(_cmd(out, mosquitto, prefix), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_after_checkpoint(proc, out, 2)          # inside the first pass: layers 1 and 2 matched, 3 under way
    assert max(r["round"] for r in _rows(out)) < 4
    resumed = subprocess.run(_cmd(out, mosquitto, prefix, "--resume"), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    a, b = _rows(tmp_path / "ref"), _rows(out)
    assert [r["round"] for r in b] == list(range(9))
    assert [r.get("fedma_layer") for r in b[1:]] == [1, 2, 3, 4] * 2
    for ra, rb in zip(a, b):      # the phase the kill interrupted was asked again and answered the same
        assert rb.get("fedma_width") == ra.get("fedma_width") and rb.get("fedma_widths") == ra.get("fedma_widths")
        if "test_accuracy" in ra:
            assert rb["test_accuracy"] == pytest.approx(ra["test_accuracy"], abs=1e-3)
    evaluated = [r for r in b if "test_accuracy" in r]
    assert [r["round"] for r in evaluated] == [0, 4, 8]              # only whole passes are tested
    assert evaluated[-1]["test_accuracy"] > 0.8
    assert all(r["returned"] == 2 and r["rejected"] == 0 for r in b[1:])
    widths = b[-1]["fedma_widths"]
    assert len(widths) == 3 and all(w >= first for w, first in zip(widths, FIRST_WIDTHS))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["fedma_final_widths"] == widths and summary["fedma_passes"] == 2
    card = json.loads((out / "export" / "model.card.json").read_text())
    assert card["model"]["widths"] == widths and card["model"]["norm"] == "none"
    assert card["parity"]["max_abs_diff"] <= 1e-4 and card["test_accuracy"] == pytest.approx(
        evaluated[-1]["test_accuracy"], abs=1e-6)
    # each phase moves one layer up: far fewer bytes than the whole model from every client
    layer1_up = b[1]["bytes_up"]
    assert layer1_up < 0.05 * b[1]["fp32_bytes_up"]


def test_a_pass_in_process_matches_layer_by_layer_and_rebuilds_the_grown_model(tmp_path):
    out = tmp_path / "run"
    config = _config(run__strategy="fedma", run__rounds=6, run__out=str(out), model__name="mlp",
                     model__hidden=[24, 16], data__eval="digits", data__partition="dirichlet:0.5",
                     clients__expected=4, clients__spawn=4, transport__kind="inproc", fedma__max_growth=1.25)
    run_federated(config, say=lambda s: None)
    rows = _rows(out)
    assert [r.get("fedma_layer") for r in rows[1:]] == [1, 2, 3, 1, 2, 3]
    assert rows[1]["fedma_width"] <= 30 and rows[2]["fedma_width"] <= 20        # capped at 1.25x
    from storage.checkpoint import load_checkpoint
    state, _ = load_checkpoint(out / "checkpoints" / "round_0003.safetensors")
    assert not any(k.startswith(MATCHED) for k in state.params)                 # a whole model after the pass
    assert state.spec["hidden"] == [rows[1]["fedma_width"], rows[2]["fedma_width"]]
    model = build_model(state.spec)
    model.load_state_dict(state.params, strict=True)                             # every width agrees
    assert len(state.extra["assignments"]) == 4 and not state.extra["current"]
    # round 4 starts the next pass: each client gets the global model cut to its own neurons
    mid, _ = load_checkpoint(out / "checkpoints" / "round_0004.safetensors")
    assert any(k.startswith(MATCHED) for k in mid.params) and mid.spec == state.spec
    strategy = make_strategy(config)
    client = sorted(state.extra["assignments"])[0]
    own = [len(a) for a in state.extra["assignments"][client]]
    sliced = strategy._sliced(state, client)
    layers = weight_layers(model)
    assert [sliced[f"{n}.weight"].shape[0] for n in layers[:-1]] == own
    assert sliced[f"{layers[1]}.weight"].shape[1] == own[0] and sliced["classifier.weight"].shape[1] == own[1]


@pytest.mark.parametrize("sets, message", [
    ({"model__norm": "gn"}, "needs model.norm = 'none'"),
    ({"model__pan": "mul"}, "remove model.pan"),
    ({"codec__up": "topk:0.1+int8"}, "top-k codec.up"),
    ({"run__rounds": 6}, "a pass has 4 .* multiple of 4"),
])
def test_what_fedma_cannot_match_is_refused_with_the_fix(sets, message):
    with pytest.raises(ConfigError, match=message):
        make_strategy(_config(run__strategy="fedma", model__name="cnn", **{"run__rounds": 8, **sets}))


def test_the_strategy_alone_gets_a_network_without_normalization():
    config = _config(run__strategy="fedma", model__name="cnn", run__rounds=4)
    assert config.model["norm"] == "none"
    strategy = make_strategy(config)
    spec = {"name": "vgg9", "norm": "none", "num_classes": 10, "in_channels": 1, "image_size": 28}
    state = strategy.initialize(spec, {})
    assert state.spec["widths"] == [32, 64, 128, 128, 256, 256, 512, 512]
    assert state.extra["first_widths"] == state.spec["widths"]
    torch.manual_seed(0)
    assert len(weight_layers(build_model(state.spec))) == 9


def test_a_pass_samples_its_clients_once_and_keeps_them_for_every_phase(tmp_path):
    out = tmp_path / "run"
    run_federated(_config(run__strategy="fedma", run__rounds=6, run__out=str(out), model__name="mlp",
                          model__hidden=[16], data__eval="digits", clients__expected=5, clients__spawn=5,
                          clients__per_round=2, transport__kind="inproc", export__enabled=False),
                  say=lambda s: None)
    rows = _rows(out)
    assert [r["fedma_clients"] for r in rows[1:]] == [2] * 6
    per_round = [sorted(r["bytes_per_client"]) for r in rows[1:]]
    assert all(len(p) == 2 for p in per_round)
    assert per_round[0] == per_round[1] and per_round[2] == per_round[3] and per_round[4] == per_round[5]
    assert len({tuple(p) for p in per_round}) > 1     # and the next pass draws again
