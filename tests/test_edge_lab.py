"""The edge lab end to end: the 3-device test fleet (one memory-capped device, one flapping link)
built by bench/edge_lab.py as root, with a real Mosquitto, real fedge-client processes in their
namespaces and cgroups, and the real coordinator; then nothing of the lab may be left.

Needs root, cgroups and network namespaces: skipped with the reason elsewhere, but required in CI
(which runs as root on the machines the lab targets).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator.ops.mosquitto import mosquitto_binary

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from lab.fleet import FleetError, load_fleet  # noqa: E402
from lab.schedule import timeline  # noqa: E402

CGROUP = Path("/sys/fs/cgroup")
MIB = 1024 * 1024


def _why_not() -> str:
    """Why the lab cannot run here ("" when it can)."""
    if os.geteuid() != 0:
        return "the edge lab needs root (cgroups, network namespaces, tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if mosquitto_binary() is None:
        return "mosquitto is not installed"
    if not ((CGROUP / "cgroup.controllers").exists() or (CGROUP / "memory" / "memory.limit_in_bytes").exists()):
        return "no cgroup memory controller"
    probe = f"flabtest{secrets.token_hex(2)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return f"network namespaces cannot be created: {made.stderr.strip()}" if made.returncode else ""


def _memory_dir(lab: str, device: str) -> Path:
    unified = (CGROUP / "cgroup.controllers").exists()
    return CGROUP / lab / device if unified else CGROUP / "memory" / lab / device


def _limit(path: Path) -> int:
    name = "memory.max" if (path / "memory.max").exists() else "memory.limit_in_bytes"
    return int((path / name).read_text())


def _watch_capped(proc: subprocess.Popen, lab: str, timeout: float = 60.0) -> dict:
    """While the lab runs: the capped device's limit and the client process inside its cgroup."""
    path = _memory_dir(lab, "capped-01")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
            for pid in pids:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if b"edge_client.cli" in cmdline and b"capped-01" in cmdline:
                    return {"limit": _limit(path), "pid": pid, "cgroup": Path(f"/proc/{pid}/cgroup").read_text()}
        except OSError:
            pass
        time.sleep(0.2)
    return {}


def _leftovers(lab: str) -> list[str]:
    found = [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
             if n.startswith(lab)]
    found += [line for line in subprocess.run(["ip", "-o", "link", "show"], capture_output=True,
                                              text=True).stdout.splitlines() if f" {lab}-" in line]
    found += [str(p) for p in CGROUP.rglob(lab) if p.is_dir()] if not (CGROUP / "cgroup.controllers").exists() \
        else [str(CGROUP / lab)] * (CGROUP / lab).exists()
    marker = f"FEDGE_LAB_ID={lab[4:]}".encode()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(f"process {entry.name}")
        except OSError:
            pass
    return found


def test_lab_runs_the_test_fleet_and_leaves_nothing(tmp_path: Path) -> None:
    why = _why_not()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"the edge lab must run in CI: {why}")
        pytest.skip(why)
    lab_id = secrets.token_hex(2)
    lab, out = f"flab{lab_id}", tmp_path / "edge_lab.json"
    cmd = [sys.executable, str(REPO / "bench" / "edge_lab.py"), str(REPO / "bench" / "fleets" / "test.toml"),
           "--lab-id", lab_id, "--rounds", "3", "--per-round", "3", "--min-results", "2", "--round-timeout", "30",
           "--data", "digits", "--model", "mlp", "--out", str(out), "--work", str(tmp_path / "work")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        capped = _watch_capped(proc, lab)
        output, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.terminate()   # the lab cleans up on SIGTERM
            proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    assert capped, f"the capped device's client never showed up in its cgroup\n{output}"
    assert capped["limit"] == 512 * MIB
    assert f"{lab}/capped-01" in capped["cgroup"]

    result = json.loads(out.read_text())["policies"]["sync-random"]
    assert result["status"] == "completed" and result["rounds_completed"] == 3, result
    actions = [(e["device"], e["action"]) for e in result["events"]]
    assert ("flapping-01", "link_down") in actions and ("flapping-01", "link_up") in actions, actions
    device = result["devices"]["capped-01"]
    assert device["enforced"]["memory_limit_bytes"] == 512 * MIB and device["enforced"]["process_in_cgroup"]
    assert not device["oom_killed"] and device["exit_code"] == 0, device
    assert sum(c["contributed"] for c in result["contributors"].values()) == 3
    assert _leftovers(lab) == []


# --- The fleet file and the schedule, without root ----------------------------------------------------------------


def test_mixed_fleet_is_a_realistic_spread() -> None:
    fleet = load_fleet(REPO / "bench" / "fleets" / "mixed.toml")
    speeds = [d.speed for d in fleet.devices]
    assert len(fleet.devices) >= 30 and max(speeds) / min(speeds) >= 10
    assert any(d.klass == "pi-zero-2w" and d.memory_bytes == 512 * MIB for d in fleet.devices)
    assert abs(fleet.expected_offline_fraction() - 0.2) < 0.03
    assert {d.klass.split("-")[0] for d in fleet.devices} >= {"pi", "pi4", "pi5", "orin"}
    assert load_fleet(REPO / "bench" / "fleets" / "mixed.toml", cpu_scale=0.04).devices[0].cpu_share == 0.04


def test_schedule_is_seeded_and_alternates() -> None:
    fleet = load_fleet(REPO / "bench" / "fleets" / "mixed.toml")
    events = timeline(fleet.devices, seed=1, horizon=3600)
    assert events == timeline(fleet.devices, seed=1, horizon=3600) != timeline(fleet.devices, seed=2, horizon=3600)
    for device in fleet.devices:   # a link goes down, up, down, ...; never twice the same way
        links = [e.action for e in events if e.device == device.id and e.action.startswith("link")]
        assert all(a != b for a, b in zip(links, links[1:]))
    zero = [e for e in events if e.device == "pi-zero-2w-01" and e.action == "throttle"]
    assert zero and all(e.fraction == 0.6 for e in zero)


def test_fleet_errors_name_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[classes.pi]\nspeed = 1\nuplink = "fast"\n')
    with pytest.raises(FleetError, match=r"classes\.pi\.uplink"):
        load_fleet(bad)
    bad.write_text('cpu_scale = 0.001\n[classes.pi]\nspeed = 1\n')
    with pytest.raises(FleetError, match="raise cpu_scale"):
        load_fleet(bad)
