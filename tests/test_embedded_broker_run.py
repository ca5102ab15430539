"""A simulated run on the embedded broker ends cleanly, also on a busy machine.

amqtt gives each delivery 5 s for its PUBACK, and the coordinator acknowledges a message when it
takes it. A run that stopped reading while its spawned clients left (on a busy machine they take
seconds to) ended with amqtt's warnings and a traceback per unacknowledged message between the last
round and the result, though nothing had gone wrong. The run here shows the broker's own logging
(``FEDGE_BROKER_DEBUG``; the console still shows warnings and errors only), so what it checks is the
shutdown itself, not the muting that hides amqtt's lines by default (tests/test_embedded_broker.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_HOG = ["sh", "-c", "while :; do :; done"]
# What the broker's logging looks like when it escapes: its levels, its tracebacks, asyncio's reports.
NOISE = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|Traceback|amqtt|PUBACK|Task exception|Task failed")


@pytest.mark.timeout(150)
def test_a_run_on_the_embedded_broker_ends_without_broker_noise_beside_a_cpu_hog(tmp_path: Path) -> None:
    # The hogs start with the last round, four a core: the clients take seconds to leave, as on a loaded
    # machine, and the test does not wait as long for them to start.
    cmd = [sys.executable, "-m", "coordinator.ui.cli", "run", "--spawn-clients", "3",
           "--clients", "3", "--data", "digits", "--rounds", "1", "--set", "export.enabled=false",
           "--out", str(tmp_path / "run")]
    run = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "COLUMNS": "200", "FEDGE_BROKER_DEBUG": "1"})
    hogs: list[subprocess.Popen] = []
    lines: list[str] = []
    deadline = time.monotonic() + 140
    try:
        for line in run.stdout:   # type: ignore[union-attr]
            lines.append(line)
            if not hogs and re.match(r"\s+1\s+\d\.\d{4}\s", line):   # the row of round 1, the last
                hogs = [subprocess.Popen(CPU_HOG) for _ in range(4 * len(os.sched_getaffinity(0)))]
            assert time.monotonic() < deadline, "".join(lines)
        run.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        run.kill()
        for hog in hogs:
            hog.kill()
            hog.wait()
    output = "".join(lines)
    assert hogs and run.returncode == 0, output
    assert "final test accuracy" in output and "run directory:" in output, output
    noise = [line for line in output.splitlines() if NOISE.search(line)]
    assert not noise, output
