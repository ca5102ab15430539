"""``fedge-coordinator status`` after real runs: the round a finished run names, and a device's speed taken
from its training tasks, not from whatever task it answered last (the metrics endpoint's device quantiles too).

Small digits federations: one over Mosquitto (spawned client processes) whose retained run status the command
reads afterwards, one in process with FedAvg + FFC, whose last task on every device is the calibration pass.
"""

from __future__ import annotations

import json
import re

import pytest

from coordinator.runtime.run import run_federated
from coordinator.ui.cli import main
from storage.files import read_jsonl
from test_federation import config_for
from test_metrics_endpoint import counter, scrape


def test_a_finished_run_names_its_last_round(tmp_path, mosquitto, prefix, capsys):
    config = config_for(tmp_path / "run", transport__broker=mosquitto, transport__prefix=prefix,
                        clients__expected=2, clients__spawn=2, export__enabled=False)
    run_federated(config, say=lambda s: None)
    args = ["status", "--broker", mosquitto, "--set", f"transport.prefix={prefix}", "--wait", "1"]
    assert main([*args, "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["broker"]["run"]
    assert (run["state"], run["round"]) == ("finished", 2)   # a 2-round run, not "round 3"
    assert main(args) == 0
    assert "finished after round 2" in capsys.readouterr().out


def test_a_devices_speed_comes_from_its_training_tasks(tmp_path, capsys):
    """In the status command and in the metrics endpoint's device quantiles (scraped after the last row)."""
    config = config_for(tmp_path / "ffc", transport__kind="inproc", run__strategy="fedavg_ffc",
                        model__name="mlp", model__hidden=[32], export__enabled=False, clients__expected=3,
                        clients__spawn=3, metrics__enabled=True, metrics__port=0)
    said: list[str] = []
    scraped: list[dict] = []

    def on_round(row: dict) -> None:
        if row["round"] == config.run.rounds:   # the calibration pass is over: every device's last task
            scraped.append(scrape(re.search(r"serving metrics at (http://\S+)", "\n".join(said)).group(1)))

    result = run_federated(config, say=said.append, on_round=on_round)
    assert main(["status", "--run-dir", str(result.out_dir), "--json"]) == 0
    devices = {d["client_id"]: d for d in json.loads(capsys.readouterr().out)["devices"]}
    assert len(devices) == 3
    for client, shown in devices.items():
        answers = read_jsonl(result.out_dir / "clients" / f"{client}.jsonl")
        assert answers[-1]["objective"] == "ffc_stats"   # the calibration pass came last ...
        trained = [a["profile"] for a in answers if a["objective"] == "train" and a["profile"]]
        # ... yet the figures are those of its last training task
        assert shown["task_seconds"] == trained[-1]["seconds"] != answers[-1]["profile"]["seconds"]
        assert shown["step_seconds"] == trained[-1]["step_p50"]
        assert shown["peak_memory_bytes"] == trained[-1]["peak_rss_bytes"]
    times = sorted(d["task_seconds"] for d in devices.values())
    assert counter(scraped[0], "fedge_device_task_seconds", quantile="0.5") == pytest.approx(times[1])
    assert main(["status", "--run-dir", str(result.out_dir)]) == 0
    table = capsys.readouterr().out
    assert "peak MiB" in table and "peak MB" not in table   # sizes are in 2**20 bytes
