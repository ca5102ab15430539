"""Where a device's memory goes: the process's memory at named points of its life, when asked for.

``FEDGE_MEMORY_TRACE=PATH`` in a client's environment makes every :func:`mark` append one JSON
line to ``PATH``: the mark's name, the wall-clock time, the resident set (``VmRSS``), the peak
since the previous mark (``VmHWM``, which the kernel keeps exactly, spikes between reads
included), ``/proc/self/smaps_rollup``'s anonymous and file-backed shares, glibc's heap
(``mallinfo2``: bytes in use, bytes freed but kept) and the number of loaded Python modules.
``bench/device_footprint.py`` reads the lines back as a breakdown by phase.

Without the variable a mark costs one module-level check. With it, each mark resets the kernel's
high-water mark so that the next mark sees the peak of its own phase; the peak a task's profile
reports stays whole (:func:`profiling.profiler.peak_rss_since_reset` adds what was read here
before each reset).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import sys
import time
from typing import Any

from profiling import profiler

__all__ = ["TRACE_ENV", "mark", "memory_now"]

TRACE_ENV = "FEDGE_MEMORY_TRACE"
_path = os.environ.get(TRACE_ENV) or None
_ROLLUP = {"Anonymous": "anon_bytes", "Private_Dirty": "private_dirty_bytes", "Shared_Clean": "shared_clean_bytes",
           "Private_Clean": "private_clean_bytes"}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):   # not glibc, or glibc before 2.33
        return None


_LIBC = _libc() if _path else None


def _rss() -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _rollup() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/self/smaps_rollup", encoding="ascii") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key in _ROLLUP:
                    out[_ROLLUP[key]] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def memory_now() -> dict[str, Any]:
    """This process's memory now: RSS, smaps_rollup's shares, glibc's heap."""
    record: dict[str, Any] = {"rss_bytes": _rss(), **_rollup(), "modules": len(sys.modules)}
    if _LIBC is not None:
        info = _LIBC.mallinfo2()
        record.update(heap_bytes=info.arena, heap_mmap_bytes=info.hblkhd, heap_in_use_bytes=info.uordblks,
                      heap_free_kept_bytes=info.fordblks)
    return record


def mark(name: str) -> None:
    """Record this process's memory at the end of phase ``name`` (nothing unless FEDGE_MEMORY_TRACE is set)."""
    if _path is None:
        return
    record = {"mark": name, "time": time.time(), **memory_now()}
    record["peak_rss_bytes"] = profiler.split_peak_rss()   # this phase's own peak, from here a new one
    with open(_path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")
