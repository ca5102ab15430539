"""Which online clients a round may sample: all of them, or those expected to meet the deadline.

``clients.selection = "random"`` samples from every online client. ``"deadline"``
first leaves out clients whose recent round times predict they would miss the
round's deadline (``clients.round_timeout``): a client that will not make it only
costs the round its full timeout and brings nothing.

A client's round time is what the deadline is measured against: from the
coordinator publishing its task to the coordinator receiving its result, transfer
and queueing on the device included (the device's own profile ``seconds`` leaves
both out). A task that got no answer by the end of its attempt counts as taking the
whole timeout until its result turns up late with the real time. The prediction is
the median of the client's last three round times, for the slowest kind of task
(objective) it runs; a client is skipped when that prediction times
:data:`SAFETY` exceeds the deadline.

Two rules keep skipping from hurting the run: never skip so many that fewer than
the results a round needs remain (the fastest skipped clients are put back, those
not busy with an earlier task first), and
give a client another chance after :data:`PROBE_AFTER` selections in a row that
skipped it, so a device that was only slow for a while (throttled, busy) is not
left out for good. A client still working on an earlier task is not given that
chance until it answers (or :data:`BUSY_HORIZON` deadlines have passed): a new task
would only queue behind the old one.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from coordinator.runtime.device_book import DeviceBook
from coordinator.runtime.profile_selection import ProfilePolicy

if TYPE_CHECKING:   # the config imports SELECTIONS from here
    from coordinator.config import RunConfig

__all__ = ["RoundTimes", "DeadlineFilter", "Skipped", "Absences", "Draw", "Sampler", "SELECTIONS", "SAFETY", "WINDOW",
           "PROBE_AFTER", "BUSY_HORIZON", "STRETCH"]

log = logging.getLogger("fedge.coordinator")

SELECTIONS = ("random", "deadline", "profile")
SAFETY = 1.25        # skip when predicted * SAFETY > deadline: leaves room for jitter
WINDOW = 3           # round times the prediction looks at
PROBE_AFTER = 5      # consecutive skips after which a client is tried again
BUSY_HORIZON = 10    # deadlines after which an unanswered task no longer counts as being worked on
STRETCH = 2.0        # an attempt waits at most this many round timeouts for clients known to be slower
_KEEP = 8            # round times kept per client and objective (a late answer may update an older one)
_MAX_PENDING = 10_000


class RoundTimes:
    """Recent round times of each client, per objective, as the coordinator measured them."""

    def __init__(self) -> None:
        self._pending: OrderedDict[str, tuple[str, str, float]] = OrderedDict()   # task -> client, objective, sent
        self._times: dict[tuple[str, str], OrderedDict[str, float]] = {}           # (client, objective) -> task -> s
        self._answered: dict[tuple[str, str], OrderedDict[str, float]] = {}        # the same, real answers only

    def sent(self, task_id: str, client_id: str, objective: str, at: float) -> None:
        """A task was published at monotonic time ``at``."""
        self._pending[task_id] = (client_id, objective, at)
        while len(self._pending) > _MAX_PENDING:
            self._pending.popitem(last=False)

    def answered(self, task_id: str, client_id: str, at: float) -> tuple[float, str] | None:
        """The first answer to a task arrived at ``at``: its round time and objective (None if not ours)."""
        entry = self._pending.get(task_id)
        if entry is None or entry[0] != client_id:
            return None
        del self._pending[task_id]
        seconds = at - entry[2]
        self._record(entry[0], entry[1], task_id, seconds)
        self._record(entry[0], entry[1], task_id, seconds, self._answered)
        return seconds, entry[1]

    def missed(self, task_ids: Iterable[str], timeout: float) -> list[tuple[str, str, str]]:
        """Tasks of an attempt that ended: unanswered ones count as ``timeout`` for now.

        Returns (task id, client id, objective) of each; a late answer replaces the timeout with the real time.
        """
        unanswered = []
        for task_id in task_ids:
            entry = self._pending.get(task_id)
            if entry is not None:
                self._record(entry[0], entry[1], task_id, timeout)
                unanswered.append((task_id, entry[0], entry[1]))
        return unanswered

    def busy(self, client_id: str, now: float, horizon: float) -> bool:
        """Whether the client owes an answer to a task sent less than ``horizon`` seconds before ``now``."""
        return any(c == client_id and now - sent < horizon for c, _, sent in self._pending.values())

    def working(self, task_id: str, client_id: str, now: float, timeout: float) -> bool:
        """Whether the client is presumably still working on an unanswered task: it has answered a task of
        this kind before, and less than :data:`SAFETY` times its usual round time (or the timeout, if
        longer) has passed since the task went out. A client never heard from is not presumed working:
        it may be gone, and waiting for it would cost the attempt its whole timeout."""
        entry = self._pending.get(task_id)
        if entry is None or entry[0] != client_id:
            return False
        usual = self.usual(client_id, entry[1])
        return usual is not None and now - entry[2] < SAFETY * max(usual, timeout)

    def deadline(self, clients: Iterable[tuple[str, str]], timeout: float) -> float:
        """How long an attempt waits for ``clients`` ((client, objective) pairs): ``timeout``, or longer when
        one of them usually needs more (:data:`SAFETY` times its usual round time), but at most
        :data:`STRETCH` timeouts. Cutting a known slow device off at the timeout only wastes its work
        and the attempt's; the cap keeps one very slow device from holding every round."""
        usual = [u for client, objective in clients if (u := self.usual(client, objective)) is not None]
        return min(max([timeout, *(SAFETY * u for u in usual)]), STRETCH * timeout)

    def usual(self, client_id: str, objective: str) -> float | None:
        """Median of the client's last :data:`WINDOW` real round times for ``objective`` (misses left out)."""
        times = self._answered.get((client_id, objective))
        return statistics.median(list(times.values())[-WINDOW:]) if times else None

    def _record(self, client_id: str, objective: str, task_id: str, seconds: float,
                into: dict[tuple[str, str], OrderedDict[str, float]] | None = None) -> None:
        times = (self._times if into is None else into).setdefault((client_id, objective), OrderedDict())
        times[task_id] = seconds
        while len(times) > _KEEP:
            times.popitem(last=False)

    def predict(self, client_id: str) -> float | None:
        """Median of the last :data:`WINDOW` round times of the client's slowest objective; None if unknown."""
        medians = [statistics.median(list(times.values())[-WINDOW:])
                   for (client, _), times in self._times.items() if client == client_id and times]
        return max(medians) if medians else None


