"""The buffer of asynchronous aggregation: results folded with staleness weights until a version is due.

In ``run.mode = "async"`` (docs/async.md) a device trains from the model version that was current
when it got its task; by the time its result comes the model may have moved on. A result ``s``
versions behind weighs ``samples x (1 + s) ** -a`` (FedBuff's polynomial staleness discount, ``a``
= ``async.staleness_exponent``), and the buffer's update is the weighted mean of the deltas it
holds. The fold is the engine's associative (weighted sum, total weight) of :class:`WeightedSum`:
memory of one model however many results wait, and arrival order changes only the rounding.

The buffer is part of the server state on a checkpoint (its sums as ``async/sum/NAME`` buffers,
its counts in ``extra["async"]``), so a run stopped with results buffered applies them after
``--resume`` instead of losing them, and never twice: their devices were acknowledged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from coordinator.strategies.base import AggregationError, ClientResult, WeightedSum
from storage.state import ServerState

__all__ = ["AsyncBuffer", "staleness_weight", "SUMS", "EXTRA"]

SUMS = "async/sum/"   # the buffer's weighted sums among the state's buffers on a checkpoint
EXTRA = "async"       # its counts (and the tasks in flight) in the state's extra


def staleness_weight(samples: int, staleness: int, exponent: float) -> float:
    """A result's weight in its buffer: its sample count discounted by ``(1 + staleness) ** -exponent``."""
    if staleness < 0:
        raise AggregationError(f"a result cannot come from a version ahead of the model ({staleness} versions)")
    return samples * (1.0 + staleness) ** -exponent


@dataclass
class AsyncBuffer:
    """Results waiting for the next version: their weighted deltas, and what the version's row says of them."""

    partial: WeightedSum | None = None
    count: int = 0
    samples: int = 0
    loss_sum: float = 0.0                                        # samples x train_loss, summed
    staleness: dict[int, int] = field(default_factory=dict)      # versions behind -> results

    def add(self, result: ClientResult, staleness: int, exponent: float) -> None:
        """Fold one result's deltas in; AggregationError (nothing changed) when they cannot be."""
        part = WeightedSum.of(result.deltas, staleness_weight(result.num_samples, staleness, exponent))
        self.partial = part if self.partial is None else self.partial + part
        self.count += 1
        self.samples += result.num_samples
        self.loss_sum += float(result.metrics.get("train_loss", 0.0)) * result.num_samples
        self.staleness[staleness] = self.staleness.get(staleness, 0) + 1

    def update(self, server_lr: float = 1.0) -> dict[str, torch.Tensor]:
        """The combined update (float64, by tensor name): the staleness-weighted mean delta times ``server_lr``."""
        if self.partial is None:
            raise AggregationError("the buffer holds no result")
        return {k: v * server_lr for k, v in self.partial.mean(torch.float64).items()}

    def finite(self) -> bool:
        return self.partial is None or all(bool(torch.isfinite(v).all()) for v in self.partial.sums.values())

    def columns(self) -> dict[str, Any]:
        """The version row's columns about the results it applied."""
        return {"results": self.count, "train_samples": self.samples,
                "train_loss": self.loss_sum / self.samples if self.samples else None,
                "staleness": {str(s): n for s, n in sorted(self.staleness.items())}}

    def saved_in(self, state: ServerState, in_flight: dict[str, list[Any]]) -> ServerState:
        """``state`` with this buffer and the tasks in flight (task id -> [client, version]) in it, to checkpoint."""
        sums = {SUMS + k: v for k, v in (self.partial.sums if self.partial else {}).items()}
        extra = {"count": self.count, "samples": self.samples, "loss_sum": self.loss_sum,
                 "weight": self.partial.weight if self.partial else 0.0,
                 "staleness": {str(s): n for s, n in self.staleness.items()}, "in_flight": in_flight}
        return dataclasses.replace(state, buffers={**state.buffers, **sums}, extra={**state.extra, EXTRA: extra})

    @classmethod
    def taken_from(cls, state: ServerState) -> tuple[AsyncBuffer, ServerState, dict[str, Any]]:
        """The buffer a checkpointed state holds (an empty one if none), the state without it, and the tasks
        that were in flight when it was saved."""
        saved = state.extra.get(EXTRA)
        if not isinstance(saved, dict):
            return cls(), state, {}
        sums = {k[len(SUMS):]: v.to(torch.float64) for k, v in state.buffers.items() if k.startswith(SUMS)}
        weight = float(saved.get("weight", 0.0))
        buffer = cls(WeightedSum(sums, weight) if sums and weight > 0 else None, int(saved.get("count", 0)),
                     int(saved.get("samples", 0)), float(saved.get("loss_sum", 0.0)),
                     {int(s): int(n) for s, n in dict(saved.get("staleness", {})).items()})
        if buffer.partial is None:
            buffer = cls()
        rest = dataclasses.replace(state, buffers={k: v for k, v in state.buffers.items() if not k.startswith(SUMS)},
                                   extra={k: v for k, v in state.extra.items() if k != EXTRA})
        in_flight = saved.get("in_flight", {})
        return buffer, rest, in_flight if isinstance(in_flight, dict) else {}
