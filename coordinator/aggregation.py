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
  ``trimmed_mean`` (coordinate-wise mean after dropping ``floor(aggregate.trim x n)`` of
  the n values at each end: 0.2, the default, drops 2 of 10 per side, enough for 2
  hostile clients of 10), or ``clipped_mean`` (each update scaled down to at most the
  round's median update norm, then the sample-weighted mean). The robust rules need
  every result of the round at once (:attr:`Aggregator.streams` is False), like a
  strategy that matches the clients' neurons before combining them.

What a defence withstands depends on how many results a round has: a trim of 0.2 drops
nothing of 4. :func:`tolerance` says it in one line at the start of a run, and warns
when a defence the user asked for withstands no hostile client at the configured size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from coordinator.config_sections import DEFAULT_TRIM, RULES
from coordinator.strategies.base import AggregationError, WeightedSum

__all__ = ["RULES", "DEFAULT_TRIM", "Aggregator", "Tolerance", "tolerance", "trimmed_count", "update_norms",
           "norm_bound_keep"]


@dataclass(frozen=True)
class Aggregator:
    """Combines clients' tensors into the new global ones, by ``rule``."""

    rule: str = "mean"
    trim: float = DEFAULT_TRIM

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"aggregate.rule is one of {', '.join(RULES)}, got {self.rule!r}")
        if not 0 <= self.trim < 0.5:
            raise ValueError(f"aggregate.trim is the fraction dropped at each end, in [0, 0.5), got {self.trim}")

    @property
    def streams(self) -> bool:
        """Whether results can be folded in one at a time (only the mean is an associative reduce)."""
        return self.rule == "mean"

    def combine(self, updates: Sequence[tuple[Mapping[str, torch.Tensor], float]]) -> dict[str, torch.Tensor]:
        """The round's update (float64) from (update, sample count) per client: what the server
        optimizer then steps on."""
        if not updates:
            raise AggregationError("nothing to aggregate")
        if self.rule == "mean":
            return WeightedSum.reduce(WeightedSum.of(u, w) for u, w in updates).mean(torch.float64)
        names = list(updates[0][0])
        wide = [{k: u[k].to(torch.float64) for k in names} for u, _ in updates]
        if self.rule == "clipped_mean":
            norms = [_norm(u) for u in wide]
            bound = float(torch.tensor(norms).median())
            scaled = [{k: v * min(1.0, bound / n) if n > 0 else v for k, v in u.items()}
                      for u, n in zip(wide, norms)]
            return WeightedSum.reduce(WeightedSum.of(u, w) for u, (_, w) in zip(scaled, updates)).mean(torch.float64)
        return {k: self._coordinatewise(torch.stack([u[k] for u in wide])) for k in names}

    def _coordinatewise(self, stacked: torch.Tensor) -> torch.Tensor:
        if self.rule == "median":
            n = stacked.shape[0]   # the mean of the two middle values for an even count, as numpy's median
            ordered = stacked.sort(dim=0).values
            return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2
        cut = trimmed_count(self.trim, stacked.shape[0])
        ordered = stacked.sort(dim=0).values
        return ordered[cut:stacked.shape[0] - cut].mean(dim=0)


