"""Checkpoints: the server state of each completed round, one safetensors file each.

Each file is written to a temporary name and renamed, so a coordinator killed at
any moment leaves either the previous checkpoint or the new one, never half of
one. Loading never unpickles anything.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from coordinator.strategies.base import ServerState
from edge_client.wire.files import write_tensors_atomic

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "latest_checkpoint", "checkpoint_path"]

_NAME = re.compile(r"^round_(\d{4,})\.safetensors$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing or unreadable; the message names the file."""


def checkpoint_path(directory: Path, round: int) -> Path:
    return directory / f"round_{round:04d}.safetensors"


def save_checkpoint(directory: Path, state: ServerState, info: dict[str, Any], *, keep_all: bool = True) -> Path:
    """Write the state atomically; ``info`` (run id, model spec, ...) goes in the metadata."""
    path = checkpoint_path(directory, state.round)
    meta = {"fedge": json.dumps({**info, "round": state.round, "extra": state.extra})}
    write_tensors_atomic(path, state.params, meta)
    if not keep_all:
        for old in directory.glob("round_*.safetensors"):
            if old != path:
                old.unlink(missing_ok=True)
    return path


def latest_checkpoint(directory: Path) -> Path | None:
    found = sorted((int(m.group(1)), p) for p in directory.glob("round_*.safetensors") if (m := _NAME.match(p.name)))
    return found[-1][1] if found else None


def load_checkpoint(path: Path) -> tuple[ServerState, dict[str, Any]]:
    """Read a checkpoint back into a ServerState and its info dict."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        params = load_file(str(path))
        with safe_open(str(path), framework="pt") as fh:
            info = json.loads((fh.metadata() or {})["fedge"])
        if not isinstance(info, dict):
            raise ValueError("metadata is not a JSON object")
        state = ServerState(round=int(info.pop("round")), params={k: v.to(torch.float32) for k, v in params.items()},
                            extra=dict(info.pop("extra", {})))
    except (SafetensorError, OSError, KeyError, ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(exc).__name__}: {exc}); "
                              "delete it to resume from the one before") from None
    return state, info
