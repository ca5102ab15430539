"""What an export reads and what it assembles: a checkpoint as the coordinator saved it, and one device's
model made of the checkpoint's parts and the device's own.

Apart from :mod:`export.source`, which reads them, so that a method's export hook (:mod:`export.hooks`)
can name them without importing the readers that call the hooks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from export.errors import SourceError
from storage.state import ServerState

__all__ = ["Checkpoint", "Personalized"]


@dataclass(frozen=True)
class Checkpoint:
    """One round's global state as the coordinator saved it."""

    path: Path
    round: int
    run_id: str
    model_spec: dict[str, Any]
    strategy: str
    extra: dict[str, Any]
    params: dict[str, torch.Tensor]

    @classmethod
    def of(cls, path: Path, state: ServerState, info: Mapping[str, Any]) -> Checkpoint:
        """The export's view of what ``load_checkpoint`` read: the state plus the run id and strategy
        name the coordinator saved beside it."""
        run_id, strategy = info.get("run_id"), info.get("strategy")
        if not isinstance(run_id, str) or not isinstance(strategy, str):
            raise SourceError(f"checkpoint {path} has no run id or strategy name in its metadata, so it was not "
                              "written by fedge-coordinator; export a checkpoint of a fedge run")
        return cls(path, state.round, run_id, state.spec, strategy, state.extra, state.params)


@dataclass(frozen=True, eq=False)
class Personalized:
    """A device's model (eval mode) and, for its card, what was combined: ``global_parts`` (from the
    checkpoint), ``device_parts`` (from the device), ``device_file`` and what that file says about itself."""

    model: nn.Module
    parts: dict[str, Any]
