"""Every template of ``fedge-coordinator new`` trains on a fleet: three device processes, each with its own data file,
over Mosquitto, with the template's own training settings; every device returns every round, the headline rises and
the export's card carries it."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coordinator.config import load_config
from coordinator.ops.scaffold import TEMPLATES, write_app
from coordinator.runtime.run import run_federated
from edge_client.app import load_app

DEVICES = 3
# samples on each device: enough to learn from in a few rounds, few enough to stay fast (the table: all its rows)
PER_DEVICE = {"tabular": None, "timeseries": 300, "vision": 200, "audio": 200}
ROUNDS = 5
RISE = {"accuracy": 0.3, "r2": 0.3}   # how far above round 0 the headline must end


def _on_path(monkeypatch, root: Path) -> None:
    """``root``'s packages importable here and in the processes this test starts (as tests/test_app_runs.py)."""
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])]))
    importlib.invalidate_caches()


def _device_files(app, template: str, out: Path) -> list[Path]:
    """One data file per device in the format the template's loader reads (a CSV for the table rows, an npz for the
    rest), each a different part of the template's own data: the generated sets drawn with each device's own seed."""
    out.mkdir()
    source = TEMPLATES[template][1]
    files = []
    for i in range(DEVICES):
        if source == "synthetic":
            samples = app.device_data(f"synthetic:{i + 1}")
            pick = np.random.default_rng(i).permutation(len(samples))[:PER_DEVICE[template]]
            files.append(out / f"device-{i}.npz")
            np.savez(files[-1], x=samples.x[pick].numpy(), y=samples.y[pick].numpy())
        else:   # the bundled set, dealt out row by row
            samples = app.device_data(source)
            rows = np.concatenate([samples.x.numpy(), samples.y.numpy().reshape(len(samples), -1)], axis=1)
            files.append(out / f"device-{i}.csv")
            np.savetxt(files[-1], rows[i::DEVICES][:PER_DEVICE[template]], delimiter=",")
    return files


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_a_new_app_trains_on_device_processes_over_mosquitto(template, tmp_path, monkeypatch, mosquitto, prefix):
    name = f"fleet_{template}"
    root = write_app(name, template, tmp_path)
    _on_path(monkeypatch, root)
    app = load_app(f"{name}_app:app")
    files = _device_files(app, template, tmp_path / "data")
    devices = [subprocess.Popen([sys.executable, "-m", "edge_client.cli", "run", "--broker", mosquitto,
                                 "--client-id", f"device-{i}", "--app", f"{name}_app:app", "--prefix", prefix,
                                 "--data", str(path), "--state-dir", str(tmp_path / f"state-{i}"),
                                 "--torch-threads", "1", "--exit-after-run"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
               for i, path in enumerate(files)]
    sets = {("run", "rounds"): ROUNDS, ("run", "out"): str(tmp_path / "run"), ("app", "module"): f"{name}_app:app",
            ("data", "eval"): TEMPLATES[template][1], ("clients", "expected"): DEVICES,
            ("clients", "round_timeout"): 30.0, ("clients", "presence_timeout"): 60.0,
            ("aggregate", "order"): "sorted",
            ("transport", "broker"): mosquitto, ("transport", "prefix"): prefix}
    sets.update({tuple(key.split(".")): value for key, value in TEMPLATES[template][2].items()})   # its own settings
    try:
        result = run_federated(load_config(None, [(*key, value) for key, value in sets.items()]), say=lambda s: None)
    finally:
        said = [device.communicate(timeout=60)[1] for device in devices]
    assert all(device.returncode == 0 for device in devices), said
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    headline = result.summary["headline"]
    assert headline == app.headline and app.metrics[headline].higher_is_better
    assert [r["returned"] for r in rows[1:]] == [DEVICES] * ROUNDS and not any(r["failed"] for r in rows[1:]), said
    first, last = rows[0][f"test_{headline}"], rows[-1][f"test_{headline}"]
    assert last > first + RISE[headline], [r[f"test_{headline}"] for r in rows]
    card = json.loads((tmp_path / "run" / "export" / "model.card.json").read_text())
    assert (tmp_path / "run" / "export" / "model.onnx").is_file() and card["headline"] == headline
    assert card[f"test_{headline}"] == pytest.approx(last, abs=1e-5)
