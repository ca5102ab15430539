"""A mistyped command line is answered at once: the three commands check what the text alone shows
(config file, broker URL, data and partition specs, ranges) before torch is imported, which takes
seconds on a device. Each case runs the command in a fresh interpreter and asserts torch was never
imported, which holds however loaded the machine is."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Runs a command's main() and reports whether torch was imported by the time it returned.
PROBE = """
import sys
from {module} import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit:
    code = exit.code
print("torch imported" if "torch" in sys.modules else "torch not imported", file=sys.stderr)
sys.exit(code)
"""

BAD = [
    ("coordinator.ui.cli", ["run", "--config", "nope.toml"], "config file nope.toml does not exist"),
    ("coordinator.ui.cli", ["run", "--broker", "http://127.0.0.1:1883"], "not http://"),
    ("coordinator.ui.cli", ["run", "--set", "transport.broker=tcp://h:1883"], "not tcp://"),
    ("coordinator.ui.cli", ["run", "--set", 'data.eval="digits"', "--set", 'transport.broker="h:1"'],
     "broker URL 'h:1' must look like"),   # quoted --set values are read as TOML, as the configuration does
    ("coordinator.ui.cli", ["run", "--data", "mnist"], "unknown dataset spec 'mnist'"),
    ("coordinator.ui.cli", ["run", "--partition", "dirichlet:0"], "bad partition spec 'dirichlet:0'"),
    ("coordinator.ui.cli", ["run", "--rounds", "0"], "--rounds: 0 is out of range"),
    ("coordinator.ui.cli", ["run", "--resume", "--out", "no-such-run"], "no-such-run holds no run"),
    ("coordinator.ui.cli", ["worker", "--broker", "127.0.0.1:1883"], "the mqtt:// scheme is missing"),
    ("coordinator.ui.cli", ["fed2-depth", "--data", "bogus"], "unknown dataset spec 'bogus'"),
    ("edge_client.cli", ["run", "--client-id", "pi-01", "--data", "digits", "--broker", "http://h"], "not http://"),
    ("edge_client.cli", ["run", "--client-id", "pi-01", "--data", "npz:missing.npz"], "npz file not found"),
    ("edge_client.cli", ["run", "--data", "digits"], "give --client-id"),
    ("edge_client.cli", ["run", "--client-id", "pi-01", "--data", "digits", "--local-test-fraction", "1.5"],
     "--local-test-fraction: 1.5 is out of range"),
    ("edge_client.cli", ["run", "--client-id", "pi-01", "--data", "digits", "--max-message-bytes", "10"],
     "--max-message-bytes must be at least 1024"),
    ("export.cli", ["no-such-run"], "no-such-run does not exist"),
    ("export.cli", ["no-such-run", "--calibration-samples", "0"], "--calibration-samples: 0 is out of range"),
]


@pytest.mark.parametrize(("module", "args", "said"), BAD, ids=[" ".join(a) for _, a, _ in BAD])
def test_a_bad_command_line_is_one_line_without_importing_torch(tmp_path, module, args, said):
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", PROBE.format(module=module), *args], cwd=tmp_path,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=60)
    seconds = time.monotonic() - started
    *lines, probe = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and said in lines[0], done.stdout + done.stderr
    assert probe == "torch not imported"
    assert seconds < 10   # typically 0.2 s; the assertion above is what does not depend on load
    assert not any(tmp_path.iterdir())   # no run directory, no state directory