def trimmed_count(trim: float, n: int) -> int:
    """Values the trimmed mean drops at each end of ``n``: floor(trim x n), at most (n - 1) // 2.

    The product is taken as the decimal the user wrote: 0.29 of 100 drops 29, though 0.29 * 100
    is 28.999... in binary floating point.
    """
    return max(0, min(math.floor(trim * n + 1e-9), (n - 1) // 2))


def _norm(update: Mapping[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((v.to(torch.float64) ** 2).sum()) for v in update.values()))


def update_norms(updates: Sequence[Mapping[str, torch.Tensor]]) -> list[float]:
    """Each update's L2 norm over all its tensors."""
    return [_norm(u) for u in updates]


def norm_bound_keep(norms: Sequence[float], k: float) -> list[bool]:
    """Which results stay under the bound ``k`` x the round's median norm (all of them when ``k`` is 0)."""
    if k <= 0 or not norms:
        return [True] * len(norms)
    median = float(torch.tensor(list(norms), dtype=torch.float64).median())
    return [math.isfinite(n) and n <= k * median for n in norms]


@dataclass(frozen=True)
class Tolerance:
    """What the configured defence withstands at a round's size, said when a run starts."""

    tolerated: int      # hostile clients a round that cannot move the model further than an honest one
    message: str        # one line, "aggregation: ..."
    warning: str = ""   # set when a defence was asked for and it withstands no hostile client


def _withstood(rule: str, trim: float, norm_bound: float, n: int) -> tuple[int, int]:
    """Hostile clients of ``n`` that the rule outvotes coordinate by coordinate (median, trimmed
    mean), and those held to a multiple of the round's median update norm, which stays an honest
    client's while they are fewer than half (clipped mean, norm bound)."""
    below_half = (n - 1) // 2
    outvoted = {"median": below_half, "trimmed_mean": trimmed_count(trim, n)}.get(rule, 0)
    return outvoted, below_half if rule == "clipped_mean" or norm_bound > 0 else 0


def tolerance(rule: str, *, trim: float = DEFAULT_TRIM, norm_bound: float = 0.0, per_round: int,
              min_results: int = 0) -> Tolerance:
    """How many hostile clients ``rule`` (with ``trim`` and ``norm_bound``) withstands among the
    ``per_round`` results of a round, and among ``min_results`` when a round may close with fewer.

    A demanding user reads a defence's name as a promise; this says what it keeps at the
    configured size before any round runs, and warns when a defence was asked for but keeps
    nothing (a trim that rounds down to no value, or a round of one or two results).
    """
    if rule not in RULES:
        raise ValueError(f"aggregate.rule is one of {', '.join(RULES)}, got {rule!r}")
    if per_round < 1:
        raise ValueError(f"a round has at least one client, got {per_round}: set clients.per_round")
    if rule == "mean" and norm_bound <= 0:
        return Tolerance(0, "aggregation: mean tolerates no hostile client: one update can move the model as far "
                            "as it likes (aggregate.rule and aggregate.norm_bound set a defence: docs/robustness.md)")
    least = min_results if 0 < min_results < per_round else per_round
    name = (f"{rule} (trim {trim:g})" if rule == "trimmed_mean" else rule) + \
        (f" with norm bound {norm_bound:g}" if norm_bound > 0 else "")
    outvoted, bounded = _withstood(rule, trim, norm_bound, per_round)
    full, fewest = max(outvoted, bounded), max(_withstood(rule, trim, norm_bound, least))
    count = f"up to {full} hostile client{'s' * (full != 1)}" if full else "no hostile client"
    message = f"aggregation: {name} tolerates {count} of the {per_round} a round"
    if bounded > outvoted:
        held = ("the round's median update norm" if rule == "clipped_mean" else
                f"{norm_bound:g}x the round's median update norm")
        message += (f", {outvoted} outvoted and the rest held to {held}" if outvoted else
                    f", each held to {held} (bounded, not removed)")
    if fewest != full:
        message += f"; {fewest} when a round closes with the {least} results of clients.min_results"
    return Tolerance(full, message, _warning(rule, trim, name, least) if fewest == 0 else "")


def _warning(rule: str, trim: float, name: str, n: int) -> str:
    """Why ``name`` withstands no hostile client among ``n`` results, and what to change."""
    if rule == "trimmed_mean" and n >= 3:
        return (f"aggregate: {name} drops no value of {n} results a round (floor({trim:g} x {n}) = 0), so it "
                f"tolerates no hostile client: raise aggregate.trim to {math.ceil(100 / n) / 100:g} or more, "
                "or use median")
    return (f"aggregate: {name} tolerates no hostile client with {n} result{'s' * (n != 1)} a round (outvoting "
            "or bounding one takes at least 3): select at least 3 clients a round (clients.per_round, "
            "clients.min_results)")
