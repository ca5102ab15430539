"""Each device's CPU quota and memory cap, as cgroups: v1 (``cpu.cfs_quota_us`` over
``cpu.cfs_period_us``, ``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes`` when the kernel
accounts swap) or, on a unified hierarchy, v2 (``cpu.max``, ``memory.max``, ``memory.swap.max``).

A lab's cgroups are ``LAB/DEVICE`` under each controller, so a lab is removed (or found after a
crash) by its one directory name.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from lab.system import System

__all__ = ["PERIOD_US", "Cgroups", "cgroup_problem", "lab_cgroup_dirs", "remove_tree"]

ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


def _unified(root: Path) -> bool:
    return (root / "cgroup.controllers").exists()


def cgroup_problem(root: Path = ROOT) -> str:
    """Why the lab cannot make cgroups here ("" when it can)."""
    if _unified(root):
        have = (root / "cgroup.controllers").read_text().split()
        missing = [c for c in ("cpu", "memory") if c not in have]
        return f"the cgroup v2 hierarchy at {root} lacks the {', '.join(missing)} controller" if missing else ""
    for controller, probe in (("cpu", "cpu.cfs_quota_us"), ("memory", "memory.limit_in_bytes")):
        if not (root / controller / probe).exists():
            return (f"no cgroup v1 {controller} controller at {root / controller} (mount it: "
                    f"mount -t cgroup -o {controller} cgroup {root / controller})")
    return ""


def lab_cgroup_dirs(prefix_match, root: Path = ROOT) -> list[Path]:
    """Every lab directory (name accepted by ``prefix_match``) under every controller."""
    parents = [root] if _unified(root) else [root / "cpu", root / "memory"]
    return [p for parent in parents if parent.is_dir() for p in parent.iterdir()
            if p.is_dir() and prefix_match(p.name)]


class Cgroups:
    """The cgroups of one lab (``name``) and its devices."""

    def __init__(self, system: System, name: str, root: Path = ROOT) -> None:
        self.system, self.name, self.root = system, name, root
        self.v2 = _unified(root)
        self.created: list[str] = []

    def _dirs(self, device: str | None = None) -> dict[str, Path]:
        tail = [self.name] + ([device] if device else [])
        if self.v2:
            return {"cpu": self.root.joinpath(*tail), "memory": self.root.joinpath(*tail)}
        return {c: self.root.joinpath(c, *tail) for c in ("cpu", "memory")}

    def join_dirs(self, device: str) -> list[Path]:
        """The directories whose ``cgroup.procs`` a device's process must be written into."""
        return sorted(set(self._dirs(device).values()))

    def create_lab(self) -> None:
        for path in sorted(set(self._dirs().values())):
            self.system.mkdir(path)
        if self.v2:
            self.system.write(self.root / "cgroup.subtree_control", "+cpu +memory")
            self.system.write(self._dirs()["cpu"] / "cgroup.subtree_control", "+cpu +memory")

    def create(self, device: str, cpu_share: float, memory_bytes: int) -> None:
        dirs = self._dirs(device)
        for path in sorted(set(dirs.values())):
            self.system.mkdir(path)
        self.created.append(device)
        self.set_cpu(device, cpu_share)
        mem = dirs["memory"]
        if self.v2:
            self.system.write(mem / "memory.max", memory_bytes)
            if (mem / "memory.swap.max").exists() or self.system.dry_run:
                self.system.write(mem / "memory.swap.max", 0)
            return
        self.system.write(mem / "memory.limit_in_bytes", memory_bytes)
        if (mem / "memory.memsw.limit_in_bytes").exists() or self.system.dry_run:
            self.system.write(mem / "memory.memsw.limit_in_bytes", memory_bytes)   # no swap either

    def set_cpu(self, device: str, share: float) -> None:
        """The device may use ``share`` of one core (more than 1: several cores)."""
        quota = max(1000, int(round(share * PERIOD_US)))
        cpu = self._dirs(device)["cpu"]
        if self.v2:
            self.system.write(cpu / "cpu.max", f"{quota} {PERIOD_US}")
        else:
            self.system.write(cpu / "cpu.cfs_period_us", PERIOD_US)
            self.system.write(cpu / "cpu.cfs_quota_us", quota)

    def limits(self, device: str) -> dict[str, int | None]:
        """The limits in force, read back from the kernel."""
        dirs = self._dirs(device)

        def read(path: Path) -> int | None:
            try:
                text = path.read_text().split()
            except OSError:
                return None
            return int(text[0]) if text and text[0].isdigit() else None
        if self.v2:
            quota, period = (dirs["cpu"] / "cpu.max").read_text().split()
            return {"cpu_quota_us": int(quota) if quota.isdigit() else None, "cpu_period_us": int(period),
                    "memory_limit_bytes": read(dirs["memory"] / "memory.max"),
                    "swap_limit_bytes": read(dirs["memory"] / "memory.swap.max")}
        return {"cpu_quota_us": read(dirs["cpu"] / "cpu.cfs_quota_us"),
                "cpu_period_us": read(dirs["cpu"] / "cpu.cfs_period_us"),
                "memory_limit_bytes": read(dirs["memory"] / "memory.limit_in_bytes"),
                "memsw_limit_bytes": read(dirs["memory"] / "memory.memsw.limit_in_bytes")}

    def pids(self, device: str | None = None) -> set[int]:
        found: set[int] = set()
        for path in set(self._dirs(device).values()):
            try:
                found |= {int(p) for p in (path / "cgroup.procs").read_text().split()}
            except OSError:
                pass
        return found

    def memory_events(self, device: str) -> dict[str, int]:
        """How often the device hit its cap (``failcnt``), how many of its processes the kernel's OOM
        killer ended (``oom_kill``) and its highest memory use so far (``peak_bytes``, page cache included)."""
        mem = self._dirs(device)["memory"]
        name = "memory.events" if self.v2 else "memory.oom_control"
        try:
            pairs = dict(line.split() for line in (mem / name).read_text().splitlines() if line.strip())
        except OSError:
            return {}
        out = {"oom_kill": int(pairs.get("oom_kill", 0))}
        counters = {"failcnt": "memory.failcnt", "peak_bytes": "memory.max_usage_in_bytes"}
        if self.v2:
            out["failcnt"] = int(pairs.get("max", 0))
            counters = {"peak_bytes": "memory.peak"}
        for key, name in counters.items():
            try:
                out[key] = int((mem / name).read_text())
            except (OSError, ValueError):
                pass
        return out

    def reset_peak(self, device: str) -> None:
        """Start the device's memory peak afresh (each policy reports its own); best effort on v2."""
        mem = self._dirs(device)["memory"]
        try:
            (mem / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")).write_text("0\n")
        except OSError:
            pass

    def remove(self) -> list[str]:
        """Kill what is left in the lab's cgroups and remove them; what could not be removed."""
        return remove_tree(self.system, sorted(set(self._dirs().values())))


def remove_tree(system: System, lab_dirs: list[Path], timeout: float = 10.0) -> list[str]:
    """SIGKILL every process in ``lab_dirs`` and their device subdirectories, then remove them."""
    problems = []
    for lab in lab_dirs:
        if system.dry_run:
            system.echo(f"  rmdir {lab}/* {lab}")
            continue
        if not lab.is_dir():
            continue
        for path in [d for d in lab.iterdir() if d.is_dir()] + [lab]:
            deadline = time.monotonic() + timeout
            while True:
                procs = [int(p) for p in (path / "cgroup.procs").read_text().split()]
                for pid in procs:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                try:
                    path.rmdir()
                    break
                except OSError as exc:
                    if time.monotonic() > deadline:
                        problems.append(f"cgroup {path}: {exc.strerror}")
                        break
                    time.sleep(0.1)
    return problems
