"""The gestures example (examples/gestures) trains end to end: three device processes, each with its own generated
windows, train its GRU over Mosquitto; the rows and summary carry its own metrics with macro F1 the headline;
the exported ONNX graph, served by ONNX Runtime, scores what its card says; the run's reports name macro F1."""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coordinator.config import load_config
from coordinator.runtime.run import run_federated

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "gestures"
ROUNDS = 5
# Measured with run seeds 0 to 4 (3 devices x 150 windows, 500 evaluation windows): macro F1 0.07 to 0.17 at
# round 0, 0.83 to 0.90 after round 5 (one epoch a round: 0.55 to 0.66; batches of 32: 0.79 to 0.81).
SETTINGS = {"train__lr": 0.2, "train__epochs": 5, "train__batch_size": 16}


@pytest.fixture
def gestures_app(monkeypatch) -> Path:
    """The example app (examples/gestures), importable here and in the device processes, as if installed."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(EXAMPLE), *filter(None, [os.environ.get("PYTHONPATH")])]))
    importlib.invalidate_caches()
    return EXAMPLE


def _config(out: Path, eval_file: Path, **sets):
    base = {"run__rounds": ROUNDS, "run__out": str(out), "app__module": "gestures_app:app",
            "data__eval": str(eval_file), "clients__expected": 3, "clients__spawn": 0, "clients__round_timeout": 60.0,
            "clients__presence_timeout": 60.0, **SETTINGS}
    base.update(sets)
    return load_config(None, [(*key.split("__", 1), value) for key, value in base.items()])


def _macro_f1(predicted: np.ndarray, truth: np.ndarray) -> float:
    """Macro F1 over the gestures among the labels or predictions, in numpy: a second reading of the app's."""
    scores = []
    for k in np.union1d(predicted, truth):
        hits, said, true = np.sum((predicted == k) & (truth == k)), np.sum(predicted == k), np.sum(truth == k)
        scores.append(2 * hits / (said + true))
    return float(np.mean(scores))


