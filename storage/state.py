"""The server state: everything the coordinator needs to continue a run.

It is a plain value, so checkpointing is saving it and resuming is loading it
(:mod:`storage.checkpoint`); the strategies produce it, the coordinator checkpoints
it, the export reads it back. torch is imported for annotations only: importing this
module imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["ServerState"]


@dataclass(frozen=True)
class ServerState:
    """Everything the coordinator needs to continue a run: saved in each checkpoint.

    ``spec`` is the model spec every party builds the network from (JSON, sent with
    each task). It belongs to the state, not to the run's configuration, because a
    method may change the network between rounds (grow layers, say): a strategy
    returns a state with a new spec and matching parameters, and the coordinator,
    the devices, the checkpoint and the export all follow it.

    ``buffers`` are tensors a strategy keeps between rounds that are not the model (a server
    optimizer's moments): checkpointed with the parameters, never sent to devices or exported.
    """

    round: int
    params: dict[str, torch.Tensor]
    spec: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)   # JSON-serializable strategy state
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
