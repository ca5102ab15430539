"""The buffer of asynchronous aggregation: results waiting to become model versions, K at a time.

In ``run.mode = "async"`` (docs/async.md) a device trains from the model version that was current
when it got its task; by the time its result comes the model may have moved on, ``s`` versions.
Every result is discounted by FedBuff's polynomial staleness function ``(1 + s) ** -a`` (``a`` =
``async.staleness_exponent``), and every ``K`` results (``async.buffer_size``) make one version.
``async.weighting`` says how a version's ``K`` results combine:

- ``fedbuff`` (Nguyen et al., AISTATS 2022, Algorithm 1): the sum of the discounted deltas over
  ``K``, every result counting equally whatever its sample count. The discount shrinks the step
  even when all ``K`` results are equally stale.
- ``normalized``: the mean of the deltas weighted by ``samples x discount``, over the total weight
  (fedge's rule before FedBuff's; the discount only moves weight between results of different
  staleness, and cancels when they are equally stale).

Both are the engine's associative fold of :class:`WeightedSum` (only the share of the divisor a
result adds differs): memory of one model per version's worth however many results wait, and
arrival order changes only the rounding.

A version holds exactly ``K`` results: one that comes while ``K`` wait for their version (a stop
while the version is being made, a burst) starts the next version's worth, its staleness counted
against the version it will meet, as FedBuff's server, which makes a version the moment its
buffer is full, would count it. Everything waiting is part of the server state on a checkpoint
(the sums as ``async/sum/NAME`` buffers, the counts in ``extra["async"]``), so a run stopped with
results waiting applies them after ``--resume`` instead of losing them, and never twice: their
devices were acknowledged.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from coordinator.strategies.base import AggregationError, ClientResult, WeightedSum
from storage.state import ServerState

__all__ = ["AsyncBuffer", "Batch", "staleness_discount", "result_terms", "SUMS", "EXTRA"]

log = logging.getLogger("fedge.coordinator")

SUMS = "async/sum/"   # the first batch's weighted sums among the state's buffers on a checkpoint
ROOT = "async/"       # every batch's sums start with this (the later ones with async/sumJ/)
EXTRA = "async"       # the counts (and the tasks in flight) in the state's extra
BEFORE_FEDBUFF = "normalized"   # the rule of a checkpoint that names none: written before async.weighting was


def staleness_discount(staleness: int, exponent: float) -> float:
    """FedBuff's staleness function ``(1 + staleness) ** -exponent`` (1 / sqrt(1 + s) at exponent 0.5)."""
    if staleness < 0:
        raise AggregationError(f"a result cannot come from a version ahead of the model ({staleness} versions)")
    return (1.0 + staleness) ** -exponent


def _fedbuff(samples: int, discount: float) -> tuple[float, float]:
    return discount, 1.0   # every result counts once in the divisor: the discounted sum over K


def _normalized(samples: int, discount: float) -> tuple[float, float]:
    weight = samples * discount
    return weight, weight   # a weighted mean: the discount cancels among equally stale results


RULES: dict[str, Callable[[int, float], tuple[float, float]]] = {"fedbuff": _fedbuff, "normalized": _normalized}


def result_terms(weighting: str, samples: int, staleness: int, exponent: float) -> tuple[float, float]:
    """A result's (factor on its delta, share of the divisor) under ``async.weighting``."""
    if weighting not in RULES:
        raise AggregationError(f"unknown async.weighting {weighting!r}: use one of {', '.join(RULES)}")
    return RULES[weighting](samples, staleness_discount(staleness, exponent))


@dataclass
class Batch:
    """One version's worth of results: their folded deltas, and what the version's row says of them."""

    weighting: str = "fedbuff"
    partial: WeightedSum | None = None
    count: int = 0
    samples: int = 0
    loss_sum: float = 0.0                                        # samples x train_loss, summed
    staleness: dict[int, int] = field(default_factory=dict)      # versions behind -> results

    def add(self, result: ClientResult, staleness: int, exponent: float) -> None:
        """Fold one result's deltas in; AggregationError (nothing changed) when they cannot be."""
        weight, share = result_terms(self.weighting, result.num_samples, staleness, exponent)
        part = WeightedSum.of(result.deltas, weight, share)
        self.partial = part if self.partial is None else self.partial + part
        self.count += 1
        self.samples += result.num_samples
        self.loss_sum += float(result.metrics.get("train_loss", 0.0)) * result.num_samples
        self.staleness[staleness] = self.staleness.get(staleness, 0) + 1

    def update(self, server_lr: float = 1.0) -> dict[str, torch.Tensor]:
        """The combined update (float64, by tensor name) times ``server_lr`` (FedBuff's server learning rate)."""
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

    def _counts(self) -> dict[str, Any]:
        return {"weighting": self.weighting, "count": self.count, "samples": self.samples, "loss_sum": self.loss_sum,
                "weight": self.partial.weight if self.partial else 0.0,
                "staleness": {str(s): n for s, n in self.staleness.items()}}

    @classmethod
    def _restored(cls, counts: dict[str, Any], sums: dict[str, torch.Tensor]) -> Batch | None:
        """The batch a checkpoint saved (None if it held no result)."""
        weight = float(counts.get("weight", 0.0))
        if not sums or not weight > 0:
            return None
        return cls(str(counts.get("weighting", BEFORE_FEDBUFF)), WeightedSum(sums, weight),
                   int(counts.get("count", 0)), int(counts.get("samples", 0)), float(counts.get("loss_sum", 0.0)),
                   {int(s): int(n) for s, n in dict(counts.get("staleness", {})).items()})


