"""One policy on a built lab: the coordinator, one client per device, the availability and throttling
timeline, a watch loop (progress, limits in force, exits, the wall-clock budget), and the results.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lab import processes
from lab.fleet import torch_threads
from lab.lab import Lab
from lab.memory import device_memory, device_profile_peaks, memory_by_class, read_status, status_peak
from lab.policies import POLICIES, coordinator_config, toml_text
from lab.results import accounting, accuracy_curve, contributors, outcome_counts, read_jsonl, training_start
from lab.schedule import Scheduler, timeline

__all__ = ["run_policy"]


def _start_coordinator(lab: Lab, policy: str, base: Path, resume: bool = False) -> tuple[subprocess.Popen, Path]:
    """The coordinator of the policy's run; with ``resume``, the same run again from its last checkpoint."""
    o = lab.options
    expected, per_round, min_results = o.resolved(lab.fleet)
    run_dir = base / "run"
    config = coordinator_config(policy, broker=f"mqtt://127.0.0.1:{lab.port}", out=str(run_dir),
                                rounds=o.rounds, seed=o.seed, model=o.model, data=o.data, partition=o.partition,
                                expected=expected, per_round=per_round, min_results=min_results,
                                round_timeout=o.round_timeout)
    path = base / "coordinator.toml"
    if not resume:
        path.write_text(toml_text(config), encoding="utf-8")
    cmd = [sys.executable, "-m", "coordinator.ui.cli", "run", "--config", str(path), "-v", *(["--resume"] * resume)]
    proc = processes.start(cmd, base / "coordinator.log", lab.id)
    lab.children.append(proc)
    return proc, run_dir


def _start_clients(lab: Lab, policy: str, base: Path) -> dict[str, subprocess.Popen]:
    o, fleet, procs = lab.options, lab.fleet, {}
    for d in fleet.devices:
        cmd = processes.client_command(
            cgroup_dirs=lab.cgroups.join_dirs(d.id), ns=lab.net.links[d.id].ns, broker=lab.broker_url,
            client_id=d.id, data=o.data, partition=o.partition, index=d.index, count=len(fleet.devices),
            seed=o.seed, state_dir=base / "state" / d.id, prefix=f"lab-{policy}", threads=torch_threads(d))
        procs[d.id] = processes.start(cmd, base / "logs" / f"{d.id}.log", lab.id)
        lab.children.append(procs[d.id])
    return procs


def _enforced(lab: Lab, device: str, proc: subprocess.Popen) -> dict[str, Any]:
    """The limits the kernel holds for the device and whether its client process is inside them."""
    return {**lab.cgroups.limits(device), "process_in_cgroup": proc.pid in lab.cgroups.pids(device),
            "pid": proc.pid}


def _restart(lab: Lab, policy: str, coordinators: list[subprocess.Popen], base: Path, at: float) -> dict[str, Any]:
    """SIGTERM the coordinator mid-run and start it again with ``--resume``: what a laptop's reboot does to a
    run. The devices keep running; the old coordinator's exit code is kept (130: it stopped cleanly)."""
    lab.say(f"{policy}: restarting the coordinator (SIGTERM, then --resume) at {at:.0f}s")
    old = coordinators[-1]
    processes.stop([old], first=signal.SIGTERM, grace=60.0)
    coordinators.append(_start_coordinator(lab, policy, base, resume=True)[0])
    return {"t": round(at, 2), "exit": old.returncode}


def _watch(lab: Lab, policy: str, coordinators: list[subprocess.Popen], clients: dict[str, subprocess.Popen],
           run_dir: Path) -> dict[str, Any]:
    """Follow the run until the coordinator exits or the budget is spent. The budget counts from when
    training began: how long emulated devices take to import torch is the same for every policy."""
    started, seen, enforced, exits, status = time.monotonic(), {}, {}, {}, "completed"
    proc_peaks: dict[str, int] = {}   # per device, the largest resident size /proc showed for its client
    budget, restart_after, restarts = lab.options.budget, lab.options.restart_after, []
    while coordinators[-1].poll() is None:
        now = time.monotonic() - started
        rows = read_jsonl(run_dir / "metrics.jsonl")
        for row in rows:
            if row.get("round") not in seen and isinstance(row.get("round"), int):
                seen[row["round"]] = round(now, 2)
                acc = row.get("test_accuracy")
                lab.say(f"{policy}: round {row['round']} at {now:.0f}s"
                        + (f", accuracy {acc:.4f}" if isinstance(acc, float) else "")
                        + (f", {row.get('returned')}/{row.get('selected')} results" if row["round"] else ""))
        for device, proc in clients.items():
            if device not in enforced and proc.poll() is None and now > 1.0:
                enforced[device] = _enforced(lab, device, proc)
            if proc.poll() is None:   # the pid is the client's once `sh` and `ip netns exec` have exec'd it
                peak = status_peak(read_status(proc.pid))
                if peak:
                    proc_peaks[device] = max(peak, proc_peaks.get(device, 0))
            if device not in exits and proc.poll() is not None:
                exits[device] = {"code": proc.returncode, "t": round(now, 2)}
                if proc.returncode != 0:
                    lab.say(f"{policy}: {device} exited with {proc.returncode} at {now:.0f}s")
        began = training_start(rows, seen)
        if restart_after is not None and began is not None and now - began > restart_after and not restarts:
            restarts.append(_restart(lab, policy, coordinators, run_dir.parent, now))
        if budget is not None and began is not None and now - began > budget and status != "budget":
            lab.say(f"{policy}: wall-clock budget of {budget:.0f}s spent; stopping the coordinator")
            status = "budget"
            coordinators[-1].send_signal(signal.SIGINT)
        time.sleep(0.5)
    return {"seen": seen, "enforced": enforced, "exits": exits, "status": status, "restarts": restarts,
            "proc_peaks": proc_peaks, "wall_clock_s": round(time.monotonic() - started, 2)}


