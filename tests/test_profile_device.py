"""`fedge-profile show` on a device: only the client extra installed, so no rich and no matplotlib.

Each command runs in a subprocess whose imports of rich and matplotlib fail, as on a
device, on the histories the clients of tests/fixtures/profile_run kept in their
state directories (``clients/ID/profile.jsonl``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "profile_run"
ROOT = Path(__file__).resolve().parents[1]
STATE_DIR = FIXTURE / "clients" / "sim-000"
TASKS = [json.loads(line) for line in (STATE_DIR / "profile.jsonl").read_text().splitlines()]

# Runs profiling.cli.main as on a device: importing rich or matplotlib raises ModuleNotFoundError.
WITHOUT_RICH = """
import sys
from importlib.abc import MetaPathFinder

class Missing(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("rich", "matplotlib"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Missing())
from profiling.cli import main
sys.exit(main(sys.argv[1:]))
"""


def fedge_profile(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT_RICH, *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def task_rows(out: str) -> list[list[str]]:
    """The rows of the plain-text tasks table: the lines that start with the run id."""
    run_id = TASKS[0]["run_id"]
    return [line.split() for line in out.splitlines() if line.startswith(run_id)]


@pytest.mark.parametrize("path", [STATE_DIR / "profile.jsonl", STATE_DIR], ids=["profile.jsonl", "state-dir"])
def test_show_prints_a_devices_own_history_without_rich(path):
    done = fedge_profile("show", str(path))
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    out = done.stdout
    assert "Tasks of sim-000" in out and "Where a task's time goes" in out
    rows = task_rows(out)
    assert [int(row[1]) for row in rows] == [t["round"] for t in TASKS]   # one row per task, with its round
    for row, task in zip(rows, TASKS):
        assert row[2] == f"{task['seconds']:.2f}"                       # the device's own time
    header = next(line for line in out.splitlines() if line.startswith("run"))
    assert "forward" in header and "peak RSS" in header and "│" not in out   # plain text, not rich's boxes


def test_html_without_matplotlib_says_what_to_install_in_one_line(tmp_path):
    done = fedge_profile("html", str(FIXTURE), "-o", str(tmp_path / "report.html"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().count("\n") == 0
    assert "matplotlib" in done.stderr and "fedge[coordinator]" in done.stderr
    assert not (tmp_path / "report.html").exists()
