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
import edge_lab  # noqa: E402
from lab.calibration import (NCNN_PI3BPLUS_MS, NCNN_PI4_MS, SPEEDS, calibrated_cpu_scale, derived_speeds,  # noqa: E402
                             median_ratio, projected_seconds, share_for, time_dilation)
from lab.fleet import FleetError, load_fleet  # noqa: E402
from lab.memory import device_memory, memory_by_class, parse_status, profile_peaks  # noqa: E402
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
    # both views of its memory: the cgroup's peak and the client process's peak RSS (torch alone is > 100 MiB)
    assert device["process_peak_rss_bytes"] > 100 * MIB and device["profile_lines"] >= 1, device
    assert result["memory"]["capped"]["with_process_peak"] == 1
    assert sum(c["contributed"] for c in result["contributors"].values()) == 3
    assert _leftovers(lab) == []


# --- The fleet file and the schedule, without root ----------------------------------------------------------------


def test_mixed_fleet_is_a_realistic_spread() -> None:
    fleet = load_fleet(REPO / "bench" / "fleets" / "mixed.toml")
    speeds = [d.speed for d in fleet.devices]
    assert len(fleet.devices) >= 30 and 5 <= max(speeds) / min(speeds) <= 8
    assert {d.klass: d.speed for d in fleet.devices} == SPEEDS   # the file carries the calibrated speeds
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


# --- The calibration's arithmetic and the memory fields, without root or processes ----------------------------


def test_relative_speeds_follow_their_sources() -> None:
    assert median_ratio(NCNN_PI3BPLUS_MS, NCNN_PI4_MS) == pytest.approx(1.818, abs=1e-3)
    with pytest.raises(ValueError, match="no model in common"):
        median_ratio({"a": 1.0}, {"b": 1.0})
    derived = derived_speeds()
    for klass, source in (("pi4-2gb", "pi4-1.5GHz"), ("pi4-4gb", "pi4-1.8GHz")):   # taken within its sources
        lo, hi = min(derived[source].values()), max(derived[source].values())
        assert lo - 0.1 <= SPEEDS[klass] <= hi, (klass, derived[source])
    assert 3.0 <= SPEEDS["pi4-4gb"] / SPEEDS["pi-zero-2w"] <= 3.5
    assert SPEEDS["pi5-4gb"] == pytest.approx(derived["pi5"]["flower"])   # FP32 training, not ncnn's 13x
    assert derived["pi5"]["ncnn"] > 2 * derived["pi5"]["flower"]
    assert SPEEDS["orin-nano"] == pytest.approx(derived["orin-nano"]["llama.cpp"], abs=0.05)


def test_calibration_arithmetic() -> None:
    # one core here does in 2 s what the board does in 5 s: the board is 0.4 of a core
    assert share_for(2.0, 5.0) == pytest.approx(0.4)
    assert calibrated_cpu_scale(2.0, 5.0, board_speed=8.0) == pytest.approx(0.05)
    assert time_dilation(0.05, 0.04) == pytest.approx(1.25)   # the lab is 1.25x slower than the boards
    assert projected_seconds(1.0, speed=2.0, cpu_scale=0.05) == pytest.approx(10.0)
    with pytest.raises(ValueError):
        share_for(0.0, 1.0)


def test_calibration_file_gives_the_time_dilation(tmp_path: Path) -> None:
    path = tmp_path / "calibration.json"
    assert edge_lab._calibration(0.04, path) is None
    path.write_text(json.dumps({"calibrated_cpu_scale": 0.06}))
    assert edge_lab._calibration(0.04, path)["time_dilation"] == 1.5
    path.write_text("{not json")
    assert edge_lab._calibration(0.04, path) is None


def test_memory_keeps_the_cgroup_and_the_process_apart() -> None:
    status = "Name:\tpython\nVmHWM:\t  352000 kB\nVmRSS:\t  300000 kB\nThreads:\t3\n"
    assert parse_status(status) == {"VmHWM": 352000 * 1024, "VmRSS": 300000 * 1024}
    rows = [{"round": 1, "profile": {"peak_rss_bytes": 300 * MIB, "peak_uss_bytes": 200 * MIB}},
            {"round": 2, "missed": True, "profile": {}},                         # no answer, no profile
            {"kind": "task", "peak_rss_bytes": 340 * MIB, "peak_uss_bytes": 190 * MIB}]   # the device's own line
    peaks = profile_peaks(rows)
    assert peaks == {"peak_rss_bytes": 340 * MIB, "peak_uss_bytes": 200 * MIB, "lines": 2}
    row = device_memory(210 * MIB, peaks, proc_peak=352 * MIB)
    assert row["memory_peak_bytes"] == 210 * MIB and row["process_peak_rss_bytes"] == 352 * MIB
    assert row["process_peak_rss_from"] == "/proc" and row["process_proc_peak_bytes"] == 352 * MIB
    assert device_memory(210 * MIB, peaks, None)["process_peak_rss_from"] == "task profiles"
    assert device_memory(None, {}, None)["process_peak_rss_bytes"] is None
    devices = {"z-01": {"class": "zero", **row}, "z-02": {"class": "zero", **device_memory(200 * MIB, {}, None)}}
    assert memory_by_class(devices) == {"zero": {"devices": 2, "cgroup_peak_mib": [200.0, 210.0],
                                                 "process_peak_rss_mib": [352.0, 352.0], "with_process_peak": 1}}


