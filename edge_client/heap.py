"""Giving the memory a task freed back to the system, on a device between its tasks.

glibc's allocator keeps what a process frees: training's activations and gradients, tens of MiB
on the ``cnn``, stay resident after the task as free space of its heap (and its threshold for
giving large blocks their own mapping rises as they are freed, so more of the next task's memory
lands there too). ``malloc_trim(0)`` hands every free page of the heap back; a device's client
calls it once a task is sent, so that between tasks it holds what it uses, and the next task's
peak starts from there. Elsewhere (musl, macOS, Windows) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache
from typing import Any

__all__ = ["give_back_freed_memory"]


@cache
def _malloc_trim() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):   # not glibc
        return None


def give_back_freed_memory() -> bool:
    """Return the heap's free pages to the system (glibc's ``malloc_trim(0)``); False where unsupported."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
