"""A user's app trains end to end: its model, data, loss and metrics in the rows, in process and over MQTT with
device processes; a device whose app differs from the run's refuses its tasks naming both."""

from __future__ import annotations

import importlib
import json
import re
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


def test_an_app_refusal_travels_as_its_kind_and_benches_the_device_until_it_comes_online_again():
    import logging

    from coordinator.runtime.presence import Roster
    from coordinator.runtime.selection import Absences
    from edge_client.device_protocol import presence_payload
    from edge_client.wire.protocol import REFUSAL_APP, PresenceBody, ResultBody
    from edge_client.wire.throttle import ThrottledLog

    body = ResultBody(error="the task was made with app ...", refusal=REFUSAL_APP).to_body()
    assert body["refusal"] == "app" and ResultBody.from_body(body).refusal == REFUSAL_APP
    assert "refusal" not in ResultBody(error="no data").to_body()
    assert ResultBody.from_body({"error": "x", "refusal": "a_later_kind"}).refusal == "a_later_kind"   # a failure
    with pytest.raises(ValueError, match="refusal"):
        ResultBody.from_body({"error": "x", "refusal": "App!"})
    absences = Absences(limit=2)
    roster = Roster(absences, ThrottledLog(logging.getLogger("test")))
    online, offline = (presence_payload("d1", PresenceBody(state)) for state in ("online", "offline"))
    for client_id in ("d0", "d1"):
        roster.on_presence(client_id, presence_payload(client_id, PresenceBody("online")))
    assert absences.refused_for_app("d1", "line") and not absences.refused_for_app("d1", "line")
    absences.returned("d1")   # an answer does not bring it back: its app is still not the run's
    roster.on_presence("d1", online)   # nor its presence again while online (a reconnect, a retained copy)
    assert roster.answering() == ["d0"] and absences.wrong_app == {"d1": "line"}
    roster.on_presence("d1", offline)
    roster.on_presence("d1", online)   # restarted, perhaps with the run's app: drawn again
    assert roster.answering() == ["d0", "d1"] and not absences.wrong_app


def test_a_run_goes_on_without_the_device_whose_app_differs_and_counts_it(tmp_path, diabetes_app, mosquitto, prefix,
                                                                          capsys):
    from diabetes_app.split import main as split

    from coordinator.ui.cli import main as coordinator_main

    split([str(tmp_path / "devices"), "3"])
    other = tmp_path / "elsewhere"
    shutil.copytree(EXAMPLE / "diabetes_app", other / "diabetes_app")
    with open(other / "diabetes_app" / "__init__.py", "a") as fh:
        fh.write("\n# a later edit of the same version\n")
    # device-003 imports its own copy; the coordinator and the other two devices the example's
    path = [str(other), *(p for p in os.environ["PYTHONPATH"].split(os.pathsep) if p != str(EXAMPLE))]
    odd = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    devices = [subprocess.Popen([sys.executable, "-m", "edge_client.cli", "run", "--broker", mosquitto,
                                 "--client-id", f"device-00{i}", "--app", "diabetes_app:app", "--prefix", prefix,
                                 "--data", str(tmp_path / "devices" / f"device-00{i}.csv"),
                                 "--state-dir", str(tmp_path / f"state-{i}"), "--exit-after-run"],
                                env=odd if i == 3 else None, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True) for i in (1, 2, 3)]
    try:   # a quorum of 2: the two devices with the run's app carry it
        run_federated(_config(tmp_path / "run", transport__broker=mosquitto, transport__prefix=prefix,
                              clients__spawn=0, clients__min_results=2, run__rounds=3), say=lambda s: None)
    finally:
        said = [device.communicate(timeout=60)[1] for device in devices]
    capsys.readouterr()   # what the split printed
    rows = _rows(tmp_path / "run")
    assert [(r["selected"], r["returned"], r["app_refused"]) for r in rows[1:]] == [(3, 2, 1), (2, 2, 1), (2, 2, 1)]
    assert [r["failed"] for r in rows[1:]] == [1, 0, 0], said   # refused once, then given no task again
    history = tmp_path / "run" / "clients" / "device-003.jsonl"
    answers = [json.loads(line) for line in history.read_text().splitlines()]
    assert len(answers) == 1 and answers[0]["refusal"] == "app"
    mismatch = r"the task was made with app diabetes 1\.0\.0 \(digest \w{12}\) but this device has diabetes 1\.0\.0"
    logged = (tmp_path / "run" / "coordinator.log").read_text()
    assert len(re.findall(mismatch, logged)) == 1 and "client device-003 refuses this run's tasks" in logged
    assert re.search(mismatch, said[2]) and all(d.returncode == 0 for d in devices), said
    # fedge-coordinator status shows it
    assert coordinator_main(["status", "--run-dir", str(tmp_path / "run"), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["run"]["app_refused"] == 1
    assert [d["client_id"] for d in status["devices"] if d["app_refused"]] == ["device-003"]
    assert coordinator_main(["status", "--run-dir", str(tmp_path / "run")]) == 0
    assert "1 device(s) refused for their app, which is not the run's (device-003)" in capsys.readouterr().out
