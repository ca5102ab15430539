"""ONNX export: every model variant with verified parity, folded PANs, int8 with its guard, runs that export.

Real digits and real training throughout: the models are trained briefly with the
clients' own training loop and saved with the coordinator's checkpoint writer, or
come out of real in-process runs (FedAvg, SphereFed with FFC, DFL).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from coordinator.config import dump_config, load_config
from coordinator.runtime.run import run_federated
from edge_client.data import load_dataset
from methods.dfl.device import STATE_FILE, DeviceState
from edge_client.models import federated_names
from edge_client.registry import build_model
from edge_client.objectives import LocalData, TaskContext, train
from methods.pans.model import PanSettings, PositionAwareReLU
from export.card import card_path, sha256
from export.cli import main as export_main
from export.errors import ParityError, QuantizationError, SourceError
from methods.pans.export import fold_pans
from export.onnx_graph import ParityLimits, check_parity, op_counts, predict, session, to_onnx
from export.pipeline import ExportData, export_global, export_int8, export_personalized
from export.quantize import QuantSettings
from profiling.profiler import Profiler
from storage.checkpoint import save_checkpoint
from storage.state import ServerState

DIGITS = {"num_classes": 10, "in_channels": 1, "image_size": 8}

VARIANTS = {
    "mlp": {"name": "mlp", "hidden": [48, 24]},
    "mlp-bn-mul": {"name": "mlp", "hidden": [48, 24], "norm": "bn", "pan": "mul"},
    "mlp-gn-add": {"name": "mlp", "hidden": [48, 24], "norm": "gn", "pan": "add"},
    "cnn": {"name": "cnn", "width": 0.5},
    "cnn-bn-add": {"name": "cnn", "width": 0.5, "norm": "bn", "pan": "add"},
    "cnn-none-mul": {"name": "cnn", "width": 0.5, "norm": "none", "pan": "mul"},
    "vgg9": {"name": "vgg9", "width": 0.25},
    "vgg9-bn-mul": {"name": "vgg9", "width": 0.25, "norm": "bn", "pan": "mul", "pan_amplitude": 0.5},
    "vgg9-gn-add": {"name": "vgg9", "width": 0.25, "norm": "gn", "pan": "add", "pan_amplitude": 0.25},
    # Fed2: group convolutions, block-diagonal linear layers and the decoupled classifier
    "cnn-fed2-mul": {"name": "cnn", "width": 0.5, "fed2_groups": 10, "pan": "mul"},
    "vgg9-fed2-gn": {"name": "vgg9", "width": 0.5, "norm": "gn", "fed2_groups": 5, "fed2_from": 4},
}


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # see conftest.py


_TRAINED: dict[str, dict[str, torch.Tensor]] = {}   # trained state per (spec, epochs): several tests share one


def trained(spec: dict, digits, epochs: int = 2) -> nn.Module:
    """The model of ``spec`` after real SGD on digits (BatchNorm statistics included).

    He initialization first: with torch's default one, the 8 weight layers of vgg9
    without normalization barely pass a signal and do not learn in a few epochs.
    """
    key = json.dumps([spec, epochs], sort_keys=True)
    if key in _TRAINED:
        model = build_model({**spec, **DIGITS})
        model.load_state_dict(_TRAINED[key])
        return model.eval()
    torch.manual_seed(0)
    model = build_model({**spec, **DIGITS})
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
            nn.init.zeros_(module.bias)
    data = LocalData(torch.from_numpy(digits.x_train), torch.from_numpy(digits.y_train))
    train(model, data, {"epochs": epochs, "batch_size": 32, "lr": 0.02}, TaskContext(
        seed=0, round=1, client_id="t", state_dir=None, profiler=Profiler()))
    _TRAINED[key] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return model.eval()


def write_run(directory: Path, model: nn.Module, spec: dict, *, round: int = 3, strategy: str = "fedavg") -> Path:
    """A run directory as the coordinator leaves it: config.toml and a checkpoint."""
    params = {k: v.detach().clone() for k, v in model.state_dict().items() if k in federated_names(model)}
    save_checkpoint(directory / "checkpoints", ServerState(round, params, {**spec, **DIGITS}),
                    {"run_id": "test-run", "strategy": strategy})
    dump_config(load_config(None, [("data", "eval", "digits"), ("model", "name", spec["name"])]),
                directory / "config.toml")
    return directory


def torch_accuracy(model: nn.Module, digits) -> float:
    with torch.no_grad():
        return float((model(torch.from_numpy(digits.x_test)).argmax(1).numpy() == digits.y_test).mean())


# --------------------------------------------------------------------------- every variant


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_exports_with_verified_parity(variant, digits, tmp_path):
    spec = VARIANTS[variant]
    model = trained(spec, digits)
    run = write_run(tmp_path / "run", model, spec)
    exported = export_global(run)
    assert exported.path == run / "export" / "model.onnx" and exported.card_path == card_path(exported.path)
    card = json.loads(exported.card_path.read_text())
    assert card["sha256"] == sha256(exported.path.read_bytes()) and card["bytes"] == exported.path.stat().st_size
    assert card["input"]["shape"] == ["batch", 1, 8, 8] and card["classes"] == [str(i) for i in range(10)]
    assert card["input"]["normalization"]["scale"] == 1 / 16
    assert card["run"]["run_id"] == "test-run" and card["run"]["round"] == 3
    assert card["strategy"]["name"] == "fedavg" and card["strategy"]["train"]["lr"] == 0.05
    assert card["parity"]["max_abs_diff"] <= 1e-4 and card["parity"]["argmax_agreement"] >= 0.999
    assert card["test_accuracy"] == pytest.approx(torch_accuracy(model, digits), abs=1 / 360)
    assert card["test_accuracy"] > 0.8          # trained, so agreement on the argmax means something
    assert all(p["folded_into"] in ("layer", "norm") for p in card["pans"])
    assert len(card["pans"]) == (0 if "pan" not in spec else sum(isinstance(m, PositionAwareReLU)
                                                                  for m in model.modules()))
    sess = session(exported.path)
    for batch in (1, 7):                       # the batch dimension is dynamic
        x = digits.x_test[:batch]
        out = sess.run(None, {"input": x})[0]
        with torch.no_grad():
            np.testing.assert_allclose(out, model(torch.from_numpy(x)).numpy(), atol=1e-4)


# --------------------------------------------------------------------------- folded PANs


@pytest.mark.parametrize("variant", ["cnn-bn-add", "cnn-none-mul", "mlp-gn-add", "vgg9-bn-mul", "cnn-fed2-mul"])
def test_folded_pans_leave_no_operator_behind(variant, digits):
    spec = VARIANTS[variant]
    with_pans = trained(spec, digits)
    plain = build_model({**{k: v for k, v in spec.items() if not k.startswith("pan")}, **DIGITS}).eval()
    plain.load_state_dict(with_pans.state_dict())          # same weights, PANs off
    folded, report = fold_pans(with_pans)
    assert report and all(f.into in ("layer", "norm") for f in report)
    assert not any(isinstance(m, PositionAwareReLU) for m in folded.modules())
    assert any(isinstance(m, PositionAwareReLU) for m in with_pans.modules())   # the original is untouched
    pan_graph, plain_graph = to_onnx(folded, (1, 8, 8)), to_onnx(plain, (1, 8, 8))
    assert op_counts(pan_graph) == op_counts(plain_graph)
    x = digits.x_test
    parity = check_parity(with_pans, session(pan_graph), x)        # outputs still those of the PAN model
    assert parity.max_abs_diff <= 1e-4
    with torch.no_grad():
        assert np.abs(predict(session(plain_graph), x) - with_pans(torch.from_numpy(x)).numpy()).max() > 1e-3


def test_a_pan_after_a_normalization_without_affine_parameters_stays_a_constant():
    torch.manual_seed(0)
    settings = PanSettings("mul", 1.0, 0.3)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.GroupNorm(4, 16, affine=False),
                          PositionAwareReLU(settings, 16), nn.Linear(16, 10)).eval()
    folded, report = fold_pans(model)
    assert [(f.name, f.into) for f in report] == [("3", "kept")]
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(folded(x), model(x))
    plain = op_counts(to_onnx(nn.Sequential(*model[:3], nn.ReLU(), model[4]), (1, 8, 8)))
    kept = op_counts(to_onnx(folded, (1, 8, 8)))
    assert kept["Mul"] == plain.get("Mul", 0) + 1 and {k: v for k, v in kept.items() if k != "Mul"} == \
        {k: v for k, v in plain.items() if k != "Mul"}


def test_parity_failure_refuses_with_the_numbers(digits):
    model = trained(VARIANTS["mlp"], digits)
    other = build_model({**VARIANTS["mlp"], **DIGITS}).eval()
    with pytest.raises(ParityError, match=r"max \|difference\| .* same prediction on .*nothing was written"):
        check_parity(model, session(to_onnx(other, (1, 8, 8))), digits.x_test, ParityLimits())


# --------------------------------------------------------------------------- int8


def test_int8_is_smaller_keeps_accuracy_and_is_refused_when_calibration_is_bad(digits, tmp_path):
    spec = {"name": "cnn"}
    model = trained(spec, digits, epochs=3)
    exported = export_global(write_run(tmp_path / "run", model, spec))
    quantized = export_int8(exported, QuantSettings(calibration_samples=256, max_drop=1.0))
    q = quantized.card["quantization"]
    assert quantized.path.name == "model.int8.onnx" and quantized.path.is_file()
    assert quantized.card_path.is_file() and quantized.card["precision"] == "int8"
    # About a quarter of the weights' bytes; on a model this small the int32 biases, scales and graph
    # weigh more than on Fashion-MNIST's cnn and vgg9 (bench/export_latency.py measures those).
    assert q["int8_bytes"] <= 0.4 * q["float32_bytes"]
    assert q["accuracy_drop_points"] <= 1.0 and q["int8_accuracy"] > 0.8
    counts = op_counts(quantized.path)
    assert counts.get("QuantizeLinear", 0) > 0 and counts.get("DequantizeLinear", 0) > 0
    assert quantized.card["sha256"] == sha256(quantized.path.read_bytes())
    # Calibration on nearly blank images: activation ranges far too small, int8 saturates everywhere.
    d = exported.data
    bad = ExportData(d.spec, d.partition, d.x_test, d.y_test, d.x_train[:64] * 1e-3)
    out = tmp_path / "bad.int8.onnx"
    broken = type(exported)(exported.path, exported.card_path, exported.card, exported.model, bad)
    refused = r"accuracy is .* against .* in float32 \(.* points lower, limit 1\); not written"
    with pytest.raises(QuantizationError, match=refused):
        export_int8(broken, QuantSettings(calibration_samples=64), out=out)
    assert not out.exists()


# --------------------------------------------------------------------------- clear errors


def test_missing_or_corrupt_checkpoint_and_unknown_model_are_clear_errors(digits, tmp_path, capsys):
    with pytest.raises(SourceError, match="has no checkpoints/round_NNNN.safetensors"):
        export_global(tmp_path)
    with pytest.raises(SourceError, match="does not exist"):
        export_global(tmp_path / "nowhere")
    spec = VARIANTS["mlp"]
    run = write_run(tmp_path / "run", trained(spec, digits), spec)
    with pytest.raises(SourceError, match="no checkpoint of round 9; available rounds: 3"):
        export_global(run, round=9)
    (run / "checkpoints" / "round_0004.safetensors").write_bytes(b"\x00garbage, not a checkpoint")
    with pytest.raises(SourceError, match="round_0004.safetensors is not a readable fedge checkpoint"):
        export_global(run)
    assert export_main([str(run)]) == 2
    assert "not a readable fedge checkpoint" in capsys.readouterr().err
    assert not (run / "export").exists()

    unknown = write_run(tmp_path / "unknown", trained(spec, digits), {**spec, "name": "resnet50"})
    with pytest.raises(SourceError, match="unknown model 'resnet50'; model.name is one of cnn, mlp, vgg9"):
        export_global(unknown)
    with pytest.raises(SourceError, match="dfl_state.safetensors does not exist"):
        export_personalized(None, _fake_dfl_run(tmp_path / "dfl", digits) / "clients" / "sim-000")


def _fake_dfl_run(directory: Path, digits) -> Path:
    spec = {"name": "dfl", "backbone": "mlp", "hidden": [16]}
    model = build_model({**spec, **DIGITS})
    invariant = {k: v for k, v in model.state_dict().items() if k.startswith("invariant.")}
    save_checkpoint(directory / "checkpoints", ServerState(1, invariant, {**spec, **DIGITS}),
                    {"run_id": "dfl-run", "strategy": "dfl"})
    (directory / "clients" / "sim-000").mkdir(parents=True)
    return directory


# --------------------------------------------------------------------------- runs


def run_config(out: Path, **sets):
    base = {"run__rounds": 1, "run__out": str(out), "model__name": "mlp", "model__hidden": [32],
            "data__eval": "digits", "clients__expected": 2, "clients__spawn": 2, "clients__round_timeout": 60.0,
            "clients__presence_timeout": 60.0, "transport__kind": "inproc"}
    base.update(sets)
    return load_config(None, [(*key.split("__", 1), value) for key, value in base.items()])


def test_a_run_exports_its_final_model_unless_disabled(tmp_path, digits):
    result = run_federated(run_config(tmp_path / "run", run__rounds=2), say=lambda s: None)
    onnx_file = result.out_dir / "export" / "model.onnx"
    card = json.loads((result.out_dir / "export" / "model.card.json").read_text())
    assert result.summary["export"]["onnx"] == str(onnx_file)
    assert card["run"]["round"] == 2 and card["run"]["run_id"] == result.summary["run_id"]
    assert card["sha256"] == sha256(onnx_file.read_bytes())
    assert card["test_data"]["samples"] == len(digits.y_test)
    assert card["test_accuracy"] == pytest.approx(result.summary["final_accuracy"], abs=1 / 360)
    off = run_federated(run_config(tmp_path / "off", export__enabled=False), say=lambda s: None)
    assert "export" not in off.summary and not (off.out_dir / "export").exists()


def test_spherefed_export_has_the_normalization_and_the_calibrated_classifier(tmp_path, digits):
    result = run_federated(run_config(tmp_path / "run", run__strategy="spherefed", model__head="sphere"),
                           say=lambda s: None)
    assert result.summary["ffc_round"] == 1
    card = json.loads((result.out_dir / "export" / "model.card.json").read_text())
    assert card["output"]["head"] == "sphere" and card["strategy"]["ffc"]["enabled"] is True
    counts = op_counts(result.out_dir / "export" / "model.onnx")
    assert counts.get("ReduceL2") == 1 and counts.get("Div") == 1       # z = h / ||h||
    checkpoint = load_file(result.out_dir / "checkpoints" / "round_0001.safetensors")
    model = build_model(result.summary["model"]).eval()
    fixed = model.classifier.weight.clone()
    assert not torch.equal(checkpoint["classifier.weight"], fixed)     # FFC replaced the fixed classifier
    assert card["test_accuracy"] == pytest.approx(result.summary["ffc_accuracy_after"], abs=1 / 360)


def test_dfl_exports_a_devices_personalized_model(tmp_path, digits, capsys):
    result = run_federated(run_config(tmp_path / "run", run__strategy="dfl", data__partition="attribute:color:2",
                                      data__local_test_fraction=0.25), say=lambda s: None)
    assert "no global model" in result.summary["export"]["skipped"]
    state = result.out_dir / "clients" / "sim-001"
    assert export_main(["--client-state", str(state), "--test-samples", "200"]) == 0
    assert "client sim-001 of run" in capsys.readouterr().out
    card = json.loads((state / "export" / "model.card.json").read_text())
    assert card["personalized"]["client"] == "sim-001" and card["input"]["shape"] == ["batch", 3, 8, 8]
    assert card["input"]["normalization"]["mean"] == [0.5, 0.5, 0.5]
    # Independently: the global invariant branch of the last checkpoint with this device's own parts.
    model = build_model(result.summary["model"])
    model.load_state_dict(load_file(result.out_dir / "checkpoints" / "round_0001.safetensors"), strict=False)
    assert DeviceState(state).load_into(model, seed=0) is not None
    x = np.random.default_rng(0).standard_normal((16, 3, 8, 8)).astype(np.float32)
    with torch.no_grad():
        expected = model.eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(predict(session(state / "export" / "model.onnx"), x), expected, atol=1e-4)
    # A real device's state directory lives outside the run: the run is then named explicitly.
    device = tmp_path / "device"
    device.mkdir()
    (device / STATE_FILE).write_bytes((state / STATE_FILE).read_bytes())
    with pytest.raises(SourceError, match="not inside a run directory"):
        export_personalized(None, device)
    assert export_main([str(result.out_dir), "--client-state", str(device), "--test-samples", "100"]) == 0
    assert (device / "export" / "model.onnx").read_bytes() == (state / "export" / "model.onnx").read_bytes()


def _ascent(model: nn.Module, data, hyper, ctx):
    """A broken device's training: it runs the real local training, then sends the opposite of its update."""
    start = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}
    out = train(model, data, hyper, ctx)
    with torch.no_grad():
        for k, v in model.state_dict().items():
            if k in start:
                v.copy_(2 * start[k] - v)
    return out


