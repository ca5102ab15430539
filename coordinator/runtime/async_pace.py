"""Slow devices in asynchronous mode: how many versions behind a device's next result is expected to
arrive, and what ``async.slow`` does about a device whose result would be dropped (docs/async.md,
"Slow devices").

A result is dropped when it comes more than ``async.max_staleness`` versions behind. A device that
always takes longer than that trains for nothing: every task it is given is wasted work, and its
data never reaches the model. While a device trains, the others make versions, so its next result
is expected ``rate x seconds`` versions behind:

- ``seconds``: how long its task takes as the coordinator measured it (from sending the task to taking
  its result), kept per local step (the time over the steps the task asked for) as the median of its
  last :data:`STEP_WINDOW` tasks, so a task capped at fewer steps is predicted as well. Time is taken
  as proportional to steps: a fixed cost per task (decoding, transfer) shows up after a shortened task
  as slower steps, and the next cap is smaller.
- ``rate``: versions made per second over the last :data:`RATE_WINDOW` versions, the time since the
  last one included, so the rate of a run that stalls falls and a rested device comes back.

Nothing is predicted for a device before its first result, nor before the first version: it gets
its task as it is. With ``async.max_staleness = 0`` (no limit) or ``async.slow = "send"`` nothing
changes: every device gets its task as it is. Otherwise, for a device predicted beyond the limit:

- ``shorten``: its task carries ``max_steps``, a cap on its local steps sized so its result is expected
  at :data:`MARGIN` x ``max_staleness`` versions; if not even one step would arrive in time it rests.
- ``rest``: no task while so predicted; after :data:`PROBE_EVERY` x ``max_staleness`` versions of rest it
  gets one task (a probe: the full task under ``rest``, one step under ``shorten``), which measures it
  anew, and rests as long again after the probe's answer if it is still predicted too stale.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Pace", "PaceBook", "VersionClock", "task_steps", "RATE_WINDOW", "STEP_WINDOW", "MARGIN", "PROBE_EVERY"]

RATE_WINDOW = 8    # versions the version rate looks back over
STEP_WINDOW = 3    # a device's recent tasks whose median seconds per step it is predicted from
MARGIN = 0.8       # a shortened task is sized to arrive this share of max_staleness behind: room for jitter
PROBE_EVERY = 4    # a rested device gets a probe task after resting this many times max_staleness versions


def task_steps(hyper: Mapping[str, Any], num_samples: int) -> int:
    """The local steps a training task asks for: epochs over the device's samples in mini-batches, at most
    its ``max_steps`` (0 or absent: no cap), as :func:`edge_client.objectives.train` runs them."""
    batch, epochs, cap = int(hyper.get("batch_size", 32)), int(hyper.get("epochs", 1)), int(hyper.get("max_steps", 0))
    full = epochs * math.ceil(max(num_samples, 1) / max(batch, 1))
    return min(full, cap) if cap > 0 else full


class VersionClock:
    """When the last versions were made: the rate of versions per second."""

    def __init__(self, start: float, window: int = RATE_WINDOW) -> None:
        self._times: deque[float] = deque([start], maxlen=window + 1)   # monotonic; the first is the start

    def made(self, at: float) -> None:
        self._times.append(at)

    def rate(self, now: float) -> float | None:
        """Versions per second over the window up to ``now`` (None before the first version)."""
        made, since = len(self._times) - 1, now - self._times[0]
        return made / since if made > 0 and since > 0 else None


@dataclass(frozen=True)
class Pace:
    """What a device's next task is to be: ``send`` it as it is, ``shorten`` it to ``max_steps`` local steps, or
    ``rest`` (no task now). ``predicted``: versions behind its result is expected for the task as it would go (None:
    not known yet); ``probe``: a task to a rested device, to measure it anew."""

    action: str
    predicted: float | None = None
    max_steps: int = 0
    probe: bool = False


@dataclass
class _Device:
    step_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    full_steps: int = 0
    resting: bool = False           # since it was rested (said once in the log), probes included
    rest_from: int | None = None    # the version its current stretch of rest began (None: working, or on a probe)
    shortened: bool = False         # its tasks are being shortened (said once in the log)


class PaceBook:
    """Each device's measured seconds per local step, and ``async.slow``'s decision for its next task."""

    def __init__(self, policy: str, max_staleness: int, clock: VersionClock) -> None:
        self.policy, self.limit, self.clock = policy, max_staleness, clock
        self._devices: dict[str, _Device] = {}

    @property
    def active(self) -> bool:
        """Whether the policy can change a task: a staleness limit, and a policy other than ``send``."""
        return self.policy != "send" and self.limit > 0

    def answered(self, client_id: str, hyper: Mapping[str, Any], num_samples: int, seconds: float) -> None:
        """A result to a task with ``hyper`` came ``seconds`` after the task went out."""
        rec = self._devices.setdefault(client_id, _Device())
        rec.full_steps = task_steps({k: v for k, v in hyper.items() if k != "max_steps"}, num_samples)
        rec.step_seconds.append(seconds / task_steps(hyper, num_samples))

    def expected(self, client_id: str, now: float, steps: int | None = None) -> float | None:
        """Versions behind a result of ``steps`` local steps (None: the full task) is expected to arrive."""
        rec, rate = self._devices.get(client_id), self.clock.rate(now)
        if rec is None or not rec.step_seconds or rate is None:
            return None
        return rate * statistics.median(rec.step_seconds) * (rec.full_steps if steps is None else steps)

    def pace(self, client_id: str, version: int, now: float) -> Pace:
        """The policy's decision for the device's next task, at ``version`` (changes nothing: see :meth:`given`)."""
        predicted = self.expected(client_id, now)
        if not self.active or predicted is None or predicted <= self.limit:
            return Pace("send", predicted)
        rec = self._devices[client_id]
        short = self._fitting_steps(client_id, now) if self.policy == "shorten" else 0
        if short:
            return Pace("shorten", self.expected(client_id, now, short), short)
        probe = Pace("shorten", self.expected(client_id, now, 1), 1, True) if self.policy == "shorten" else \
            Pace("send", predicted, probe=True)
        if rec.rest_from is not None and version - rec.rest_from >= PROBE_EVERY * self.limit:
            return probe
        return Pace("rest", predicted)

    def _fitting_steps(self, client_id: str, now: float) -> int:
        """The most local steps whose result is expected within MARGIN x max_staleness versions (0: not one),
        fewer than the full task's."""
        per_step = self.expected(client_id, now, 1) or 0.0
        steps = math.floor(MARGIN * self.limit / per_step) if per_step > 0 else 0
        return min(steps, self._devices[client_id].full_steps - 1)

    def given(self, client_id: str, pace: Pace, version: int, now: float) -> str:
        """A task went to the device as ``pace`` says; what to say of it in the log ('' when nothing new)."""
        rec = self._devices.get(client_id)
        if rec is None:
            return ""
        rec.rest_from = None   # a probe's stretch of rest starts anew after its answer
        if pace.probe:
            return ""
        said = ""
        if rec.resting:
            rec.resting = False
            said = (f"{client_id} is given tasks again: its next result is expected {pace.predicted or 0.0:.1f} "
                    f"versions behind (async.max_staleness {self.limit})")
        if pace.action == "shorten" and not rec.shortened:
            said = (f"shortening {client_id}'s tasks to at most {pace.max_steps} of its {rec.full_steps} local steps: "
                    f"a full task's result is expected {self.expected(client_id, now) or 0.0:.1f} versions behind, "
                    f"beyond async.max_staleness {self.limit} (async.slow = 'shorten')")
        rec.shortened = pace.action == "shorten"
        return said

    def rested(self, client_id: str, pace: Pace, version: int) -> str:
        """The device gets no task now; what to say of it in the log the first time it rests ('' after)."""
        rec = self._devices[client_id]
        if rec.rest_from is None:
            rec.rest_from = version
        if rec.resting:
            return ""
        rec.resting, rec.shortened = True, False
        return (f"resting {client_id}: its next result is expected {pace.predicted or 0.0:.1f} versions behind, beyond "
                f"async.max_staleness {self.limit}, where it would be dropped; a probe task after "
                f"every {PROBE_EVERY * self.limit} versions of rest (async.slow = {self.policy!r})")

    def resting(self) -> list[str]:
        """The devices resting now (or on a probe task)."""
        return sorted(c for c, rec in self._devices.items() if rec.resting)