def _device_rows(lab: Lab, before: dict[str, dict[str, int]], watched: dict[str, Any],
                 clients: dict[str, subprocess.Popen], base: Path) -> dict[str, Any]:
    """Per device: its limits, exit, OOM kills, and its memory twice: the cgroup's peak and the client
    process's peak RSS (lab/memory.py says why they differ)."""
    rows = {}
    for d in lab.fleet.devices:
        after = lab.cgroups.memory_events(d.id)
        code = clients[d.id].returncode
        oom = after.get("oom_kill", 0) - before[d.id].get("oom_kill", 0)
        profiles = device_profile_peaks(base / "run", base / "state" / d.id, d.id)
        rows[d.id] = {"class": d.klass, "cpu_share": d.cpu_share, "memory_bytes": d.memory_bytes,
                      "exit_code": code, "exited_at_s": (watched["exits"].get(d.id) or {}).get("t"),
                      "oom_kills": oom, "memory_limit_hits": after.get("failcnt", 0) - before[d.id].get("failcnt", 0),
                      **device_memory(after.get("peak_bytes"), profiles, watched["proc_peaks"].get(d.id)),
                      "oom_killed": oom > 0, "enforced": watched["enforced"].get(d.id)}
    return rows


def run_policy(lab: Lab, policy: str) -> dict[str, Any]:
    """Run one policy from a clean state (all links up, full quotas) and return its results."""
    base = lab.work / policy
    base.mkdir(parents=True, exist_ok=True)
    lab.reset()
    for d in lab.fleet.devices:
        lab.cgroups.reset_peak(d.id)
    before = {d.id: lab.cgroups.memory_events(d.id) for d in lab.fleet.devices}
    o = lab.options
    horizon = o.budget if o.budget is not None else o.rounds * o.round_timeout + 600
    scheduler = Scheduler(timeline(lab.fleet.devices, o.seed, horizon), lab.apply, lab.say)
    lab.say(f"{policy}: starting the coordinator and {len(lab.fleet.devices)} clients "
            f"({len(scheduler.events)} scheduled changes)")
    coordinators = [_start_coordinator(lab, policy, base)[0]]
    run_dir = base / "run"
    clients = _start_clients(lab, policy, base)
    scheduler.start()
    try:
        watched = _watch(lab, policy, coordinators, clients, run_dir)
    except BaseException:   # Ctrl-C, SIGTERM, a failure: stop everything at once, the lab cleans up
        lab.say(f"{policy}: stopping the coordinator and the clients")
        scheduler.stop()
        processes.stop([coordinators[-1], *clients.values()], grace=5.0)
        raise
    scheduler.stop()
    coordinator = coordinators[-1]
    processes.stop([coordinator], first=signal.SIGINT, grace=30.0)
    time.sleep(0.5)   # the clients leave by themselves once the run's end reaches them
    processes.stop(list(clients.values()), grace=20.0)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    curve = accuracy_curve(rows, watched["seen"])
    error = "" if coordinator.returncode in (0, 130) else \
        (base / "coordinator.log").read_text(errors="replace").strip().splitlines()[-1:]
    classes = {d.id: d.klass for d in lab.fleet.devices}
    devices = _device_rows(lab, before, watched, clients, base)
    return {"policy": policy, "overrides": POLICIES[policy], "run_dir": str(run_dir),
            "status": watched["status"] if not error else "error", "error": error or None,
            "coordinator_exit": coordinator.returncode, "wall_clock_s": watched["wall_clock_s"],
            "rounds_completed": max([r["round"] for r in rows if isinstance(r.get("round"), int)], default=0),
            "final_accuracy": curve[-1]["test_accuracy"] if curve else None, "accuracy_vs_time": curve,
            "results": outcome_counts(rows), "restarts": watched["restarts"],
            "accounting": accounting(run_dir, rows), "contributors": contributors(run_dir, classes),
            "events": scheduler.log, "memory": memory_by_class(devices), "devices": devices}