def test_an_export_worse_than_the_runs_start_says_so_on_its_card_and_records_no_absolute_path(tmp_path, digits,
                                                                                               caplog, capsys):
    """Two devices whose updates point uphill: the run's final model is worse than its initial one (round 0)."""
    with caplog.at_level(logging.WARNING, logger="fedge.export"):
        result = run_federated(run_config(tmp_path / "run", run__rounds=2), say=lambda s: None,
                               client_objectives=lambda client_id: {"train": _ascent})
    rows = [json.loads(line) for line in (result.out_dir / "metrics.jsonl").read_text().splitlines()]
    card_file = result.out_dir / "export" / "model.card.json"
    card = json.loads(card_file.read_text())
    start = card["initial_model"]
    assert start["round"] == 0 and start["test_accuracy"] == rows[0]["test_accuracy"]
    assert card["test_accuracy"] < start["test_accuracy"] and start["worse"]
    assert start["accuracy_change"] == pytest.approx(card["test_accuracy"] - rows[0]["test_accuracy"])
    assert "worse than the one its run started from" in card["warnings"][0]
    assert result.summary["export"]["warnings"] == card["warnings"]
    assert any("worse than the one its run started from" in r.getMessage() for r in caplog.records)
    # the card names files as the run directory holds them, never where this machine keeps it
    assert card["run"]["checkpoint"] == "checkpoints/round_0002.safetensors" and card["run"]["run_dir"] == "run"
    assert str(tmp_path) not in card_file.read_text()
    assert export_main([str(result.out_dir), "-o", str(tmp_path / "again.onnx")]) == 0
    assert "WORSE THAN ITS START" in capsys.readouterr().out


