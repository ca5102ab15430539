"""Checkpoints: the server state of each completed round, one safetensors file each.

This module is the one place that knows how checkpoints are named
(``round_NNNN.safetensors``) and laid out: the tensors are the state's parameters and
its buffers (names prefixed ``@buffer/``), and the ``fedge`` metadata entry is a JSON object with the state's ``round``,
``spec`` (the model spec; ``model`` in checkpoints written before the spec was part
of the state) and ``extra``, beside the caller's info (run id, strategy). The
coordinator resumes from it and the export reads it, both through
:func:`load_checkpoint`.

Each file is written to a temporary name and renamed, so a coordinator killed at
any moment leaves either the previous checkpoint or the new one, never half of
one. Loading never unpickles anything.

A file can still be damaged after it was written (a failing SD card, a bad copy), and
a resumed run would then broadcast weights every device refuses. So each checkpoint
carries a digest (``fedge_digest``: SHA-256 over the ``fedge`` entry and every tensor's
name, dtype, shape and bytes), and the reader refuses a file whose digest does not match
or whose values are not all finite, naming the newest earlier checkpoint that verifies.
Checkpoints written before the digest load as before, finiteness still checked.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from storage.files import write_tensors_atomic
from storage.state import ServerState
from storage.errors import FedgeError

__all__ = ["CheckpointError", "DamagedCheckpoint", "save_checkpoint", "load_checkpoint", "latest_checkpoint",
           "checkpoint_path", "checkpoint_rounds", "prune_checkpoints", "params_digest"]

_NAME = re.compile(r"^round_(\d{4,})\.safetensors$")
DIGEST_KEY = "fedge_digest"   # metadata entry beside "fedge": "sha256:" and the hex digest
BUFFER = "@buffer/"            # tensor-name prefix of the state's buffers (no parameter name starts with "@")


class CheckpointError(FedgeError, RuntimeError):
    """A checkpoint is missing, unreadable or damaged; the message names the file and how to resume.

    ``path`` and ``cause`` (None when the file is missing, else what made it unreadable)
    let a reader with another remedy, such as the export, say its own; for a damaged file
    ``last_good`` is the newest earlier round whose checkpoint verifies (None: none does).
    """

    def __init__(self, path: Path, cause: str | None = None) -> None:
        super().__init__(f"checkpoint {path} does not exist" if cause is None else
                         f"checkpoint {path} is unreadable ({cause}); delete it to resume from the one before")
        self.path = path
        self.cause = cause
        self.last_good: int | None = None


class DamagedCheckpoint(CheckpointError):
    """A checkpoint that reads but does not verify (digest mismatch, NaN or infinite values)."""

    def __init__(self, path: Path, damage: str, last_good: int | None) -> None:
        self.where = (f"the last good checkpoint is round {last_good}" if last_good is not None
                      else "no earlier checkpoint verifies")
        super().__init__(path, f"damaged: {damage}; {self.where}")   # the cause, for the export's own remedy
        self.damage = damage
        self.last_good = last_good

    def __str__(self) -> str:
        remedy = ("delete the damaged file(s) to resume from it" if self.last_good is not None
                  else "start the run again with another --out")
        return f"{self.path}: damaged ({self.damage}); {self.where}: {remedy}"


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
    fedge = json.dumps({**info, "round": state.round, "spec": state.spec, "extra": state.extra})
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.params.items()}
    tensors.update({BUFFER + k: v.detach().cpu().contiguous() for k, v in state.buffers.items()})
    write_tensors_atomic(path, tensors, {"fedge": fedge, DIGEST_KEY: _digest(fedge, tensors)})
    if not keep_all:
        prune_checkpoints(directory, {state.round})
    return path


def prune_checkpoints(directory: Path, keep: set[int]) -> None:
    """Delete every checkpoint in ``directory`` but those of the rounds in ``keep`` and the newest one."""
    found = checkpoint_rounds(directory)
    keep = keep | ({max(found)} if found else set())
    for round, path in found.items():
        if round not in keep:
            path.unlink(missing_ok=True)


def latest_checkpoint(directory: Path) -> Path | None:
    """The checkpoint of the highest round in ``directory`` (by number, not by name), or None."""
    found = checkpoint_rounds(directory)
    return found[max(found)] if found else None


def params_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of tensors alone (each one's name, dtype, shape and bytes, by name): the fingerprint of a
    model that two runs share exactly when their weights are the same bits, whatever else their
    checkpoints say (run id, round info). A benchmark's run file keeps its final model's."""
    h = hashlib.sha256()
    _feed(h, tensors)
    return "sha256:" + h.hexdigest()


def _feed(h: Any, tensors: Mapping[str, torch.Tensor]) -> None:
    for name in sorted(tensors):
        value = tensors[name].detach().cpu().contiguous()
        h.update(json.dumps([name, str(value.dtype), list(value.shape)]).encode("utf-8"))
        h.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())


def _digest(fedge: str, tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of the ``fedge`` metadata and every tensor (name, dtype, shape, bytes), by name."""
    h = hashlib.sha256(fedge.encode("utf-8"))
    _feed(h, tensors)
    return "sha256:" + h.hexdigest()


def _damage(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> str | None:
    """What is wrong with a checkpoint's content, or None: NaN or infinite values first (the
    more precise finding), then a digest that does not match (absent in older checkpoints)."""
    for name in sorted(tensors):
        value = tensors[name]
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return f"NaN or infinite values in {name}"
    stored = metadata.get(DIGEST_KEY)
    if stored is not None and stored != _digest(metadata.get("fedge", ""), tensors):
        return "digest mismatch"
    return None


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    params = load_file(str(path))
    with safe_open(str(path), framework="pt") as fh:
        metadata = dict(fh.metadata() or {})
    return params, metadata


def _last_good(path: Path) -> int | None:
    """The newest round before ``path``'s whose checkpoint in the same directory reads and verifies."""
    match = _NAME.match(path.name)
    below = int(match.group(1)) if match else None
    found = checkpoint_rounds(path.parent)
    for round in sorted((r for r in found if below is None or r < below), reverse=True):
        try:
            if _damage(*_read(found[round])) is None:
                return round
        except (SafetensorError, OSError, ValueError):
            continue
    return None


def load_checkpoint(path: Path) -> tuple[ServerState, dict[str, Any]]:
    """Read a checkpoint back into a ServerState (round, parameters as float32, model spec, extra) and the
    info it was saved with; CheckpointError when the file is missing or is not a fedge checkpoint,
    DamagedCheckpoint when its values are not finite or its digest does not match."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(path)
    try:
        params, metadata = _read(path)
        damage = _damage(params, metadata)
        if damage is not None:
            raise DamagedCheckpoint(path, damage, _last_good(path))
        info = json.loads(metadata["fedge"])
        if not isinstance(info, dict):
            raise ValueError("its fedge metadata is not a JSON object")
        spec = info.pop("spec", None) or info.pop("model", None)   # "model": written before the spec was state
        if not isinstance(spec, dict):
            raise ValueError("its fedge metadata has no model spec (a JSON object under \"spec\")")
        state = ServerState(round=int(info.pop("round")),
                            params={k: v.to(torch.float32) for k, v in params.items() if not k.startswith(BUFFER)},
                            spec=spec, extra=dict(info.pop("extra", {})),
                            buffers={k.removeprefix(BUFFER): v for k, v in params.items() if k.startswith(BUFFER)})
    except (SafetensorError, OSError, KeyError, ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(path, f"{type(exc).__name__}: {exc}") from None
    return state, info
