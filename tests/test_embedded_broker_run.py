"""A simulated run on the embedded broker ends quietly, also on a busy machine.

amqtt gives each delivery 5 s for its PUBACK, and the coordinator acknowledges a message when it
takes it. A run that stopped reading while its spawned clients left (on a busy machine they take
seconds to) ended with amqtt's warnings and a traceback per unacknowledged message between the last
round and the result, though nothing had gone wrong.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_HOG = ["sh", "-c", "while :; do :; done"]
# What the broker's logging looks like when it escapes: its levels, its tracebacks, asyncio's reports.
NOISE = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|Traceback|amqtt|PUBACK|Task exception|Task failed")


@pytest.mark.timeout(150)
def test_a_run_on_the_embedded_broker_ends_without_broker_noise_beside_a_cpu_hog(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "coordinator.ui.cli", "run", "--spawn-clients", "2", "--clients", "2",
           "--data", "digits", "--rounds", "1", "--set", "export.enabled=false", "--out", str(tmp_path / "run")]
    hogs = [subprocess.Popen(CPU_HOG) for _ in range(2)]   # as many as the cores of a small machine
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=140,
                              env={**os.environ, "COLUMNS": "200"})
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "final test accuracy" in done.stdout and "run directory:" in done.stdout, output
    noise = [line for line in output.splitlines() if NOISE.search(line)]
    assert not noise, output
