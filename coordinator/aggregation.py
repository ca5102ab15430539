"""How a round's updates are combined when some clients may be wrong or hostile.

FedAvg's sample-weighted mean lets one client move the model as far as it likes: a
finite but huge update (or one pointing the wrong way, scaled) outweighs every honest
one. Two defences, both over **updates** (a result minus the global tensors the
client was sent), so that they compare what clients changed rather than where the
model already is:

- a **norm bound** (``aggregate.norm_bound = k``): a result whose update norm is above
  ``k`` times the round's median update norm is rejected before aggregation and counted
  (``norm_rejected`` in ``metrics.jsonl``); with honest clients in the majority the
  median is an honest client's norm;
- a **rule** (``aggregate.rule``): ``mean`` (FedAvg's sample-weighted mean: an
  associative reduce the engine can stream), ``median`` (coordinate-wise median),
  ``trimmed_mean`` (coordinate-wise mean after dropping the ``aggregate.trim`` fraction
  of the largest and of the smallest values), or ``clipped_mean`` (each update scaled
  down to at most the round's median update norm, then the sample-weighted mean). The
  robust rules need every result of the round at once (:attr:`Aggregator.streams` is
  False), like FedMA's matching.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from coordinator.strategies.base import AggregationError, WeightedSum

__all__ = ["RULES", "Aggregator", "update_norms", "norm_bound_keep"]

RULES = ("mean", "median", "trimmed_mean", "clipped_mean")


@dataclass(frozen=True)
class Aggregator:
    """Combines clients' tensors into the new global ones, by ``rule``."""

    rule: str = "mean"
    trim: float = 0.1

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"aggregate.rule is one of {', '.join(RULES)}, got {self.rule!r}")
        if not 0 <= self.trim < 0.5:
            raise ValueError(f"aggregate.trim is the fraction dropped at each end, in [0, 0.5), got {self.trim}")

    @property
    def streams(self) -> bool:
        """Whether results can be folded in one at a time (only the mean is an associative reduce)."""
        return self.rule == "mean"

    def combine(self, results: Sequence[tuple[Mapping[str, torch.Tensor], float]],
                reference: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The new tensors from (tensors, sample count) per client; ``reference`` is what was sent down."""
        if not results:
            raise AggregationError("nothing to aggregate")
        if self.rule == "mean":
            return WeightedSum.reduce(WeightedSum.of(t, w) for t, w in results).mean()
        names = list(results[0][0])
        updates = [{k: t[k].to(torch.float64) - reference[k].to(torch.float64) for k in names} for t, _ in results]
        if self.rule == "clipped_mean":
            norms = [_norm(u) for u in updates]
            bound = float(torch.tensor(norms).median())
            scaled = [{k: v * min(1.0, bound / n) if n > 0 else v for k, v in u.items()}
                      for u, n in zip(updates, norms)]
            total = WeightedSum.reduce(WeightedSum.of(u, w) for u, (_, w) in zip(scaled, results))
            combined = {k: v.to(torch.float64) for k, v in total.mean().items()}
        else:
            combined = {k: self._coordinatewise(torch.stack([u[k] for u in updates])) for k in names}
        return {k: (reference[k].to(torch.float64) + v).to(torch.float32) for k, v in combined.items()}

    def _coordinatewise(self, stacked: torch.Tensor) -> torch.Tensor:
        if self.rule == "median":
            n = stacked.shape[0]   # the mean of the two middle values for an even count, as numpy's median
            ordered = stacked.sort(dim=0).values
            return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2
        cut = math.floor(self.trim * stacked.shape[0])
        ordered = stacked.sort(dim=0).values
        return ordered[cut:stacked.shape[0] - cut].mean(dim=0)


def _norm(update: Mapping[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((v.to(torch.float64) ** 2).sum()) for v in update.values()))


def update_norms(results: Sequence[Mapping[str, torch.Tensor]], reference: Mapping[str, torch.Tensor]) -> list[float]:
    """Each result's update norm over the tensors it shares with ``reference`` (what it was sent)."""
    return [_norm({k: t[k].to(torch.float64) - reference[k].to(torch.float64) for k in t if k in reference})
            for t in results]


def norm_bound_keep(norms: Sequence[float], k: float) -> list[bool]:
    """Which results stay under the bound ``k`` x the round's median norm (all of them when ``k`` is 0)."""
    if k <= 0 or not norms:
        return [True] * len(norms)
    median = float(torch.tensor(list(norms), dtype=torch.float64).median())
    return [math.isfinite(n) and n <= k * median for n in norms]
