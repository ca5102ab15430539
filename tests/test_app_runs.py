"""A user's app trains end to end: its model, data, loss and metrics in the rows, in process and over MQTT with
device processes; a device whose app differs from the run's refuses its tasks naming both."""

from __future__ import annotations

import importlib
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from coordinator.config import load_config
from coordinator.runtime.engine import RunError
from coordinator.runtime.run import run_federated

# A regression on scikit-learn's diabetes data, written against the app interface alone.
DIABETES = '''
"""Disease progression from ten clinical readings: MSE, MAE and R^2."""
import torch
from torch import nn
from edge_client.app import App, ExampleInput, Metric, Samples


def model(options):
    hidden = int(options.get("hidden", 32))
    return nn.Sequential(nn.Linear(10, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def load(location):
    from sklearn.datasets import load_diabetes
    x, y = load_diabetes(return_X_y=True)
    return Samples(torch.tensor(x, dtype=torch.float32) * 10,
                   (torch.tensor(y, dtype=torch.float32).unsqueeze(1) - 152.0) / 77.0)


def mae(outputs, targets):
    return float((outputs - targets).abs().mean())


def r2(outputs, targets):
    return float(1 - ((outputs - targets) ** 2).sum() / ((targets - targets.mean()) ** 2).sum())


app = App(name="diabetes", version="1.0", model=model, example_input=ExampleInput((10,)), device_data=load,
          eval_data=load, loss=nn.functional.mse_loss, metrics={"mae": Metric(mae, False), "r2": Metric(r2)},
          headline="r2")
'''


def _package(root: Path, extra: str = "") -> Path:
    package = root / "diabetes_app"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(DIABETES) + extra)
    return root


@pytest.fixture
def diabetes_app(tmp_path, monkeypatch) -> Path:
    """The app's package on this process's path and its spawned devices'."""
    root = _package(tmp_path / "site-packages")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])]))
    importlib.invalidate_caches()
    return root


def _config(out: Path, **sets):
    base = {"run__rounds": 4, "run__out": str(out), "app__module": "diabetes_app:app", "train__lr": 0.05,
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


def test_a_regression_app_trains_over_mosquitto_with_device_processes_as_in_process(tmp_path, diabetes_app,
                                                                                     mosquitto, prefix):
    run_federated(_config(tmp_path / "mqtt", transport__broker=mosquitto, transport__prefix=prefix),
                  say=lambda s: None)
    run_federated(_config(tmp_path / "inproc", transport__kind="inproc"), say=lambda s: None)
    over_mqtt, in_process = _rows(tmp_path / "mqtt"), _rows(tmp_path / "inproc")
    assert [r["test_r2"] for r in over_mqtt] == [r["test_r2"] for r in in_process]   # the same devices' work
    assert all(r["returned"] == 3 for r in over_mqtt[1:])


def test_a_device_whose_app_differs_refuses_the_task_naming_both(tmp_path, diabetes_app, mosquitto, prefix,
                                                                  monkeypatch):
    other = _package(tmp_path / "elsewhere", extra="\n# a later edit of the same version\n")
    monkeypatch.setenv("PYTHONPATH", str(other))   # the devices import their own copy, the coordinator this one
    config = _config(tmp_path / "run", transport__broker=mosquitto, transport__prefix=prefix, run__rounds=1,
                     clients__round_timeout=20.0, clients__max_attempts=1)
    with pytest.raises(RunError, match=r"the task was made with app diabetes 1\.0 \(digest \w{12}\) but this device "
                                       r"has diabetes 1\.0 \(digest \w{12}\)"):
        run_federated(config, say=lambda s: None)
    assert "diabetes_app" in sys.modules
