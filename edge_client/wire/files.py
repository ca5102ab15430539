"""Atomic file writes, for everything fedge keeps on disk (device state, checkpoints, metrics).

A device can lose power and a coordinator can be killed at any moment: a file is
written under a temporary name, synced, and renamed over the old one, so a reader
(or a restarted process) finds the old file or the new one, never half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as save_safetensors

__all__ = ["write_atomic", "write_tensors_atomic", "write_jsonl_atomic"]


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


def write_tensors_atomic(path: Path, tensors: Mapping[str, torch.Tensor],
                         metadata: Mapping[str, str] | None = None) -> str:
    """Tensors as one safetensors file, atomically; returns the file's SHA-256."""
    data = save_safetensors({k: v.detach().contiguous() for k, v in tensors.items()},
                            metadata=dict(metadata) if metadata else None)
    write_atomic(path, data)
    return hashlib.sha256(data).hexdigest()


def write_jsonl_atomic(path: Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """Rewrite a JSON-lines file (one object per line) atomically."""
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows).encode("utf-8"))
