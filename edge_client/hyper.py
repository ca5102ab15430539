"""Local training hyperparameters, declared once.

The coordinator's ``[train]`` section is :class:`LocalTraining` and a task's ``hyper`` is
read as :class:`TrainHyper` (the same fields plus FedProx's ``mu``, which the configuration
keeps in ``[fedprox]``, and a per-task ``max_steps`` the coordinator sets itself), so a new
setting is added in one place and both sides know it.
No torch here: the coordinator checks its configuration before it imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from storage.errors import FedgeError

__all__ = ["ObjectiveError", "LocalTraining", "TrainHyper"]


class ObjectiveError(FedgeError, ValueError):
    """The task cannot be run on this device (bad hyperparameters, data mismatch)."""


@dataclass(frozen=True)
class LocalTraining:
    epochs: int = 1              # local epochs over the device's data per task
    batch_size: int = 32         # samples per local step
    lr: float = 0.05             # the local SGD learning rate (schedule.lr changes it round by round); a fresh
                                 # optimizer every task
    momentum: float = 0.9        # local SGD momentum, reset every task
    weight_decay: float = 0.0    # local SGD weight decay
    max_grad_norm: float = 0.0   # gradient-norm clipping; 0 disables clipping


@dataclass(frozen=True)
class TrainHyper(LocalTraining):
    mu: float = 0.0              # FedProx proximal weight; 0 is plain FedAvg
    # At most this many local steps (mini-batches), whatever the epochs; 0: no cap. Not a [train] key: the
    # coordinator sets it per task, to shorten a slow device's work in async mode (docs/async.md, "Slow devices").
    max_steps: int = 0

    @classmethod
    def from_dict(cls, hyper: Mapping[str, Any]) -> "TrainHyper":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(hyper) - known)
        if unknown:
            raise ObjectiveError(f"unknown training hyperparameters {unknown}; known: {sorted(known)}")
        h = cls(**hyper)
        if (h.epochs < 1 or h.batch_size < 1 or not (h.lr > 0) or h.momentum < 0 or h.mu < 0
                or not isinstance(h.max_steps, int) or h.max_steps < 0):
            raise ObjectiveError(f"invalid training hyperparameters {hyper!r}")
        return h
