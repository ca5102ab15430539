"""How much memory this process may use: the host's, or its memory cgroup's limit when that is lower.

A device in a container (or a fleet emulated with cgroups) sees the host's RAM through
``psutil.virtual_memory()``, but the kernel kills it at its cgroup's limit. So the
memory a task may count on is the smaller of the host's available memory and the
cgroup's limit minus what the cgroup already uses. Page cache the kernel can drop
(``inactive_file``) does not count as used. The process's own cgroup is read from
``/proc/self/cgroup``, for cgroup v1 (``memory.limit_in_bytes``) and v2 (``memory.max``);
every ancestor's limit applies too, so the tightest one wins.

Battery readings live here as well (``psutil.sensors_battery()``): most machines have
none, and then they are absent, never 0 %.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

__all__ = ["CgroupMemory", "cgroup_memory", "memory_total_bytes", "memory_available_bytes", "battery"]

_UNLIMITED = 1 << 60    # v1 writes "no limit" as a page-aligned 2^63 - 1


@dataclass(frozen=True)
class CgroupMemory:
    """The tightest memory limit over this process's cgroup and its ancestors, and what that cgroup uses."""

    limit: int
    used: int          # usage minus reclaimable page cache
    path: Path

    @property
    def available(self) -> int:
        return max(0, self.limit - self.used)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None   # v2 writes "max" for no limit


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text(encoding="ascii").splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except (OSError, UnicodeDecodeError):
        pass
    return 0


def _own_cgroups(proc_cgroup: Path, root: Path) -> list[tuple[Path, Path, str]]:
    """(hierarchy mount, this process's cgroup directory, version) of each memory hierarchy under ``root``."""
    try:
        lines = proc_cgroup.read_text(encoding="ascii").splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        relative = path.strip().lstrip("/")
        if "memory" in controllers.split(","):
            found.append((root / "memory", root / "memory" / relative, "v1"))
        elif controllers == "":   # v2: mounted at root, or at root/unified beside v1 hierarchies
            found += [(mount, mount / relative, "v2") for mount in (root, root / "unified")
                      if (mount / "cgroup.controllers").exists()]
    return found


def _limit_at(directory: Path, version: str) -> CgroupMemory | None:
    if version == "v1":
        limit, usage = _read_int(directory / "memory.limit_in_bytes"), _read_int(directory / "memory.usage_in_bytes")
        cache = _stat(directory / "memory.stat", "total_inactive_file")
    else:
        limit, usage = _read_int(directory / "memory.max"), _read_int(directory / "memory.current")
        cache = _stat(directory / "memory.stat", "inactive_file")
    if limit is None or limit >= _UNLIMITED or usage is None:
        return None
    return CgroupMemory(limit=limit, used=max(0, usage - cache), path=directory)


def cgroup_memory(proc_cgroup: Path = Path("/proc/self/cgroup"),
                  root: Path = Path("/sys/fs/cgroup")) -> CgroupMemory | None:
    """The tightest memory cgroup limit this process is under (its own cgroup's or an ancestor's); None
    when there is none (no cgroup, no limit, or not readable)."""
    best: CgroupMemory | None = None
    for mount, directory, version in _own_cgroups(proc_cgroup, root):
        if mount not in directory.parents and directory != mount:
            continue   # a path that climbs out of the hierarchy: not ours to read
        while True:
            found = _limit_at(directory, version)
            if found is not None and (best is None or found.available < best.available):
                best = found
            if directory == mount:
                break
            directory = directory.parent
    return best


def memory_total_bytes() -> int:
    """The memory this process may ever use: the host's, or its cgroup's limit when lower."""
    total = int(psutil.virtual_memory().total)
    cgroup = cgroup_memory()
    return min(total, cgroup.limit) if cgroup is not None else total


def memory_available_bytes() -> int:
    """The memory this process may still take: the host's available memory, or what its cgroup's limit
    leaves when that is less."""
    available = int(psutil.virtual_memory().available)
    cgroup = cgroup_memory()
    return min(available, cgroup.available) if cgroup is not None else available


def battery() -> dict[str, Any]:
    """``battery_percent`` and ``power_plugged`` where the device has a battery; empty (absent) otherwise."""
    try:
        reading = psutil.sensors_battery()
    except (AttributeError, OSError, NotImplementedError):
        return {}
    if reading is None:
        return {}
    return {"battery_percent": float(reading.percent),
            "power_plugged": reading.power_plugged if isinstance(reading.power_plugged, bool) else None}
