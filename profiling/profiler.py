"""Per-task timing and memory on the device, cheap enough to leave always on.

The client wraps each phase of a task (decode, train, encode, publish, ...) in
:meth:`Profiler.phase` and each optimizer step in :meth:`Profiler.step`; the
summary travels with the result so the coordinator can see which device is slow
and why.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psutil

__all__ = ["Profiler", "percentile"]


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values (absent, not zero)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))
    return ordered[rank]


class Profiler:
    """Collects phase durations, step latencies and the process's peak RSS."""

    def __init__(self) -> None:
        self._process = psutil.Process(os.getpid())
        self.phases: dict[str, float] = {}
        self.steps: list[float] = []
        self.samples = 0
        self.peak_rss = self._process.memory_info().rss
        self._started = time.perf_counter()

    def _sample_memory(self) -> None:
        self.peak_rss = max(self.peak_rss, self._process.memory_info().rss)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start
            self._sample_memory()

    def step(self, seconds: float, batch_size: int) -> None:
        """Record one optimizer step; memory is sampled every 16 steps to stay cheap."""
        self.steps.append(seconds)
        self.samples += batch_size
        if len(self.steps) % 16 == 1:
            self._sample_memory()

    def summary(self) -> dict[str, Any]:
        train_seconds = sum(self.steps)
        return {
            "seconds": time.perf_counter() - self._started,
            "phases": {k: round(v, 6) for k, v in self.phases.items()},
            "steps": len(self.steps),
            "step_p50": percentile(self.steps, 50),
            "step_p95": percentile(self.steps, 95),
            "step_max": max(self.steps) if self.steps else None,
            "samples_per_second": self.samples / train_seconds if train_seconds > 0 else None,
            "peak_rss_bytes": self.peak_rss,
        }
