"""Local objectives a task can ask a device to run, by name.

Each objective is a function of the model (already holding the weights the task
sent down), the device's private data, the task's hyperparameters and a seed; it
returns how many samples it used and a few metrics. The client then sends back
exactly the tensors the task asked for. Methods from papers add their client side
here, next to plain training.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from profiling.profiler import Profiler

__all__ = ["ObjectiveError", "LocalData", "ObjectiveOutput", "OBJECTIVES", "train", "evaluate",
           "shuffle_seed", "TrainHyper"]


class ObjectiveError(ValueError):
    """The task cannot be run on this device (bad hyperparameters, data mismatch)."""


@dataclass(frozen=True)
class LocalData:
    x: torch.Tensor  # float32 [N, C, H, W]
    y: torch.Tensor  # int64 [N]

    def __len__(self) -> int:
        return int(self.y.shape[0])


@dataclass(frozen=True)
class ObjectiveOutput:
    num_samples: int
    metrics: dict[str, float]


@dataclass(frozen=True)
class TrainHyper:
    epochs: int = 1
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    mu: float = 0.0              # FedProx proximal weight; 0 is plain FedAvg
    max_grad_norm: float = 0.0   # 0 disables clipping

    @classmethod
    def from_dict(cls, hyper: Mapping[str, Any]) -> "TrainHyper":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(hyper) - known)
        if unknown:
            raise ObjectiveError(f"unknown training hyperparameters {unknown}; known: {sorted(known)}")
        h = cls(**hyper)
        if h.epochs < 1 or h.batch_size < 1 or not (h.lr > 0) or h.momentum < 0 or h.mu < 0:
            raise ObjectiveError(f"invalid training hyperparameters {hyper!r}")
        return h


def shuffle_seed(seed: int, round: int, client_id: str) -> int:
    """Seed for a client's local shuffling, the same in every process and on resume."""
    return (seed * 1_000_003 + round * 10_007 + zlib.crc32(client_id.encode())) % (2**63)


def train(model: nn.Module, data: LocalData, hyper: Mapping[str, Any], seed: int,
          profiler: Profiler) -> ObjectiveOutput:
    """SGD on the local data; with ``mu > 0`` adds FedProx's (mu/2)||w - w_global||^2.

    A fresh optimizer each round, so momentum never leaks between rounds.
    """
    h = TrainHyper.from_dict(hyper)
    if len(data) == 0:
        raise ObjectiveError("this device has no training samples")
    params = [p for p in model.parameters() if p.requires_grad]
    anchor = [p.detach().clone() for p in params] if h.mu > 0 else []
    opt = torch.optim.SGD(params, lr=h.lr, momentum=h.momentum, weight_decay=h.weight_decay)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model.train()
    total_loss, seen = 0.0, 0
    for _ in range(h.epochs):
        order = torch.randperm(len(data), generator=gen)
        for start in range(0, len(data), h.batch_size):
            t0 = time.perf_counter()
            idx = order[start:start + h.batch_size]
            xb, yb = data.x[idx], data.y[idx]
            loss = F.cross_entropy(model(xb), yb)
            objective = loss
            if anchor:
                objective = loss + 0.5 * h.mu * sum(((p - a) ** 2).sum() for p, a in zip(params, anchor))
            opt.zero_grad(set_to_none=True)
            objective.backward()
            if h.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, h.max_grad_norm)
            opt.step()
            value = float(loss.detach())
            if not math.isfinite(value):
                raise ObjectiveError("training diverged (non-finite loss); lower the learning rate")
            total_loss += value * len(idx)
            seen += len(idx)
            profiler.step(time.perf_counter() - t0, len(idx))
    return ObjectiveOutput(num_samples=len(data), metrics={"train_loss": total_loss / max(seen, 1)})


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on (x, y)."""
    model.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, len(y), batch_size):
        logits = model(x[start:start + batch_size])
        yb = y[start:start + batch_size]
        loss_sum += float(F.cross_entropy(logits, yb, reduction="sum"))
        correct += int((logits.argmax(1) == yb).sum())
    n = max(len(y), 1)
    return loss_sum / n, correct / n


Objective = Callable[[nn.Module, LocalData, Mapping[str, Any], int, Profiler], ObjectiveOutput]
OBJECTIVES: dict[str, Objective] = {"train": train}
