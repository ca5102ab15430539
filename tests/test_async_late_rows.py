"""Async mode after a hard stop: the results of tasks given before the resume, which the broker holds for the
coordinator and hands it as soon as it is back (before its first version), are counted late in
``metrics.jsonl`` as many times as the log names them.

A coordinator process on a real Mosquitto with spawned client processes training on digits, killed right
after a checkpoint and resumed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def _coordinator_cmd(out: Path, broker: str, prefix: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "coordinator.ui.cli", "run", "--data", "digits", "--model", "mlp",
            "--set", "model.hidden=[16]", "--rounds", "8", "--clients", "4", "--spawn-clients", "4",
            "--broker", broker, "--out", str(out), "--set", f"transport.prefix={prefix}", "--set", "run.mode=async",
            "--set", "async.buffer_size=2", "--set", "export.enabled=false", *extra]


def test_late_results_after_a_resume_are_in_the_rows(tmp_path, mosquitto, prefix, kill_after_checkpoint):
    out = tmp_path / "run"
    proc = subprocess.Popen(_coordinator_cmd(out, mosquitto, prefix), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    kill_after_checkpoint(proc, out, 2)   # tasks were in flight: their results wait on the broker
    logged_before = len((out / "coordinator.log").read_text().splitlines())
    checkpointed = max(json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines())
    resumed = subprocess.run(_coordinator_cmd(out, mosquitto, prefix, "--resume"), capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    log = (out / "coordinator.log").read_text().splitlines()[logged_before:]
    late_logged = sum("late result from" in line for line in log)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert late_logged >= 1   # the results of the tasks in flight at the kill came back as late
    assert sum(r["late"] for r in rows if r["round"] > checkpointed) == late_logged
