"""Per-task timing, memory, CPU and temperature on the device, cheap enough to leave always on.

The client wraps each phase of a task in :meth:`Profiler.phase` (or reports one it
timed itself with :meth:`Profiler.add`); a training loop brackets each step with
:meth:`Profiler.begin_step` / :meth:`Profiler.end_step` and marks the boundaries
between data loading, forward, backward and optimizer step with :meth:`Profiler.lap`.
The summary travels with the result so the coordinator can see which device is
slow and why.

Cost, because this runs inside every training step: a lap is one ``perf_counter``
call and a dict update (well under a microsecond); RSS (about 20 µs) is read every
16 steps and at the end of each phase, and on Linux the kernel's exact peak
(``VmHWM``, reset when the task starts) once at the end; USS (0.3 to 9 ms, depending
on the process's size) only while its reads stay within :data:`USS_BUDGET` of the task;
temperature, CPU times and the Pi's throttling flags once at the start and once at
the end of a task. :class:`NullProfiler` has the same methods and does nothing, so
the overhead can be measured against the same loop with profiling off.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psutil

from profiling.memory import battery, memory_available_bytes, memory_total_bytes
from profiling.sensors import cpu_temperature, pi_throttling

__all__ = ["Profiler", "NullProfiler", "percentile", "reset_peak_rss", "peak_rss_since_reset", "TASK_PHASES",
           "STEP_PHASES", "USS_BUDGET"]

# The phases of a task, in order. `train` is the whole local objective; the step
# phases below are its parts, summed over all steps (what is left of `train` is the
# objective's own setup: optimizer creation, shuffling, evaluation of the loss value).
TASK_PHASES = ("receive", "decode", "train", "encode", "publish")
STEP_PHASES = ("data", "forward", "backward", "optimizer")

_RSS_EVERY_STEPS = 16
# USS reads /proc/PID/smaps: about 0.3 ms for a small process, 9 ms for one with torch
# loaded. Reading it is allowed while the time spent on it stays within this share of
# the task, so a short task may have no USS (absent) and a long one gets a read every
# couple of seconds. The cost of a read is remembered across tasks of the process.
USS_BUDGET = 0.01
_uss_cost = [0.01]   # seconds per read, learned; starts from a process with torch loaded
_carried_peak = [0]  # the kernel's peak as read before a split (split_peak_rss), since the last reset


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values (absent, not zero)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))
    return ordered[rank]


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark of this process (Linux 4.0+); False where unsupported.

    With it the peak is exact, spikes between samples included; without it the peak
    is the largest sampled RSS.
    """
    _carried_peak[0] = 0
    return _clear_kernel_peak()


def _clear_kernel_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _kernel_peak() -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_rss_since_reset() -> int | None:
    """``VmHWM`` of /proc/self/status in bytes: the peak RSS since the last reset."""
    peak = _kernel_peak()
    return None if peak is None else max(peak, _carried_peak[0])


def split_peak_rss() -> int | None:
    """The kernel's peak RSS since the last split (or reset), starting a new one; :func:`peak_rss_since_reset`
    still counts it. A memory trace (:mod:`profiling.memory_trace`) reads each phase's own peak so."""
    peak = _kernel_peak()
    if peak is not None:
        _carried_peak[0] = max(_carried_peak[0], peak)
        _clear_kernel_peak()
    return peak


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