@dataclass(frozen=True)
class Skipped:
    client_id: str
    predicted_seconds: float


@dataclass
class DeadlineFilter:
    """Leaves out clients predicted to miss the deadline; remembers how often each was left out."""

    times: RoundTimes
    streak: dict[str, int] = field(default_factory=dict)

    def __call__(self, pool: list[str], deadline: float, need: int, now: float) -> tuple[list[str], list[Skipped]]:
        """``pool`` minus the clients to skip, and the skipped ones (slowest first); ``now``: monotonic time."""
        predicted = {c: self.times.predict(c) for c in pool}
        slow = {c: p for c, p in predicted.items() if p is not None and p * SAFETY > deadline
                and (self.streak.get(c, 0) < PROBE_AFTER or self.times.busy(c, now, BUSY_HORIZON * deadline))}
        keep = [c for c in pool if c not in slow]
        horizon = BUSY_HORIZON * deadline   # put back the fastest of the slow, free ones before busy ones
        for c in sorted(slow, key=lambda c: (self.times.busy(c, now, horizon), slow[c]))[:max(0, need - len(keep))]:
            keep.append(c)
            del slow[c]
        for c in pool:
            self.streak[c] = self.streak.get(c, 0) + 1 if c in slow else 0
        skipped = [Skipped(c, slow[c]) for c in sorted(slow, key=lambda c: -slow[c])]
        return sorted(keep), skipped


