"""The paired statistic every verdict uses: per-seed differences to a reference run, their mean and 95 % t-interval.

Why paired: a matrix cell's run and its baseline's run of the same seed share the partition, the
initialization and the clients drawn each round, so most of the seed-to-seed noise is common to both
and cancels in their difference. The mean of those differences with a Student-t interval over seeds
is the right statistic; comparing two means ± their spreads is not (it counts the shared noise twice).
One function, so that the privacy report, the DFL verdict and the paired report cannot drift apart.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scipy import stats

__all__ = ["CONFIDENCE", "Paired", "paired", "paired_difference"]

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Paired:
    """Differences per seed and what they say: ``std`` is the sample standard deviation (n - 1), and
    ``std`` and ``interval`` are None below two seeds (one difference has no spread)."""

    seeds: tuple[int, ...]
    differences: tuple[float, ...]
    mean: float
    std: float | None
    interval: tuple[float, float] | None
    confidence: float = CONFIDENCE

    @property
    def n(self) -> int:
        return len(self.differences)

    @property
    def direction(self) -> int:
        """+1 when the interval lies above zero, -1 below, 0 when it holds zero or there is none."""
        if self.interval is None:
            return 0
        low, high = self.interval
        return 1 if low > 0 else -1 if high < 0 else 0

    def as_dict(self) -> dict[str, object]:
        return {"seeds": list(self.seeds), "n": self.n, "per_seed": list(self.differences), "mean": self.mean,
                "std": self.std, "interval": None if self.interval is None else list(self.interval),
                "confidence": self.confidence, "excludes_zero": self.direction != 0, "direction": self.direction}


def paired(differences: Sequence[float], seeds: Sequence[int] | None = None,
           confidence: float = CONFIDENCE) -> Paired:
    """Mean of ``differences`` (one per seed) and its two-sided Student-t interval at ``confidence``."""
    if not differences:
        raise ValueError("paired: no differences (no seed ran in both rows)")
    values = tuple(float(v) for v in differences)
    mean = statistics.fmean(values)
    std = interval = None
    if len(values) > 1:
        std = statistics.stdev(values)
        half = stats.t.ppf(0.5 + confidence / 2, len(values) - 1) * std / len(values) ** 0.5
        interval = (mean - half, mean + half)
    return Paired(tuple(seeds) if seeds is not None else tuple(range(len(values))), values, mean, std, interval,
                  confidence)


def paired_difference(values: Mapping[int, float], reference: Mapping[int, float],
                      confidence: float = CONFIDENCE) -> Paired | None:
    """``values[s] - reference[s]`` over the seeds both have, in seed order; None when they share none."""
    common = sorted(set(values) & set(reference))
    if not common:
        return None
    return paired([values[s] - reference[s] for s in common], common, confidence)