def _prefix(index: int) -> str:
    return SUMS if index == 0 else f"{ROOT}sum{index}/"


@dataclass
class AsyncBuffer:
    """Results taken and not yet in a version, in batches of ``size`` (K): every batch but the last is full
    and waits for its version; the last fills. ``count`` is every result waiting."""

    size: int = 1
    weighting: str = "fedbuff"
    exponent: float = 0.5
    batches: list[Batch] = field(default_factory=list)

    @property
    def count(self) -> int:
        return sum(b.count for b in self.batches)

    def _filling(self) -> bool:
        """Whether the last batch takes another result (else the next one starts a batch of its own)."""
        return bool(self.batches) and self.batches[-1].count < self.size

    def staleness(self, trained_from: int, version: int) -> int:
        """How stale a result trained from ``trained_from`` is when the model is at ``version``: counted against
        the version it will meet, after the full batches ahead of it have made theirs."""
        ahead = len(self.batches) - (1 if self._filling() else 0)
        return version + ahead - trained_from

    def add(self, result: ClientResult, staleness: int) -> None:
        """Fold a result into the batch filling (a new one when the last is full); AggregationError, nothing
        changed, when it cannot be."""
        if self._filling():
            self.batches[-1].add(result, staleness, self.exponent)
            return
        batch = Batch(self.weighting)
        batch.add(result, staleness, self.exponent)
        self.batches.append(batch)

    def due(self) -> bool:
        """Whether the first batch is ready to make a version: full, or sealed by a batch after it (a batch a
        checkpoint saved under a larger ``async.buffer_size``)."""
        return len(self.batches) > 1 or (bool(self.batches) and self.batches[0].count >= self.size)

    def take(self) -> Batch:
        """The first batch, out of the buffer: the next version's results."""
        if not self.batches:
            raise AggregationError("the buffer holds no result")
        return self.batches.pop(0)

    def put_back(self, batch: Batch) -> None:
        """A batch taken for a version that was never checkpointed, first again (a resumed run makes it)."""
        self.batches.insert(0, batch)

    def finite(self) -> bool:
        return all(b.finite() for b in self.batches)

    def saved_in(self, state: ServerState, in_flight: dict[str, list[Any]], journal: int = 0) -> ServerState:
        """``state`` with every waiting batch, the tasks in flight (task id -> [client, version]) and the last
        journaled result it accounts for (:mod:`async_journal`) in it, to checkpoint. The first batch keeps the
        keys a single buffer always had; the others follow in ``queued``."""
        sums, counts = {}, []
        for index, batch in enumerate(b for b in self.batches if b.partial is not None):
            sums.update({_prefix(index) + k: v for k, v in batch.partial.sums.items()})
            counts.append(batch._counts())
        extra = {**(counts[0] if counts else Batch(self.weighting)._counts()), "queued": counts[1:],
                 "in_flight": in_flight, "journal": journal}
        return dataclasses.replace(state, buffers={**state.buffers, **sums}, extra={**state.extra, EXTRA: extra})

    @staticmethod
    def journal_mark(state: ServerState) -> int:
        """The last journaled result a checkpointed state accounts for (0: none, or written before the journal)."""
        saved = state.extra.get(EXTRA)
        mark = saved.get("journal", 0) if isinstance(saved, dict) else 0
        return mark if isinstance(mark, int) and mark >= 0 else 0

    @classmethod
    def taken_from(cls, state: ServerState, size: int = 1, weighting: str = "fedbuff",
                   exponent: float = 0.5) -> tuple[AsyncBuffer, ServerState, dict[str, Any]]:
        """The buffer a checkpointed state holds (an empty one if none), the state without it, and the tasks
        that were in flight when it was saved. A saved batch keeps the rule it was summed under, even when
        ``weighting`` names another (it holds no per-result terms to redo); new batches follow ``weighting``."""
        buffer = cls(size, weighting, exponent)
        saved = state.extra.get(EXTRA)
        if not isinstance(saved, dict):
            return buffer, state, {}
        queued = saved.get("queued", [])
        for index, counts in enumerate([saved, *(queued if isinstance(queued, list) else [])]):
            prefix = _prefix(index)
            sums = {k[len(prefix):]: v.to(torch.float64) for k, v in state.buffers.items() if k.startswith(prefix)}
            batch = Batch._restored(counts if isinstance(counts, dict) else {}, sums)
            if batch is not None:
                buffer.batches.append(batch)
        if any(b.weighting != weighting for b in buffer.batches):
            log.info("the checkpoint's buffered results were summed under async.weighting = %r: their version "
                     "follows it, the next ones %r", buffer.batches[0].weighting, weighting)
        rest = dataclasses.replace(state, buffers={k: v for k, v in state.buffers.items() if not k.startswith(ROOT)},
                                   extra={k: v for k, v in state.extra.items() if k != EXTRA})
        in_flight = saved.get("in_flight", {})
        return buffer, rest, in_flight if isinstance(in_flight, dict) else {}