class Absences:
    """Tasks each client left unanswered in a row, and which clients selection should pass over.

    A device whose retained presence says ``online`` may be gone: one that disconnected cleanly leaves
    no will behind, and an authorised device can announce itself and vanish on purpose. Each task it
    is given costs an attempt its whole timeout, and enough of them end the run. So a client that
    missed ``limit`` tasks in a row is benched until it answers something (a late result is enough)
    or announces itself again (a real reconnect), and a retry prefers clients that did not just miss.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit                      # 0: never bench
        self._misses: dict[str, int] = {}
        self.just_missed: set[str] = set()      # clients without an answer in the attempt that just ended

    def missed(self, client_ids: Iterable[str]) -> list[str]:
        """An attempt ended with these clients' tasks unanswered; returns those benched just now."""
        self.just_missed = set(client_ids)
        benched = []
        for client_id in sorted(self.just_missed):
            self._misses[client_id] = self._misses.get(client_id, 0) + 1
            if self.limit and self._misses[client_id] == self.limit:
                benched.append(client_id)
        return benched

    def returned(self, client_id: str) -> bool:
        """The client answered or announced itself: it may be selected again; True if it was benched."""
        was_benched = self.benched(client_id)
        self._misses.pop(client_id, None)
        self.just_missed.discard(client_id)
        return was_benched

    def benched(self, client_id: str) -> bool:
        return bool(self.limit) and self._misses.get(client_id, 0) >= self.limit

    def pool(self, online: Iterable[str], needed: int, retry: bool) -> list[str]:
        """The clients a selection draws from: the online ones not benched, and on a retry also not those
        that just missed, unless that would leave fewer than ``needed``."""
        pool = [c for c in sorted(online) if not self.benched(c)]
        if retry:
            fresh = [c for c in pool if c not in self.just_missed]
            if len(fresh) >= needed:
                return fresh
        return pool


@dataclass(frozen=True)
class Draw:
    """The clients an attempt gives tasks to, and those deadline selection left out."""

    clients: list[str]
    skipped: list[str] = field(default_factory=list)


class Sampler:
    """Draws an attempt's clients: ``clients.per_round`` of those selection may draw from, at random but
    seeded by the run's seed, the round and the attempt, so a run draws the same clients again; with
    ``clients.selection = "profile"`` by the devices' own profiles (``book``, profile_selection.py)."""

    def __init__(self, config: RunConfig, absences: Absences, times: RoundTimes, book: DeviceBook | None = None) -> None:
        self.config = config
        self.absences = absences
        self._deadline_filter = DeadlineFilter(times)
        self.book = book if book is not None else DeviceBook()
        self.profile = ProfilePolicy(config, self.book, times)

    def draw(self, online: Iterable[str], round: int, attempt: int, taken: Collection[str] = ()) -> Draw:
        """``taken``: clients the attempt already counts on (a result of an earlier attempt of the round, or
        still working on its task): not drawn, and the draw is that much smaller, so a retry gives no more
        work than the first attempt did."""
        c = self.config
        need = max(0, c.required_results - len(taken))
        pool = self.absences.pool([k for k in online if k not in taken], need, retry=attempt > 0)
        skipped: list[str] = []
        size = max(0, c.selected_per_round - len(taken))
        if c.clients.selection == "profile":
            return Draw(*self.profile.draw(pool, round, attempt, size, need))
        if c.clients.selection == "deadline":
            pool, skipped = self._skip_predicted_late(pool, round, need)
        rng = random.Random(f"{c.run.seed}/{round}/{attempt}")
        return Draw(sorted(rng.sample(pool, min(size, len(pool)))), skipped)

    def _skip_predicted_late(self, pool: list[str], round: int, need: int) -> tuple[list[str], list[str]]:
        timeout = self.config.clients.round_timeout
        keep, skipped = self._deadline_filter(pool, timeout, need, time.monotonic())
        if skipped:
            log.info("round %d: deadline selection skipped %s (round_timeout %.1f s)", round,
                     ", ".join(f"{s.client_id} (predicted {s.predicted_seconds:.1f} s)" for s in skipped), timeout)
        return keep, [s.client_id for s in skipped]