def test_report_adds_the_process_peaks_from_the_run_directories(tmp_path: Path) -> None:
    base = tmp_path / "sync-random"
    (base / "run" / "clients").mkdir(parents=True)
    (base / "state" / "z-01").mkdir(parents=True)
    (base / "run" / "metrics.jsonl").write_text(
        json.dumps({"round": 0, "test_accuracy": 0.1}) + "\n"
        + json.dumps({"round": 1, "seconds": 5.0, "test_accuracy": 0.5, "returned": 1, "selected": 1}) + "\n")
    (base / "run" / "clients" / "z-01.jsonl").write_text(json.dumps(
        {"round": 1, "objective": "train", "late": False, "missed": False, "error": None,
         "profile": {"peak_rss_bytes": 330 * MIB}}) + "\n")
    (base / "state" / "z-01" / "profile.jsonl").write_text(
        json.dumps({"kind": "task", "peak_rss_bytes": 345 * MIB}) + "\n")
    out = tmp_path / "edge_lab.json"
    out.write_text(json.dumps({"target": {}, "policies": {"sync-random": {
        "run_dir": str(base / "run"), "final_accuracy": 0.5,
        "accuracy_vs_time": [{"round": 0, "t": 10.0}, {"round": 1, "t": 15.0}],
        "devices": {"z-01": {"class": "zero", "memory_peak_bytes": 205 * MIB},
                    "gone-01": {"class": "zero", "memory_peak_bytes": 220 * MIB}}}}}))
    assert edge_lab._report(out) == 0
    result = json.loads(out.read_text())["policies"]["sync-random"]
    assert result["devices"]["z-01"]["process_peak_rss_bytes"] == 345 * MIB
    assert result["devices"]["z-01"]["memory_peak_bytes"] == 205 * MIB   # the cgroup's figure is kept apart
    assert result["devices"]["gone-01"]["process_peak_rss_bytes"] is None
    assert result["memory"]["zero"] == {"devices": 2, "cgroup_peak_mib": [205.0, 220.0],
                                        "process_peak_rss_mib": [345.0, 345.0], "with_process_peak": 1}
    assert result["accuracy_vs_time"][-1]["t_train"] == 5.0   # the curve is recomputed as before


def test_seeds_report_cuts_at_the_budget_and_pairs_each_seed_with_its_random_run(tmp_path: Path) -> None:
    import edge_lab_seeds

    def curve(*points):
        return [{"round": i, "t_train": t, "test_accuracy": a} for i, (t, a) in enumerate(points)]

    def seed(s, random, fast):
        return {"options": {"seed": s, "budget": 100.0}, "target": {"accuracy": 0.0},
                "policies": {"sync-random": {"accuracy_vs_time": random, "run_dir": "gone"},
                             "fast": {"accuracy_vs_time": fast, "run_dir": "gone"}}}

    runs = {0: seed(0, curve((0, 0.1), (50, 0.5), (100, 0.6), (130, 0.9)), curve((0, 0.1), (25, 0.6), (90, 0.7))),
            1: seed(1, curve((0, 0.1), (80, 0.5)), curve((0, 0.1), (40, 0.55), (100, 0.62), (101, 0.99)))}
    summary = edge_lab_seeds.summarize(runs, root=tmp_path)
    fast = summary["policies"]["fast"]
    # seed 0: random's target is 0.6 at 100 s (the 0.9 came after the budget), fast reached it at 25 s
    assert fast["per_seed"]["0"]["target"] == 0.6 and fast["per_seed"]["0"]["time_to_target_ratio"] == 0.25
    # seed 1: target 0.5 at 80 s, fast at 40 s; its 0.99 at 101 s is past the budget
    assert fast["per_seed"]["1"]["final_accuracy"] == 0.62 and fast["per_seed"]["1"]["time_to_target_ratio"] == 0.5
    assert fast["time_to_target_ratio"]["per_seed"] == [0.25, 0.5] and fast["reached_target"] == "2 of 2"
    assert fast["final_accuracy_points"]["per_seed"] == pytest.approx([10.0, 12.0])
    assert fast["per_seed"]["0"]["participation"] is None   # no run directory left
