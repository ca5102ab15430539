"""Long steps say what they are doing: fedge-export names each step of an int8 export as it starts,
and the coordinator's start-up lines are printed once with -v."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.ui.cli import main as coordinator_main

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--transport", "inproc", "--spawn-clients", "2", "--clients", "2", "--rounds", "1", "--data", "digits",
         "--model", "mlp", "--set", "model.hidden=[16]", "--set", "export.enabled=false"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("progress") / "run"
    assert coordinator_main(["run", *QUICK, "--out", str(out)]) == 0
    return out


def test_an_int8_export_names_each_step_as_it_starts(run_dir):
    done = subprocess.run([sys.executable, "-m", "export.cli", str(run_dir), "--int8", "--parity-samples", "100",
                           "--calibration-samples", "64"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    steps = [line.removeprefix("fedge-export: ") for line in done.stderr.splitlines()]
    assert steps == [
        f"exporting {run_dir} to ONNX and checking it against torch on up to 100 test samples",
        "int8: static quantization, refused if its test accuracy is more than 1 points below float32's",
        "int8: preparing the graph",
        "int8: calibrating activation ranges on 64 training samples",
        "int8: quantizing weights and activations",
        "int8: checking its test accuracy on 359 samples",   # digits: 20% of 1,797
    ], done.stderr
    assert "wrote" in done.stdout and ".int8.onnx" in done.stdout


def test_the_model_and_partition_lines_are_printed_once_with_v(tmp_path):
    # A process of its own: in pytest's process the root logger already has handlers, and the
    # command's terminal handler would never be installed.
    done = subprocess.run([sys.executable, "-m", "coordinator.ui.cli", "run", *QUICK, "--out", str(tmp_path / "run"),
                           "-v"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = (done.stdout + done.stderr).splitlines()
    assert sum("model mlp:" in line for line in lines) == 1, done.stdout + done.stderr
    assert sum("partition iid" in line for line in lines) == 1, done.stdout + done.stderr


def test_a_piped_log_prints_every_count_of_clients_coming_online(tmp_path):
    three = [a if a != "2" else "3" for a in QUICK]   # three spawned clients, three expected
    done = subprocess.run([sys.executable, "-m", "coordinator.ui.cli", "run", *three, "--out", str(tmp_path / "run")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    counts = [int(line.split(": ")[1].split("/")[0]) for line in done.stdout.splitlines()
              if line.startswith("waiting for clients: ")]
    assert counts and counts == list(range(counts[0], 4)), done.stdout   # none skipped, up to 3/3
