"""Serving an app's model: int8 export guarded on the app's headline metric, ``fedge-profile infer`` fed from the
model card, and the reports and Prometheus naming the headline instead of accuracy.

One in-process run of the example app (examples/diabetes: a regression, headline R², no accuracy anywhere) with
its metrics served on a free port serves every test below that needs a run.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from export import app_export
from coordinator.runtime.run import run_federated
from export.card import sha256
from export.cli import main as export_main
from export.errors import QuantizationError
from export.onnx_graph import check_parity, op_counts, predict, session, to_onnx
from export.quantize import HeadlineDrop, QuantSettings, quantize_static_int8
from profiling.cli import main as profile_main
from profiling.infer import InferError, InferSettings, benchmark
from storage.cards import card_path, write_card
from test_app_runs import EXAMPLE, _config
from test_metrics_endpoint import counter, scrape
from test_profiling import _infer_without_torch


@pytest.fixture(scope="module")
def diabetes_run(tmp_path_factory):
    """The diabetes app trained 4 rounds in process, its Prometheus endpoint scraped after each row; the run's
    result and the last scrape. The app stays importable while the module's tests run."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(EXAMPLE))
        patch.setenv("PYTHONPATH", os.pathsep.join([str(EXAMPLE), *filter(None, [os.environ.get("PYTHONPATH")])]))
        importlib.invalidate_caches()
        out = tmp_path_factory.mktemp("diabetes") / "run"
        said: list[str] = []
        scrapes: list[dict] = []

        def on_round(row: dict) -> None:
            scrapes.append(scrape(re.search(r"serving metrics at (http://\S+)", "\n".join(said)).group(1)))

        result = run_federated(_config(out, transport__kind="inproc", metrics__enabled=True, metrics__port=0),
                               say=said.append, on_round=on_round)
        yield result, scrapes[-1]


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (run.out_dir / "metrics.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------- int8


def test_the_headline_guard_follows_the_metrics_direction_and_scale():
    mae = HeadlineDrop("mae", False, float_value=0.50, int8_value=0.51, limit=0.05)
    assert mae.worse_by == pytest.approx(0.02)
    mae.check()   # 2% worse, 5% allowed
    with pytest.raises(QuantizationError, match=r"test mae is 0\.5100 against 0\.5000 in float32 \(2\.00% worse, "
                                                r"lower is better; limit 1%\); not written.*--max-headline-drop"):
        HeadlineDrop("mae", False, 0.50, 0.51, limit=0.01).check()
    better = HeadlineDrop("r2", True, float_value=0.50, int8_value=0.52, limit=0.0)
    assert better.worse_by < 0
    better.check()   # better than float32 passes even a limit of 0
    with pytest.raises(QuantizationError, match=r"test r2 is 0\.4000 against 0\.5000 .*20\.00% worse, higher is better"):
        HeadlineDrop("r2", True, 0.50, 0.40, limit=0.1).check()
    assert HeadlineDrop("r2", True, 0.0, -0.1, limit=0.5).worse_by == float("inf")   # no scale to be relative to


def test_int8_of_an_app_is_written_when_its_headline_holds(diabetes_run, tmp_path, capsys):
    run, _ = diabetes_run
    out = tmp_path / "model.onnx"
    assert export_main([str(run.out_dir), "--int8", "-o", str(out)]) == 0
    said = capsys.readouterr().out
    float32 = json.loads(card_path(out).read_text())
    int8_file = tmp_path / "model.int8.onnx"
    card = json.loads(card_path(int8_file).read_text())
    q = card["quantization"]
    assert card["precision"] == "int8" and card["headline"] == "r2" and card["parity"] is None
    assert q["headline"] == "r2" and q["higher_is_better"] and q["max_headline_drop"] == 0.01
    assert q["float32_r2"] == float32["test_r2"] and q["int8_r2"] == card["test_r2"]   # both recorded
    assert q["headline_worse_by"] <= 0.01 and abs(card["test_r2"] - float32["test_r2"]) < 0.01
    assert q["calibration_samples"] == 442 == q["test_samples"]   # all of the app's evaluation data (442 < 512)
    assert op_counts(int8_file).get("QuantizeLinear", 0) > 0 and card["input"] == float32["input"]
    assert "accuracy" not in json.dumps(card)
    assert f"test r2 float32 {float32['test_r2']:.4f}, int8 {card['test_r2']:.4f}" in said


def test_int8_of_an_app_is_refused_naming_the_headline_and_both_values(diabetes_run, tmp_path, capsys, monkeypatch):
    run, _ = diabetes_run
    # A limit of 0: written only when int8 is no worse than float32, refused otherwise, whichever it is here.
    exported = app_export.export_app_float32(run.out_dir, out=tmp_path / "exact.onnx")
    try:
        strict = app_export.export_app_int8(exported, QuantSettings(max_headline_drop=0.0))
        assert strict.card["quantization"]["headline_worse_by"] <= 0
    except QuantizationError as exc:
        assert "limit 0%" in str(exc) and not (tmp_path / "exact.int8.onnx").exists()
    # Calibration on nearly blank inputs (as fedge's own networks' test does): the ranges are far too small,
    # int8 saturates and its R² collapses; fedge-export writes float32, refuses int8 and exits 3.
    real = app_export.calibration_set
    monkeypatch.setattr(app_export, "calibration_set", lambda x, settings: real(x, settings)[:64] * 1e-3)
    out = tmp_path / "bad.onnx"
    assert export_main([str(run.out_dir), "--int8", "-o", str(out)]) == 3
    err = capsys.readouterr().err
    assert re.search(r"int8: the int8 model's test r2 is -?\d\.\d{4} against \d\.\d{4} in float32 \(\d+\.\d\d% "
                     r"worse, higher is better; limit 1%\); not written", err), err
    assert out.is_file() and not (tmp_path / "bad.int8.onnx").exists()
    assert export_main([str(run.out_dir), "--int8", "--max-accuracy-drop", "2"]) == 2   # the built-in's option
    assert "--max-headline-drop" in capsys.readouterr().err


# --------------------------------------------------------------------------- fedge-profile infer


def test_infer_feeds_an_app_export_from_its_card_without_torch(diabetes_run, tmp_path):
    run, _ = diabetes_run
    model = run.out_dir / "export" / "model.onnx"
    card = json.loads((run.out_dir / "export" / "model.card.json").read_text())
    state = tmp_path / "state"
    out = _infer_without_torch(str(model), "--runs", "5", "--warmup", "1", "--batch", "8", "--state-dir", str(state))
    assert out.returncode == 0, out.stderr
    assert "tensor(float) ['batch', 10], data random" in out.stdout
    assert f"app diabetes 1.0.0: input as its card model.card.json says; test r2 {card['test_r2']:.4f}" in out.stdout
    np.savez(tmp_path / "patients.npz", x=np.zeros((7, 10), np.float32), y=np.zeros(7, np.float32))   # real targets
    out = _infer_without_torch(str(model), "--runs", "3", "--warmup", "0", "--state-dir", str(state),
                               "--data", f"npz:{tmp_path / 'patients.npz'}")
    assert out.returncode == 0 and "accuracy" not in out.stdout, out.stderr   # regression targets are not scored
    lines = [json.loads(line) for line in (state / "profile.jsonl").read_text().splitlines()]
    assert [line["app"] for line in lines] == [{"name": "diabetes", "version": "1.0.0"}] * 2
    assert lines[0]["card"] == {"file": "model.card.json", "precision": "float32", "headline": "r2",
                                "test_r2": card["test_r2"]}
    assert [r["batch"] for r in lines[0]["results"]] == [1, 8] and "accuracy" not in lines[1]
    # a card that describes another file (a stale one beside a newer model) is refused, not trusted
    shutil.copy(model, tmp_path / "model.onnx")
    (tmp_path / "model.card.json").write_text(json.dumps({**card, "format": "fedge-model-card/1", "sha256": "0" * 64}))
    stale = _infer_without_torch(str(tmp_path / "model.onnx"), "--no-record", "--runs", "1")
    assert stale.returncode == 2 and "describes another file" in stale.stderr, stale.stderr


def test_an_app_with_integer_inputs_exports_and_is_benchmarked_as_its_card_says(tmp_path):
    """Token ids, not floats: the graph is traced, checked and quantized with the example input's dtype, and
    infer feeds zeros of it (any index an embedding takes; random floats would not be ids)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 4), nn.Flatten(), nn.Linear(32, 3)).eval()
    blob = to_onnx(model, (8,), dtype=torch.int64)
    ids = np.random.default_rng(0).integers(0, 20, (40, 8))
    assert check_parity(model, session(blob), ids).max_abs_diff < 1e-5
    int8 = quantize_static_int8(blob, ids)
    assert np.abs(predict(session(int8), ids) - predict(session(blob), ids)).max() < 0.1
    path = tmp_path / "model.onnx"
    path.write_bytes(blob)
    write_card(path, {"sha256": sha256(blob), "app": {"name": "kws", "version": "1"}, "headline": "accuracy",
                      "test_accuracy": 0.9, "input": {"name": "input", "dtype": "int64", "shape": ["batch", 8]}})
    record = benchmark(path, InferSettings(runs=2, warmup=0, batch=4))
    assert record["input"] == {"name": "input", "type": "tensor(int64)", "shape": ["batch", 8]}
    assert record["app"] == {"name": "kws", "version": "1"} and record["card"]["test_accuracy"] == 0.9
    write_card(path, {"sha256": sha256(blob), "app": {"name": "kws", "version": "1"}, "headline": "accuracy",
                      "input": {"name": "input", "dtype": "float32", "shape": ["batch", 8]}})
    with pytest.raises(InferError, match="the card says the input is float32 but the model takes tensor\\(int64\\)"):
        benchmark(path, InferSettings(runs=1, warmup=0))


# --------------------------------------------------------------------------- reports and Prometheus


def test_reports_of_the_app_run_show_its_headline_and_never_accuracy(diabetes_run, tmp_path, capsys, monkeypatch):
    run, _ = diabetes_run
    rows = _rows(run)
    copy = tmp_path / "run"
    shutil.copytree(run.out_dir, copy)
    benchmark(copy / "export" / "model.onnx", InferSettings(runs=3, warmup=0, batch=4),
              state_dir=copy / "clients" / "sim-000")   # a device's benchmark, in the fleet's inference table
    monkeypatch.setenv("COLUMNS", "250")
    assert profile_main(["show", str(copy)]) == 0
    shown = capsys.readouterr().out
    assert "accuracy" not in shown.lower() and f"final r2 {rows[-1]['test_r2']:.4f}" in shown
    header = next(line for line in shown.splitlines() if "round" in line and "loss" in line)
    assert header.replace("┃", " ").split()[:3] == ["round", "r2", "loss"]
    assert profile_main(["html", str(copy), "-o", str(tmp_path / "report.html")]) == 0
    page = (tmp_path / "report.html").read_text()
    assert "accuracy" not in page.lower() and "Inference benchmarks" in page
    assert '<figure id="headline">' in page and "Test r2 of the global model after each round" in page
    # while the run goes, no summary names the headline yet: every metric the rows hold is shown
    (copy / "summary.json").unlink()
    assert profile_main(["show", str(copy)]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if "round" in line and "loss" in line)
    assert header.replace("┃", " ").split()[:4] == ["round", "mae", "r2", "loss"]


def test_prometheus_has_a_gauge_for_the_headline_and_no_accuracy(diabetes_run):
    run, samples = diabetes_run
    rows = _rows(run)
    assert samples["fedge_headline_metric"] == {(("higher_is_better", "true"), ("metric", "r2")): rows[-1]["test_r2"]}
    assert "fedge_test_accuracy" not in samples and counter(samples, "fedge_test_loss") == rows[-1]["test_loss"]
    assert counter(samples, "fedge_run_info", model="diabetes", strategy="fedavg") == 1
