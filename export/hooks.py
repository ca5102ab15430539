"""What a method adds to an export: its export hook (the method's ``export.py``, named in the registry).

The export path (:mod:`export.pipeline`, :mod:`export.source`) knows no method. It asks every
registered hook, in registry order:

- ``prepare(model, spec)``: the model as it goes to ONNX (a copy, changed where the method's
  parts have no ONNX operator or cost one that is not needed: folding constants into the
  weights), and entries for the model card (a dict; a dict value is merged into the card's
  entry of that name). The parity check compares the ONNX model with the model before any hook.
- ``personalized(checkpoint, state_dir)``: one device's model assembled from the checkpoint and the
  parts that stayed on that device, or None when the checkpoint is not of this method's kind.
- ``no_global(spec)``: why a run of this spec has no global model to export, or None.
- ``describe(card)``: lines for ``fedge-export``'s summary of what the hook did.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from export.records import Checkpoint, Personalized

__all__ = ["ExportHook", "export_hooks", "prepare", "merged", "personalized", "no_global", "describe"]


@dataclass(frozen=True)
class ExportHook:
    """A method's part in an export; every field is optional (the module docstring says when each runs)."""

    prepare: Callable[[nn.Module, Mapping[str, Any]], tuple[nn.Module, dict[str, Any]]] | None = None
    personalized: Callable[[Checkpoint, Path], Personalized | None] | None = None
    no_global: Callable[[Mapping[str, Any]], str | None] | None = None
    describe: Callable[[Mapping[str, Any]], list[str]] | None = None


@functools.cache
def export_hooks() -> tuple[ExportHook, ...]:
    """Every registered method's export hook, in registry order."""
    from edge_client.registry import METHODS, resolve

    return tuple(resolve(entry.export) for entry in METHODS.values() if entry.export)


def prepare(model: nn.Module, spec: Mapping[str, Any]) -> tuple[nn.Module, dict[str, Any]]:
    """``model`` as every hook prepares it for ONNX, and the card entries they add."""
    entries: dict[str, Any] = {}
    for hook in export_hooks():
        if hook.prepare is not None:
            model, more = hook.prepare(model, spec)
            entries = merged(entries, more)
    return model, entries


def merged(card: Mapping[str, Any], entries: Mapping[str, Any]) -> dict[str, Any]:
    """``card`` with ``entries`` added: an entry that is a dict extends the card's dict of that name."""
    out = dict(card)
    for key, value in entries.items():
        out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def personalized(checkpoint: Checkpoint, state_dir: Path) -> Personalized | None:
    """The first hook's assembly of a device's model from ``checkpoint``; None when no method keeps parts
    on its devices for a run like it."""
    for hook in export_hooks():
        found = hook.personalized(checkpoint, state_dir) if hook.personalized is not None else None
        if found is not None:
            return found
    return None


def no_global(spec: Mapping[str, Any]) -> str | None:
    """Why a run of ``spec`` has no global model (a hook's reason), or None when it has one."""
    reasons = (hook.no_global(spec) for hook in export_hooks() if hook.no_global is not None)
    return next((reason for reason in reasons if reason), None)


def describe(card: Mapping[str, Any]) -> list[str]:
    """The hooks' lines about an exported model, for ``fedge-export``'s summary."""
    return [line for hook in export_hooks() if hook.describe is not None for line in hook.describe(card)]
