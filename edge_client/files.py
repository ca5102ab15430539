"""Atomic file writes, for everything fedge keeps on disk (device state, checkpoints, metrics).

A device can lose power and a coordinator can be killed at any moment: a file is
written under a temporary name, synced, and renamed over the old one, so a reader
(or a restarted process) finds the old file or the new one, never half of one.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["write_atomic"]


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (creating its directory)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
