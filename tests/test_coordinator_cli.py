"""``fedge-coordinator run`` as a person meets it: one-line errors, honest Ctrl-C, no stray run directories."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator.ui.cli import main

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--transport", "inproc", "--spawn-clients", "2", "--clients", "2", "--rounds", "1", "--data", "digits",
         "--model", "mlp", "--set", "model.hidden=[16]", "--set", "export.enabled=false"]


def test_an_unknown_section_is_named_in_the_error(capsys):
    assert main(["run", "--set", "bogus.x=1"]) == 2
    out = capsys.readouterr().out
    assert "unknown config section [bogus]" in out


def test_a_malformed_broker_url_is_one_line_at_once_and_leaves_no_run_directory(tmp_path, capsys):
    for url in ("127.0.0.1:1883", "tcp://127.0.0.1:1883"):
        started = time.monotonic()
        assert main(["run", "--broker", url, "--out", str(tmp_path / "run")]) == 2
        out = capsys.readouterr().out.strip()
        assert "must look like mqtt://HOST:PORT" in out and len(out.splitlines()) <= 2
        assert time.monotonic() - started < 5 and not (tmp_path / "run").exists()


def test_a_failed_start_leaves_no_run_directory(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--data", f"npz:{tmp_path / 'missing.npz'}", "--out", str(out)]) == 2
    assert "npz file not found" in capsys.readouterr().out
    assert not out.exists()


def test_resuming_a_finished_run_changes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", *QUICK, "--out", str(out)]) == 0
    summary = (out / "summary.json").read_text()
    assert "next: fedge-profile show" in capsys.readouterr().out
    assert main(["run", "--resume", "--out", str(out)]) == 0
    assert "finished all 1 rounds already; nothing to resume" in capsys.readouterr().out
    assert (out / "summary.json").read_text() == summary
    assert len(json.loads(summary)) > 5


def test_ctrl_c_before_round_one_says_there_is_nothing_to_resume(tmp_path, mosquitto, prefix):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "coordinator.ui.cli", "run", "--broker", mosquitto, "--clients", "3",
           "--data", "digits", "--out", str(out), "--set", f"transport.prefix={prefix}"]
    # Ctrl-C as at a terminal: a test run started in the background of a shell without job control
    # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt for it.
    # faulthandler: should it ever hang after Ctrl-C, SIGABRT makes it print every thread's stack.
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    seen = ""
    while "waiting for 3 clients" not in seen:   # no client will come: the run waits before round 1
        assert proc.poll() is None and time.monotonic() < deadline, seen
        seen += proc.stdout.readline()
    proc.send_signal(signal.SIGINT)
    try:
        rest, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        rest, err = proc.communicate(timeout=30)
        pytest.fail(f"the coordinator did not exit within 30 s of Ctrl-C; its output:\n{seen}{rest}\n"
                    f"its threads when it was aborted:\n{err}")
    assert proc.returncode == 130, seen + rest + err
    assert "nothing to resume" in rest and "--resume" not in rest.replace("nothing to resume", "")
    assert "Traceback" not in err
    assert not out.exists()   # nothing was checkpointed: no run directory pretends otherwise