def test_the_example_stands_on_the_app_interface_and_its_data_is_made_from_its_seed(tmp_path, gestures_app):
    import torch

    from edge_client.app import check_app
    from gestures_app import app, eval_data, macro_f1
    from gestures_app.make_data import main as make_data

    fedge = {"storage", "profiling", "edge_client", "export", "coordinator", "methods"}
    for path in (EXAMPLE / "gestures_app").glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {n.name for node in ast.walk(tree) if isinstance(node, ast.Import) for n in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert {m for m in imported if m.split(".")[0] in fedge} <= {"edge_client.app"}, path.name
    check_app(app)
    make_data([str(tmp_path / "a"), "2", "--windows", "20"])
    make_data([str(tmp_path / "b"), "2", "--windows", "20"])
    for name in ("device-001.npz", "device-002.npz", "eval.npz"):
        with np.load(tmp_path / "a" / name) as a, np.load(tmp_path / "b" / name) as b:
            assert np.array_equal(a["x"], b["x"]) and np.array_equal(a["y"], b["y"])   # the same seed, the same data
    with np.load(tmp_path / "a" / "device-001.npz") as one, np.load(tmp_path / "a" / "device-002.npz") as two:
        assert one["x"].shape == (20, 100, 3) and one["x"].dtype == np.float32 and one["y"].dtype == np.int64
        assert np.bincount(one["y"]).tolist() == [4] * 5 and not np.allclose(one["x"], two["x"])
    synthetic, written = eval_data("synthetic"), eval_data(str(tmp_path / "a" / "eval.npz"))
    assert torch.equal(synthetic.x, written.x) and torch.equal(synthetic.y, written.y) and len(written) == 500
    assert app.model({})(written.x[:7]).shape == (7, 5)
    scores = torch.randn(300, 5, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 5, (300,), generator=torch.Generator().manual_seed(1))
    assert macro_f1(scores, labels) == pytest.approx(_macro_f1(scores.argmax(1).numpy(), labels.numpy()), abs=1e-12)
    assert macro_f1(torch.eye(5)[labels], labels) == 1.0


def test_three_devices_train_the_gesture_gru_and_its_export_serves_the_carded_macro_f1(tmp_path, gestures_app,
                                                                                       mosquitto, prefix, capsys):
    from gestures_app.make_data import main as make_data

    make_data([str(tmp_path / "devices"), "3", "--windows", "150"])
    devices = [subprocess.Popen([sys.executable, "-m", "edge_client.cli", "run", "--broker", mosquitto,
                                 "--client-id", f"device-00{i}", "--app", "gestures_app:app", "--prefix", prefix,
                                 "--data", str(tmp_path / "devices" / f"device-00{i}.npz"),
                                 "--state-dir", str(tmp_path / f"state-{i}"), "--torch-threads", "1",
                                 "--exit-after-run"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in (1, 2, 3)]
    run = tmp_path / "run"
    try:
        result = run_federated(_config(run, tmp_path / "devices" / "eval.npz", transport__broker=mosquitto,
                                       transport__prefix=prefix), say=lambda s: None)
    finally:
        said = [device.communicate(timeout=60)[1] for device in devices]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(ROUNDS + 1)), said
    assert all(r["returned"] == 3 for r in rows[1:]) and all(d.returncode == 0 for d in devices), said
    assert all({"test_loss", "test_accuracy", "test_macro_f1"} <= set(r) for r in rows)
    # five gestures: chance is 0.2; an untrained GRU says one gesture for everything (macro F1 about 0.07)
    assert rows[0]["test_macro_f1"] < 0.35 and rows[-1]["test_macro_f1"] > 0.7, [r["test_macro_f1"] for r in rows]
    assert rows[-1]["test_accuracy"] > 0.7 and rows[-1]["test_loss"] < rows[0]["test_loss"]
    s = result.summary
    assert s["headline"] == "macro_f1" and s["higher_is_better"] and s["final_macro_f1"] == rows[-1]["test_macro_f1"]
    assert s["model"]["app"]["name"] == "gestures" and s["model"]["app"]["version"] == "1.0.0"

    # the export, served by ONNX Runtime directly on the evaluation windows, scores what its card says
    import onnxruntime

    card = json.loads((run / "export" / "model.card.json").read_text())
    assert card["headline"] == "macro_f1" and card["input"]["shape"] == ["batch", 100, 3]
    assert card["output"]["shape"] == ["batch", 5] and card["preprocessing"]["sample_rate_hz"] == 50
    assert card["test_macro_f1"] == pytest.approx(rows[-1]["test_macro_f1"], abs=1e-3)
    with np.load(tmp_path / "devices" / "eval.npz") as arrays:
        x, y = arrays["x"], arrays["y"]
    session = onnxruntime.InferenceSession(str(run / "export" / "model.onnx"), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    logits = np.concatenate([session.run(None, {name: x[i:i + 64]})[0] for i in range(0, len(x), 64)])
    assert logits.shape == (len(x), 5)
    assert _macro_f1(logits.argmax(1), y) == pytest.approx(card["test_macro_f1"], abs=1e-3)
    assert float(np.mean(logits.argmax(1) == y)) == pytest.approx(card["test_accuracy"], abs=1e-3)

    # what a user reads after the run: `fedge-coordinator status --run-dir` and `fedge-profile show`
    from coordinator.ui.status_cli import read_run_dir
    status = read_run_dir(run)["run"]
    assert status["headline"] == "macro_f1" and status["test_macro_f1"] == rows[-1]["test_macro_f1"]
    from profiling.cli import main as profile_main

    capsys.readouterr()
    assert profile_main(["show", str(run)]) == 0
    report = capsys.readouterr().out
    assert "Rounds" in report and all(f"device-00{i}" in report for i in (1, 2, 3))
    assert "macro_f1" in report   # the report names the run's headline