def test_an_export_better_than_the_runs_start_carries_the_comparison_without_a_warning(tmp_path, digits):
    result = run_federated(run_config(tmp_path / "run", run__rounds=2), say=lambda s: None)
    card = json.loads((result.out_dir / "export" / "model.card.json").read_text())
    assert card["initial_model"]["worse"] is False and card["initial_model"]["accuracy_change"] > 0.2
    assert "warnings" not in card and "warnings" not in result.summary["export"]


def test_parity_scales_its_limit_with_the_outputs_and_refuses_a_model_whose_outputs_are_not_finite(digits):
    model = build_model({"name": "mlp", **DIGITS}).eval()
    with torch.no_grad():   # logits in the thousands, as a model swamped by noise has: float32 rounds at 1e-4 there
        for p in model.parameters():
            p.mul_(40.0)
    x = digits.x_test
    parity = check_parity(model, session(to_onnx(model, (1, 8, 8))), x)
    assert parity.output_scale > 1_000 and parity.ok and parity.as_dict()["limit_max_abs_diff"] > 1e-4
    with torch.no_grad():
        next(model.parameters()).fill_(float("inf"))
    with pytest.raises(ParityError, match="not finite: the model diverged"):
        check_parity(model, session(to_onnx(model, (1, 8, 8))), x)
