"""SphereFed with ffc.personalize: a device keeps its own classifier, and fedge-export puts it on the run's extractor.

One small real in-process run (mlp on digits, 2 spawned clients, 1 round, FFC with
personalization) is shared by the tests; its clients' state directories are what a
device leaves behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from coordinator.config import load_config
from coordinator.runtime.run import run_federated
from edge_client.data import load_dataset
from edge_client.registry import build_model
from edge_client.objectives import LocalData, TaskContext
from methods.spherefed.device import PERSONAL_CLASSIFIER_FILE, PERSONAL_METADATA, ffc_stats
from methods.spherefed.model import CLASSIFIER, fixed_classifier
from export.cli import main as export_main
from export.errors import SourceError
from export.onnx_graph import predict, session
from export.pipeline import export_personalized
from profiling.profiler import Profiler

HIDDEN = 32   # the mlp's feature dimension d


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    """A finished SphereFed+FFC run whose devices solved and kept their own classifiers."""
    out = tmp_path_factory.mktemp("sphere") / "run"
    overrides = {
        ("run", "strategy"): "spherefed", ("run", "rounds"): 1, ("run", "out"): str(out),
        ("model", "name"): "mlp", ("model", "hidden"): [HIDDEN], ("model", "head"): "sphere",
        ("data", "eval"): "digits", ("data", "partition"): "dirichlet:0.5", ("data", "local_test_fraction"): 0.25,
        ("clients", "expected"): 2, ("clients", "spawn"): 2, ("clients", "round_timeout"): 60.0,
        ("clients", "presence_timeout"): 60.0, ("ffc", "personalize"): True, ("export", "enabled"): False,
        ("transport", "kind"): "inproc",
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # a small model on a shared 2-core machine
    try:
        result = run_federated(load_config(None, [(*k, v) for k, v in overrides.items()]), say=lambda s: None)
    finally:
        torch.set_num_threads(threads)
    assert result.summary["ffc_round"] == 1 and result.summary["ffc_personalized_accuracy_mean"] > 0
    return result


def _model_with(result, classifier: torch.Tensor) -> torch.nn.Module:
    """Independently: the run's model with the last checkpoint's extractor and ``classifier`` in the head."""
    model = build_model(result.summary["model"])
    model.load_state_dict(load_file(result.out_dir / "checkpoints" / "round_0001.safetensors"), strict=False)
    model.classifier.weight.copy_(classifier)
    return model.eval()


def test_a_spherefed_device_exports_the_global_extractor_with_its_own_classifier(run, capsys):
    state = run.out_dir / "clients" / "sim-001"
    kept = state / PERSONAL_CLASSIFIER_FILE
    with safe_open(str(kept), framework="pt") as fh:
        assert list(fh.keys()) == [CLASSIFIER]
        info = json.loads(fh.metadata()[PERSONAL_METADATA])
        own = fh.get_tensor(CLASSIFIER)
    assert own.dtype == torch.float32 and tuple(own.shape) == (10, HIDDEN)
    assert (info["round"], info["dim"], info["classes"], info["client_id"]) == (1, HIDDEN, 10, "sim-001")
    assert info["ridge"] >= 0 and info["samples"] > 0
    calibrated = load_file(run.out_dir / "checkpoints" / "round_0001.safetensors")[CLASSIFIER]
    assert not torch.allclose(own, calibrated, atol=1e-3)                          # not the global one
    assert not torch.allclose(own, fixed_classifier(10, HIDDEN, 0).float(), atol=1e-3)
    assert not (run.out_dir / "export").exists()

    assert export_main(["--client-state", str(state), "--test-samples", "200"]) == 0
    assert "client sim-001 of run" in capsys.readouterr().out
    card = json.loads((state / "export" / "model.card.json").read_text())
    assert card["personalized"] == {
        "client": "sim-001", "client_state": "clients/sim-001", "global_parts": ["extractor"],
        "device_parts": ["classifier"], "device_file": PERSONAL_CLASSIFIER_FILE,
        "device_classifier": {k: info[k] for k in ("round", "ridge", "samples")}}
    assert card["output"]["head"] == "sphere" and card["parity"]["max_abs_diff"] <= 1e-4

    # ONNX Runtime gives the scores of the extractor with this device's classifier, not the calibrated one.
    x = np.concatenate([load_dataset("digits").x_test[:32],
                        np.random.default_rng(0).standard_normal((8, 1, 8, 8)).astype(np.float32)])
    onnx_scores = predict(session(state / "export" / "model.onnx"), x)
    with torch.no_grad():
        personal = _model_with(run, own)(torch.from_numpy(x)).numpy()
        global_ = _model_with(run, calibrated)(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(onnx_scores, personal, atol=1e-4)
    assert np.abs(onnx_scores - global_).max() > 1e-2


def test_a_missing_corrupt_or_mismatched_device_classifier_is_a_clear_error(run, tmp_path):
    device = tmp_path / "device"        # a real device's state directory, outside the run
    device.mkdir()
    kept = device / PERSONAL_CLASSIFIER_FILE
    own = load_file(run.out_dir / "clients" / "sim-000" / PERSONAL_CLASSIFIER_FILE)[CLASSIFIER]
    meta = {PERSONAL_METADATA: json.dumps({"round": 1})}
    with pytest.raises(SourceError, match=r"sphere_classifier.safetensors does not exist.*ffc.personalize = true"):
        export_personalized(run.out_dir, device)
    cases = [
        (b"\x00garbage, not safetensors", r"is not a readable safetensors file .*ffc.personalize = true"),
        ({CLASSIFIER: own[:, :16].contiguous()}, r"has shape \(10, 16\), .* expects C x d = \(10, 32\)"),
        ({"weight": own}, r"holds \['weight'\], not the one tensor 'classifier.weight'"),
        ({CLASSIFIER: own.to(torch.int64)}, r"is torch.int64, not a float tensor"),
        ({CLASSIFIER: torch.full_like(own, float("nan"))}, r"holds NaN or infinity"),
        ({CLASSIFIER: own, "metadata": {PERSONAL_METADATA: json.dumps({"round": 3})}},
         r"solved in round 3 .* checkpoint is of round 1; export with --round 3"),
    ]
    for content, message in cases:
        if isinstance(content, bytes):
            kept.write_bytes(content)
        else:
            tensors = {k: v for k, v in content.items() if k != "metadata"}
            save_file(tensors, str(kept), metadata=content.get("metadata", meta))
        with pytest.raises(SourceError, match=message):
            export_personalized(run.out_dir, device)
    assert not (device / "export").exists()
    save_file({CLASSIFIER: own}, str(kept), metadata=meta)   # the device's own file exports
    assert export_main([str(run.out_dir), "--client-state", str(device), "--test-samples", "100",
                        "--parity-samples", "100"]) == 0
    assert (device / "export" / "model.onnx").is_file()


def test_ffc_stats_keeps_the_classifier_only_with_a_state_dir_and_sends_only_the_sums(tmp_path):
    torch.manual_seed(0)
    model = build_model({"name": "mlp", "hidden": [HIDDEN], "num_classes": 10, "in_channels": 1, "image_size": 8,
                         "head": "sphere"})
    x, y = torch.randn(60, 1, 8, 8), torch.arange(60) % 10
    hyper = {"personalize": True, "ridge": 0.01}

    def ctx(state_dir: Path | None) -> TaskContext:
        return TaskContext(seed=0, round=4, client_id="dev", state_dir=state_dir, profiler=Profiler())

    out = ffc_stats(model, LocalData(x, y, x[:20], y[:20]), hyper, ctx(None))   # no state dir: nothing kept
    assert "ffc_local_accuracy" in out.metrics and not list(tmp_path.iterdir())
    out = ffc_stats(model, LocalData(x, y), hyper, ctx(tmp_path / "state"))      # no test split: still kept
    assert set(out.tensors) == {"ffc.gram", "ffc.cross", "ffc.count"} and "ffc_local_accuracy" not in out.metrics
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == [PERSONAL_CLASSIFIER_FILE]   # no .tmp left
    with safe_open(str(tmp_path / "state" / PERSONAL_CLASSIFIER_FILE), framework="pt") as fh:
        info = json.loads(fh.metadata()[PERSONAL_METADATA])
        assert tuple(fh.get_tensor(CLASSIFIER).shape) == (10, HIDDEN)
    assert (info["round"], info["client_id"], info["ridge"], info["samples"]) == (4, "dev", 0.01, 60)
    ffc_stats(model, LocalData(x, y), {"personalize": False}, ctx(tmp_path / "off"))
    assert not (tmp_path / "off").exists()