class Profiler:
    """Collects phase durations, step latencies, peak memory, CPU use and temperature of one task.

    ``started`` (a ``time.perf_counter()`` value) backdates the task's start, for a
    caller that began timing before it knew the message was a task.
    """

    enabled = True

    def __init__(self, started: float | None = None) -> None:
        self._process = psutil.Process()
        self._started = time.perf_counter() if started is None else started
        self._cpu_at_start = _cpu_seconds(self._process)
        self.phases: dict[str, float] = {}
        self.step_phases: dict[str, float] = {}
        self.steps: list[float] = []
        self.samples = 0
        self._kernel_peak = reset_peak_rss()
        self.peak_rss = self._process.memory_info().rss
        self.peak_uss: int | None = None
        self._uss_spent = 0.0
        self._uss_supported = True
        self._temperature = cpu_temperature()
        self._step_started = 0.0
        self._lap_started = 0.0

    # -- memory -----------------------------------------------------------------
    def _sample_memory(self) -> None:
        self.peak_rss = max(self.peak_rss, self._process.memory_info().rss)
        start = time.perf_counter()
        if not self._uss_supported or self._uss_spent + _uss_cost[0] > USS_BUDGET * (start - self._started):
            return
        try:
            uss = self._process.memory_full_info().uss
        except (psutil.Error, AttributeError, NotImplementedError):   # no USS on this platform
            self._uss_supported = False
            return
        _uss_cost[0] = time.perf_counter() - start
        self._uss_spent += _uss_cost[0]
        self.peak_uss = uss if self.peak_uss is None else max(self.peak_uss, uss)

    # -- phases -----------------------------------------------------------------
    def add(self, name: str, seconds: float) -> None:
        """Record a phase the caller timed itself (e.g. the wait before the task was taken up)."""
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)
            self.peak_rss = max(self.peak_rss, self._process.memory_info().rss)

    # -- training steps ---------------------------------------------------------
    def begin_step(self) -> None:
        self._step_started = self._lap_started = time.perf_counter()

    def lap(self, name: str) -> None:
        """Close the part of the current step since the last lap (or its start) as ``name``."""
        now = time.perf_counter()
        self.step_phases[name] = self.step_phases.get(name, 0.0) + now - self._lap_started
        self._lap_started = now

    def end_step(self, batch_size: int) -> None:
        self.step(time.perf_counter() - self._step_started, batch_size)

    def step(self, seconds: float, batch_size: int) -> None:
        """Record one optimizer step timed by the caller; memory is sampled every 16 steps."""
        self.steps.append(seconds)
        self.samples += batch_size
        if len(self.steps) % _RSS_EVERY_STEPS == 1:
            self._sample_memory()

    # -- result -----------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """The task's profile so far (fields: docs/profiling.md); absent readings are None."""
        self._sample_memory()
        if self._kernel_peak:
            self.peak_rss = max(self.peak_rss, peak_rss_since_reset() or 0)
        elapsed = time.perf_counter() - self._started
        cpu = _cpu_seconds(self._process) - self._cpu_at_start
        temperature = _hotter(self._temperature, cpu_temperature())
        train_seconds = sum(self.steps)
        return {
            "seconds": elapsed,
            "phases": {k: round(v, 6) for k, v in self.phases.items()},
            "train_phases": {k: round(v, 6) for k, v in self.step_phases.items()},
            "steps": len(self.steps),
            "samples": self.samples,
            "step_p50": percentile(self.steps, 50),
            "step_p95": percentile(self.steps, 95),
            "step_max": max(self.steps) if self.steps else None,
            "samples_per_second": self.samples / train_seconds if train_seconds > 0 else None,
            "peak_rss_bytes": self.peak_rss,
            "peak_uss_bytes": self.peak_uss,
            "cpu_percent": round(100.0 * cpu / elapsed, 1) if elapsed > 0 else None,
            "temperature_c": temperature[0] if temperature else None,
            "temperature_sensor": temperature[1] if temperature else None,
            "throttled": pi_throttling(),
            "memory_available_bytes": memory_available_bytes(),
            "memory_total_bytes": memory_total_bytes(),   # what the peak must fit in (a cgroup's limit counts)
            **battery(),
        }


def _hotter(a: tuple[float, str] | None, b: tuple[float, str] | None) -> tuple[float, str] | None:
    if a is None or b is None:
        return a or b
    return max(a, b)


class NullProfiler(Profiler):
    """A profiler that records nothing: the same calls, no clock reads, no psutil."""

    enabled = False

    def __init__(self, started: float | None = None) -> None:
        self.phases, self.step_phases, self.steps, self.samples = {}, {}, [], 0

    def add(self, name: str, seconds: float) -> None:
        pass

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return contextlib.nullcontext()

    def begin_step(self) -> None:
        pass

    def lap(self, name: str) -> None:
        pass

    def end_step(self, batch_size: int) -> None:
        pass

    def step(self, seconds: float, batch_size: int) -> None:
        pass

    def summary(self) -> dict[str, Any]:
        return {}
