"""Checkpoints: the server state of each completed round, one safetensors file each.

This module is the one place that knows how checkpoints are named
(``round_NNNN.safetensors``) and laid out: the tensors are the state's parameters,
and the ``fedge`` metadata entry is a JSON object with the state's ``round``,
``spec`` (the model spec; ``model`` in checkpoints written before the spec was part
of the state) and ``extra``, beside the caller's info (run id, strategy). The
coordinator resumes from it and the export reads it, both through
:func:`load_checkpoint`.

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

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "latest_checkpoint", "checkpoint_path",
           "checkpoint_rounds"]

_NAME = re.compile(r"^round_(\d{4,})\.safetensors$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing or unreadable; the message names the file and how to resume.

    ``path`` and ``cause`` (None when the file is missing, else what made it unreadable)
    let a reader with another remedy, such as the export, say its own.
    """

    def __init__(self, path: Path, cause: str | None = None) -> None:
        super().__init__(f"checkpoint {path} does not exist" if cause is None else
                         f"checkpoint {path} is unreadable ({cause}); delete it to resume from the one before")
        self.path = path
        self.cause = cause


def checkpoint_path(directory: Path, round: int) -> Path:
    """Where the checkpoint of ``round`` goes in ``directory``."""
    return directory / f"round_{round:04d}.safetensors"


def checkpoint_rounds(directory: Path) -> dict[int, Path]:
    """Every checkpoint in ``directory`` by round; other files (temporary, backups) are not checkpoints."""
    return {int(m.group(1)): p for p in Path(directory).glob("round_*.safetensors") if (m := _NAME.match(p.name))}


def save_checkpoint(directory: Path, state: ServerState, info: dict[str, Any], *, keep_all: bool = True) -> Path:
    """Write the state atomically; ``info`` (run id, strategy) goes in the metadata beside the state's
    round, model spec and extra."""
    if not state.spec:
        raise ValueError("a checkpoint needs the state's model spec: the network cannot be rebuilt without it")
    path = checkpoint_path(directory, state.round)
    meta = {"fedge": json.dumps({**info, "round": state.round, "spec": state.spec, "extra": state.extra})}
    write_tensors_atomic(path, state.params, meta)
    if not keep_all:
        for old in checkpoint_rounds(directory).values():
            if old != path:
                old.unlink(missing_ok=True)
    return path


def latest_checkpoint(directory: Path) -> Path | None:
    """The checkpoint of the highest round in ``directory`` (by number, not by name), or None."""
    found = checkpoint_rounds(directory)
    return found[max(found)] if found else None


def load_checkpoint(path: Path) -> tuple[ServerState, dict[str, Any]]:
    """Read a checkpoint back into a ServerState (round, parameters as float32, model spec, extra) and the
    info it was saved with; CheckpointError when the file is missing or is not a fedge checkpoint."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(path)
    try:
        params = load_file(str(path))
        with safe_open(str(path), framework="pt") as fh:
            info = json.loads((fh.metadata() or {})["fedge"])
        if not isinstance(info, dict):
            raise ValueError("its fedge metadata is not a JSON object")
        spec = info.pop("spec", None) or info.pop("model", None)   # "model": written before the spec was state
        if not isinstance(spec, dict):
            raise ValueError("its fedge metadata has no model spec (a JSON object under \"spec\")")
        state = ServerState(round=int(info.pop("round")), params={k: v.to(torch.float32) for k, v in params.items()},
                            spec=spec, extra=dict(info.pop("extra", {})))
    except (SafetensorError, OSError, KeyError, ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(path, f"{type(exc).__name__}: {exc}") from None
    return state, info
