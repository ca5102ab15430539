"""Atomic file writes, for everything fedge keeps on disk (device state, checkpoints, metrics),
and the one JSON-lines reader.

A device can lose power and a coordinator can be killed at any moment: a file is
written under a temporary name, synced, and renamed over the old one, so a reader
(or a restarted process) finds the old file or the new one, never half of one.
JSON-lines files that grow by appending (profile histories, ``clients/ID.jsonl``)
cannot be renamed into place, so a crash can leave a torn last line there; the
reader skips it.

Nothing heavy is imported at module level: ``fedge-profile infer`` reads and
appends profile histories on devices that serve an ONNX model without torch.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["write_atomic", "write_tensors_atomic", "write_jsonl_atomic", "append_jsonl_synced", "read_jsonl"]


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (creating its directory)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:   # a full disk or an interruption: the old file stays, no partial one beside it
        tmp.unlink(missing_ok=True)
        raise


def write_tensors_atomic(path: Path, tensors: Mapping[str, torch.Tensor],
                         metadata: Mapping[str, str] | None = None) -> str:
    """Tensors as one safetensors file, atomically; returns the file's SHA-256."""
    from safetensors.torch import save as save_safetensors   # here, not above: see the module docstring

    data = save_safetensors({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                            metadata=dict(metadata) if metadata else None)
    write_atomic(path, data)
    return hashlib.sha256(data).hexdigest()


def write_jsonl_atomic(path: Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """Rewrite a JSON-lines file (one object per line) atomically."""
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows).encode("utf-8"))


def append_jsonl_synced(path: Path, row: Mapping[str, Any]) -> None:
    """Append one object to a JSON-lines file and sync it to disk before returning: for journals whose line
    must exist before what it records happens. A torn last line (a crash mid-append) is ended first, so it
    cannot swallow this one."""
    with open(path, "ab+") as fh:
        if fh.tell():
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                fh.write(b"\n")
        fh.write((json.dumps(row) + "\n").encode("utf-8"))
        fh.flush()
        os.fsync(fh.fileno())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file, in order.

    Blank lines are skipped, and so is any line that is not a JSON object: appending
    (profile histories, ``clients/ID.jsonl``) can leave a torn last line when a process
    dies mid-write, and a report or a resumed run must go on with the complete lines
    rather than fail on it. Undecodable bytes are replaced for the same reason.
    """
    rows = []
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)   # a blank line does not decode either
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows
