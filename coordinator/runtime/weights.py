"""How much one result may weigh in the mean: its sample count, within a bound.

A result's ``num_samples`` is its weight in FedAvg's sample-weighted mean, and it is the device's
own claim. The intake refuses a result claiming more than its device announced in its presence,
but the announcement is a claim too: one authorised device announcing 10^9 samples would own every
round's mean. So a claim is capped at ``clients.max_weight_ratio`` times the median of the counts the
online devices announced (the lower median: with two devices the other one's count sets it, so no
device raises its own bound), and at ``clients.max_samples`` when that is set. The cap is a cap, not
a refusal: a device with more data than most still counts, as much as the bound allows.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable

__all__ = ["REFRESH_SECONDS", "WeightBound"]

REFRESH_SECONDS = 1.0   # the fleet's median is recomputed at most this often (it moves only as devices come and go)


class WeightBound:
    """The largest weight a result may carry, from the online devices' announced sample counts.

    ``announced()`` gives those counts (devices that announced none are left out); ``ratio`` 0 turns
    the relative bound off, ``fixed`` 0 the fixed one.
    """

    def __init__(self, ratio: float, fixed: int, announced: Callable[[], Iterable[int | None]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ratio = ratio
        self.fixed = fixed
        self._announced = announced
        self._clock = clock
        self._cached: tuple[float, int | None, int | None] | None = None   # (when, limit, median)

    def describe(self) -> str:
        """Which bound applies, for the log at the start of a run."""
        parts = []
        if self.ratio:
            parts.append(f"{self.ratio:g} x the median sample count the online devices announced "
                         "(clients.max_weight_ratio)")
        if self.fixed:
            parts.append(f"{self.fixed:,} samples (clients.max_samples)")
        if not parts:
            return ("a result's weight (its sample count) is not bounded beyond what its device announced: "
                    "clients.max_weight_ratio and clients.max_samples are 0")
        return (f"a result's weight (its sample count) is capped at {' and at '.join(parts)}; capped results are "
                "counted as weight_capped in the round's row")

    def limit(self) -> tuple[int | None, str]:
        """The largest weight now (None: unbounded) and what sets it, for the log line of a capped claim."""
        now = self._clock()
        if self._cached is None or now - self._cached[0] >= REFRESH_SECONDS:
            counts = [n for n in self._announced() if n]
            median = statistics.median_low(counts) if counts and self.ratio else None
            relative = max(1, int(self.ratio * median)) if median is not None else None
            bounds = [b for b in (relative, self.fixed or None) if b is not None]
            self._cached = (now, min(bounds) if bounds else None, median)
        _, limit, median = self._cached
        if limit is None:
            return None, ""
        if limit == self.fixed:
            return limit, "clients.max_samples"
        return limit, (f"{self.ratio:g} x the online devices' median announced count {median:,}; "
                       "clients.max_weight_ratio")

    def cap(self, claim: int) -> tuple[int, str]:
        """``claim`` within the bound, and why it was capped ('' when it was not)."""
        limit, source = self.limit()
        if limit is None or claim <= limit:
            return claim, ""
        return limit, f"it claims {claim:,} samples, above the bound of {limit:,} ({source})"
