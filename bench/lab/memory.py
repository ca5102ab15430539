"""Two views of a device's memory, kept apart because they measure different things.

- The cgroup's peak (``memory.max_usage_in_bytes`` or ``memory.peak``): every page charged to the
  device's cgroup, its page cache included. A page is charged to the cgroup that first brought it in,
  so shared pages already in memory (torch's libraries, read first by the coordinator or another
  device) are not charged to this device at all. That is what the cap (the board's RAM) acts on.
- The client process's peak resident set (RSS): every page mapped into the process, shared libraries
  included, whoever was charged for them. It is what ``fedge-profile``, the device footprint
  benchmark and a real board's ``top`` report: on a board, the whole of it must fit in its RAM.

The process peak comes from the device's own task profiles (``peak_rss_bytes``: the kernel's VmHWM
during each task) and, while the lab runs, from ``/proc/PID/status`` (VmHWM and VmRSS), which also
covers start-up; the larger counts.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["parse_status", "read_status", "status_peak", "profile_peaks", "device_profile_peaks", "device_memory",
           "memory_by_class"]

MIB = 2**20


def parse_status(text: str) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of a ``/proc/PID/status`` text, in bytes (absent ones left out)."""
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields = rest.split()
            if fields and fields[0].isdigit():
                out[key] = int(fields[0]) * 1024
    return out


def read_status(pid: int) -> dict[str, int]:
    """:func:`parse_status` of a live process; empty when it is gone."""
    try:
        return parse_status(Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return {}


def status_peak(status: dict[str, int]) -> int | None:
    """The largest resident size a ``/proc`` sample shows (VmHWM: the peak since the last reset)."""
    return max(status.get("VmHWM", 0), status.get("VmRSS", 0)) or None


def profile_peaks(rows: Iterable[dict[str, Any]]) -> dict[str, int | None]:
    """The largest ``peak_rss_bytes`` and ``peak_uss_bytes`` over a device's task profiles, and how many
    profile lines had one: rows of the run's ``clients/ID.jsonl`` (the profile under ``profile``) or of
    the device's own ``profile.jsonl`` (flat); a task usually appears in both."""
    rss, uss, lines = [], [], 0
    for row in rows:
        profile = row.get("profile") if isinstance(row.get("profile"), dict) else row
        if not isinstance(profile.get("peak_rss_bytes"), int):
            continue
        lines += 1
        rss.append(profile["peak_rss_bytes"])
        if isinstance(profile.get("peak_uss_bytes"), int):
            uss.append(profile["peak_uss_bytes"])
    return {"peak_rss_bytes": max(rss, default=None), "peak_uss_bytes": max(uss, default=None), "lines": lines}


def device_profile_peaks(run_dir: Path, state_dir: Path, device: str) -> dict[str, int | None]:
    """:func:`profile_peaks` over what a policy's directories hold of one device: the coordinator's
    ``clients/ID.jsonl`` (answers it took, late ones included) and the device's own ``profile.jsonl``
    (every task it ran, also those whose answer never arrived)."""
    from lab.results import read_jsonl
    rows = read_jsonl(run_dir / "clients" / f"{device}.jsonl") + read_jsonl(state_dir / "profile.jsonl")
    return profile_peaks(r for r in rows if r.get("kind", "task") == "task")


def device_memory(cgroup_peak: int | None, profiles: dict[str, int | None], proc_peak: int | None) -> dict[str, Any]:
    """One device's memory fields: the cgroup's peak beside the client process's peak RSS (the larger of
    its task profiles and the lab's samples of ``/proc``, kept as ``process_proc_peak_bytes`` so a
    report can merge them again), and where that peak came from."""
    known = {k: v for k, v in (("task profiles", profiles.get("peak_rss_bytes")), ("/proc", proc_peak)) if v}
    source = max(known, key=known.get) if known else None
    return {"memory_peak_bytes": cgroup_peak, "process_peak_rss_bytes": known[source] if source else None,
            "process_peak_rss_from": source, "process_peak_uss_bytes": profiles.get("peak_uss_bytes"),
            "process_proc_peak_bytes": proc_peak, "profile_lines": profiles.get("lines", 0)}


def _range_mib(values: list[int]) -> list[float] | None:
    return [round(min(values) / MIB, 1), round(max(values) / MIB, 1)] if values else None


def memory_by_class(devices: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per class, side by side: the cgroups' peaks (page cache included, shared pages charged elsewhere)
    and the client processes' peak RSS (shared libraries included), each as [min, max] MiB."""
    out: dict[str, dict[str, Any]] = {}
    for row in devices.values():
        entry = out.setdefault(row.get("class", "?"), {"devices": 0, "_cgroup": [], "_rss": []})
        entry["devices"] += 1
        if isinstance(row.get("memory_peak_bytes"), int):
            entry["_cgroup"].append(row["memory_peak_bytes"])
        if isinstance(row.get("process_peak_rss_bytes"), int):
            entry["_rss"].append(row["process_peak_rss_bytes"])
    return {klass: {"devices": e["devices"], "cgroup_peak_mib": _range_mib(e["_cgroup"]),
                    "process_peak_rss_mib": _range_mib(e["_rss"]), "with_process_peak": len(e["_rss"])}
            for klass, e in out.items()}
