"""Over-selection on a real Mosquitto with real device processes, one of them slow: every round closes at
``clients.per_round`` results without it, its results come as ``late`` (each counted once, acknowledged,
never aggregated) and no task it was told closed is trained."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil

ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
DELAY = 0.6   # seconds the slow device adds to each task: several rounds' worth on this model

# The device's own CLI, with every task taking DELAY seconds longer (a slow or busy device).
SLOW_DEVICE = f"""
import sys, time
from edge_client.client import EdgeClient

execute = EdgeClient._execute

def slow(self, *args, **kwargs):
    time.sleep({DELAY})
    return execute(self, *args, **kwargs)

EdgeClient._execute = slow
from edge_client.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _device(broker: str, prefix: str, index: int, state: Path, slow: bool) -> subprocess.Popen:
    head = [sys.executable, "-c", SLOW_DEVICE] if slow else [sys.executable, "-m", "edge_client.cli"]
    args = ["run", "--broker", broker, "--client-id", f"dev-{index}", "--data", "digits", "--partition", "iid",
            "--partition-index", str(index), "--num-partitions", "3", "--seed", "3", "--state-dir",
            str(state / f"dev-{index}"), "--prefix", prefix, "--torch-threads", "1", "--exit-after-run", "-v"]
    return subprocess.Popen(head + args, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=(state / f"dev-{index}.log").open("w"))


def test_a_slow_device_is_closed_out_and_its_late_results_count_once(tmp_path, mosquitto, prefix):
    out = tmp_path / "run"
    devices = [_device(mosquitto, prefix, i, tmp_path, slow=i == 2) for i in range(3)]
    try:
        run = subprocess.run([sys.executable, "-m", "coordinator.ui.cli", "run", "--data", "digits", "--model", "mlp",
                              "--set", "model.hidden=[16]", "--rounds", "20", "--clients", "3", "--broker", mosquitto,
                              "--out", str(out), "--set", f"transport.prefix={prefix}", "--set", "clients.per_round=2",
                              "--set", "clients.over_select=1.5", "--set", "clients.round_timeout=30",
                              "--set", "export.enabled=false", "--set", "eval.every=20"],
                             env=ENV, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
    finally:
        for device in devices:
            if device.poll() is None:
                device.terminate()
        psutil.wait_procs([psutil.Process(d.pid) for d in devices if d.poll() is None], timeout=30)
    rows = [row for line in (out / "metrics.jsonl").read_text().splitlines() if (row := json.loads(line))["round"]]
    assert [r["round"] for r in rows] == list(range(1, 21))
    for row in rows:   # three drawn, two counted, none failed: the round closed without the third
        assert (row["selected"], row["returned"], row["counted"], row["failed"]) == (3, 2, 2, 0), row
        assert row["closed_early"] and len(row["closed_clients"]) == 1
    assert sum("dev-2" in r["closed_clients"] for r in rows) >= 15   # the slow one, nearly always

    # Each late result is counted once: as late_closed in a row, or after the last row (the run was ending);
    # the log names each task once, and a copy re-sent before its acknowledgement is a duplicate, never late again.
    log = (out / "coordinator.log").read_text()
    late_tasks = re.findall(r"late result from dev-\d: task (\S+) of round \d+ closed", log)
    assert late_tasks and len(late_tasks) == len(set(late_tasks))
    counted_late = sum(r.get("late_closed", 0) for r in rows)
    assert 1 <= counted_late <= len(late_tasks)
    assert sum(r["late"] for r in rows) == counted_late   # no other late result
    # Never aggregated: every row counted two results, and each late one is recorded once, as late, with the
    # round time the coordinator measured (what selection learns of the slow device).
    records = [json.loads(line) for path in (out / "clients").glob("*.jsonl") for line in path.read_text().splitlines()]
    late_records = [r["task_id"] for r in records if r.get("late")]
    assert sorted(late_records) == sorted(late_tasks)
    assert len({r["task_id"] for r in records}) == len(records)
    # Nothing retrained: the slow device trained each round's task at most once, and every task it was told was
    # closed before it began was skipped, not trained.
    said = (tmp_path / "dev-2.log").read_text()
    trained = [int(n) for n in re.findall(r"round (\d+): train on", said)]
    assert len(trained) == len(set(trained))
    skipped = {int(n) for n in re.findall(r"skipped task \S+: round (\d+) closed without it", said)}
    assert not skipped & set(trained)
