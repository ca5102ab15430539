"""A user's app trains end to end: its model, data, loss and metrics in the rows, in process and over MQTT with
device processes; a device whose app differs from the run's refuses its tasks naming both."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.config import load_config
from coordinator.runtime.engine import RunError
from coordinator.runtime.run import run_federated

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "diabetes"


def _on_path(monkeypatch, root: Path) -> None:
    """``root``'s packages importable here and in the processes this test starts."""
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])]))
    importlib.invalidate_caches()


@pytest.fixture
def diabetes_app(monkeypatch) -> Path:
    """The example app (examples/diabetes), as installed beside fedge."""
    _on_path(monkeypatch, EXAMPLE)
    return EXAMPLE


def _config(out: Path, **sets):
    base = {"run__rounds": 4, "run__out": str(out), "app__module": "diabetes_app:app", "train__lr": 0.05,
            "data__eval": "sklearn",
            "clients__expected": 3, "clients__spawn": 3, "clients__round_timeout": 60.0,
            "clients__presence_timeout": 60.0}
    base.update(sets)
    return load_config(None, [(*key.split("__", 1), value) for key, value in base.items()])


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_regression_app_trains_in_process_and_reports_its_own_metrics(tmp_path, diabetes_app):
    result = run_federated(_config(tmp_path / "run", transport__kind="inproc"), say=lambda s: None)
    rows = _rows(tmp_path / "run")
    assert [r["round"] for r in rows] == [0, 1, 2, 3, 4]
    assert all({"test_loss", "test_mae", "test_r2"} <= set(r) for r in rows)
    assert not any("accuracy" in key for r in rows for key in r)   # a regression has none
    assert rows[-1]["test_r2"] > rows[0]["test_r2"] + 0.3 and rows[-1]["test_mae"] < rows[0]["test_mae"]
    s = result.summary
    assert s["headline"] == "r2" and s["higher_is_better"] and s["final_r2"] == rows[-1]["test_r2"]
    assert s["best_r2"] == max(r["test_r2"] for r in rows) and s["model"]["app"]["name"] == "diabetes"
    # exported, and served by ONNX Runtime: the card scores it by the app's metrics, as the run did
    card = json.loads((tmp_path / "run" / "export" / "model.card.json").read_text())
    assert card["test_r2"] == pytest.approx(rows[-1]["test_r2"], abs=1e-5) and card["headline"] == "r2"
    assert card["input"]["shape"] == ["batch", 10] and card["output"]["shape"] == ["batch", 1]
    assert card["app"] == s["model"]["app"] and card["preprocessing"]["output"].startswith("progression")
    assert "accuracy" not in json.dumps(card) and s["export"]["onnx"].endswith("model.onnx")
    from coordinator.ui.status_cli import read_run_dir
    status = read_run_dir(tmp_path / "run")["run"]
    assert status["headline"] == "r2" and status["test_r2"] == rows[-1]["test_r2"]   # status says the headline
    from export.cli import main as export_main
    assert export_main([str(tmp_path / "run"), "-o", str(tmp_path / "again.onnx")]) == 0   # fedge-export, too
    again = json.loads((tmp_path / "again.card.json").read_text())
    assert again["test_r2"] == card["test_r2"] and again["sha256"] == card["sha256"]


def test_devices_with_their_own_files_train_the_example_app_over_mosquitto(tmp_path, diabetes_app, mosquitto,
                                                                            prefix):
    from diabetes_app.split import main as split

    split([str(tmp_path / "devices"), "3"])
    devices = [subprocess.Popen([sys.executable, "-m", "edge_client.cli", "run", "--broker", mosquitto,
                                 "--client-id", f"device-00{i}", "--app", "diabetes_app:app", "--prefix", prefix,
                                 "--data", str(tmp_path / "devices" / f"device-00{i}.csv"),
                                 "--state-dir", str(tmp_path / f"state-{i}"), "--exit-after-run"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in (1, 2, 3)]
    try:
        result = run_federated(_config(tmp_path / "run", transport__broker=mosquitto, transport__prefix=prefix,
                                       clients__spawn=0, run__rounds=8), say=lambda s: None)
    finally:
        said = [device.communicate(timeout=60)[1] for device in devices]
    rows = _rows(tmp_path / "run")
    assert all(r["returned"] == 3 for r in rows[1:]) and all(d.returncode == 0 for d in devices), said
    assert rows[-1]["test_r2"] > rows[0]["test_r2"] + 0.3 and result.summary["final_r2"] == rows[-1]["test_r2"]
    # each device trained on its own file's patients: 148, 147 and 147 of the 442
    profiles = [json.loads(line) for i in (1, 2, 3)
                for line in (tmp_path / f"state-{i}" / "profile.jsonl").read_text().splitlines()[-1:]]
    assert sorted(p["samples"] for p in profiles) == [147, 147, 148]


def test_a_device_whose_app_differs_refuses_the_task_naming_both(tmp_path, diabetes_app, mosquitto, prefix,
                                                                  monkeypatch):
    other = tmp_path / "elsewhere"
    shutil.copytree(EXAMPLE / "diabetes_app", other / "diabetes_app")
    with open(other / "diabetes_app" / "__init__.py", "a") as fh:
        fh.write("\n# a later edit of the same version\n")
    monkeypatch.setenv("PYTHONPATH", str(other))   # the devices import their own copy, the coordinator this one
    config = _config(tmp_path / "run", transport__broker=mosquitto, transport__prefix=prefix, run__rounds=1,
                     clients__round_timeout=20.0, clients__max_attempts=1)
    with pytest.raises(RunError, match=r"the task was made with app diabetes 1\.0\.0 \(digest \w{12}\) but this device "
                                       r"has diabetes 1\.0\.0 \(digest \w{12}\)"):
        run_federated(config, say=lambda s: None)
    assert "diabetes_app" in sys.modules
