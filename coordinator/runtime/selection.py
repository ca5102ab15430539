"""Which online clients a round may sample: all of them, or those expected to meet the deadline.

``clients.selection = "random"`` samples from every online client. ``"deadline"``
first leaves out clients whose recent round times predict they would miss the
round's deadline (``clients.round_timeout``): a client that will not make it only
costs the round its full timeout and brings nothing. With ``selection.availability`` it
also leaves out those whose presence history predicts they go offline before they would
finish (:mod:`coordinator.runtime.availability`), never fewer than the round needs.

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
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from coordinator.privacy_account import DEFAULT_SAMPLING
from coordinator.runtime.availability import likely_gone
from coordinator.runtime.device_book import DeviceBook
from coordinator.runtime.profile_selection import ProfilePolicy
from coordinator.runtime.round_times import SAFETY, RoundTimes

if TYPE_CHECKING:
    from coordinator.run_config import RunConfig

__all__ = ["DeadlineFilter", "Skipped", "Absences", "Draw", "Sampler", "PROBE_AFTER", "BUSY_HORIZON"]

log = logging.getLogger("fedge.coordinator")

PROBE_AFTER = 5      # consecutive skips after which a client is tried again
BUSY_HORIZON = 10    # deadlines after which an unanswered task no longer counts as being worked on


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

    A device whose results are refused answers at once, and a refused result costs no wait (the device
    is told why), but it still takes a place in the round that an honest device would fill. So a client
    whose results to ``rejected_limit`` tasks in a row were refused is benched for *rejected results*
    until it announces itself again (a restarted device may have been fixed); only an accepted result
    ends the streak, so a device that re-announces and sends another bad result is benched again at once.

    A device that refused a task because its installed app is not the run's (the result's ``refusal``) would refuse
    every further one alike: it is benched *for its app* until it comes online again after going offline, as it does
    when it restarts, which it must to load a reinstalled app. Its presence repeated while it stays online (a
    reconnect, or the retained presence delivered again when the coordinator subscribes again) does not end that.
    """

    def __init__(self, limit: int, rejected_limit: int = 0) -> None:
        self.limit = limit                      # 0: never bench
        self.rejected_limit = rejected_limit    # 0: never bench for rejected results
        self._misses: dict[str, int] = {}
        self.just_missed: set[str] = set()      # clients without an answer in the attempt that just ended
        self.withdrawn: set[str] = set()        # clients that said they refuse every further task of the run
        self._refused: dict[str, list[str]] = {}   # client -> tasks in a row whose results were refused
        self.refusing: set[str] = set()         # benched for rejected results until they announce themselves
        self.wrong_app: dict[str, str] = {}     # benched for their app until they announce themselves -> its refusal

    def missed(self, client_ids: Iterable[str]) -> list[str]:
        """An attempt ended with these clients' tasks unanswered; returns those benched just now."""
        self.just_missed = set(client_ids)
        benched = []
        for client_id in sorted(self.just_missed):
            self._misses[client_id] = self._misses.get(client_id, 0) + 1
            if self.limit and self._misses[client_id] == self.limit:
                benched.append(client_id)
        return benched

    def returned(self, client_id: str, announced: bool = False) -> bool:
        """The client answered or (``announced``) announced itself: it may be selected again (unless it
        withdrew, or answered while benched for rejected results); True if that ended a bench."""
        was_benched = bool(self.limit) and self._misses.get(client_id, 0) >= self.limit
        self._misses.pop(client_id, None)
        self.just_missed.discard(client_id)
        if announced and client_id in self.refusing:
            self.refusing.discard(client_id)
            was_benched = True
        return was_benched

    def refused(self, client_id: str, task_id: str) -> bool:
        """The client's result to ``task_id`` was refused (copies of it count once); True when that benches it."""
        streak = self._refused.setdefault(client_id, [])
        if task_id not in streak:
            streak.append(task_id)
        if not self.rejected_limit or len(streak) < self.rejected_limit or client_id in self.refusing:
            return False
        del streak[:-self.rejected_limit]   # the streak's length is all that matters from here
        self.refusing.add(client_id)
        return True

    def accepted(self, client_id: str) -> None:
        """A result of the client was accepted: its streak of rejected results is over."""
        self._refused.pop(client_id, None)

    def refused_for_app(self, client_id: str, why: str) -> bool:
        """The client refused a task because its installed app differs from the run's (``why``: its line naming
        both): not drawn again until it announces itself again; True when it was not benched for that already."""
        first = client_id not in self.wrong_app
        self.wrong_app[client_id] = why
        return first

    def came_online(self, client_id: str) -> bool:
        """The client came online after being offline (or unknown): restarted, perhaps with the run's app, so it may
        be drawn again; True when that ended a bench for its app."""
        return self.wrong_app.pop(client_id, None) is not None

    def withdraw(self, client_id: str) -> bool:
        """The client refuses every further task of the run (its own privacy budget): never drawn again in
        this run, whatever it answers or announces; True the first time."""
        first = client_id not in self.withdrawn
        self.withdrawn.add(client_id)
        return first

    def benched(self, client_id: str) -> bool:
        return (client_id in self.withdrawn or client_id in self.refusing or client_id in self.wrong_app
                or (bool(self.limit) and self._misses.get(client_id, 0) >= self.limit))

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
    """Draws an attempt's clients: ``clients.per_round`` (times ``clients.over_select``) of those selection may
    draw from, at random but seeded by the run's seed, the round and the attempt, so a run draws the same clients
    again (under central DP from the OS's entropy unless ``privacy.sampling = "seeded"``); with
    ``clients.selection = "profile"`` by the devices' own profiles (``book``, profile_selection.py)."""

    def __init__(self, config: RunConfig, absences: Absences, times: RoundTimes, book: DeviceBook | None = None) -> None:
        self.config = config
        self.absences = absences
        self._deadline_filter = DeadlineFilter(times)
        self.book = book if book is not None else DeviceBook()
        self.times = times
        self.clock: Callable[[], float] = time.time   # wall clock: the presence history's
        self.profile = ProfilePolicy(config, self.book, times, clock=lambda: self.clock())
        # Central DP's "poisson" and "fixed" draws: who is drawn must be unknown to whoever reads the released
        # models (the account claims amplification by sampling), and the run's seed is in every task, so these
        # draws come from the OS's entropy; "seeded" keeps the reproducible draw and claims no amplification.
        sampling = (config.privacy.sampling or DEFAULT_SAMPLING) if config.privacy.mode == "central" else "seeded"
        self.poisson = config.selected_per_round / config.clients.expected if sampling == "poisson" else None
        self.secret = sampling == "fixed"
        self.entropy: random.Random = random.SystemRandom()

    def draw(self, online: Iterable[str], round: int, attempt: int, taken: Collection[str] = ()) -> Draw:
        """``taken``: clients the attempt already counts on (a result of an earlier attempt of the round, or
        still working on its task): not drawn, and the draw is that much smaller, so a retry gives no more
        work than the first attempt did."""
        c = self.config
        need = max(0, c.required_results - len(taken))
        pool = self.absences.pool([k for k in online if k not in taken], need, retry=attempt > 0)
        skipped: list[str] = []
        size = max(0, c.drawn_per_round - len(taken))   # clients.over_select: more than the round counts
        if self.poisson is not None:   # each device on its own, with probability q: a round of any size
            return Draw(sorted(k for k in sorted(pool) if self.entropy.random() < self.poisson), [])
        if c.clients.selection == "profile":
            return Draw(*self.profile.draw(pool, round, attempt, size, need))
        if c.clients.selection == "deadline":
            pool, skipped = self._skip_predicted_late(pool, round, need)
            pool, skipped = self._skip_likely_gone(pool, round, need, skipped)
        rng = self.entropy if self.secret else random.Random(f"{c.run.seed}/{round}/{attempt}")
        return Draw(sorted(rng.sample(pool, min(size, len(pool)))), skipped)

    def _skip_likely_gone(self, pool: list[str], round: int, need: int,
                          skipped: list[str]) -> tuple[list[str], list[str]]:
        """``selection.availability``: leave out the devices expected to go offline before their task is done."""
        s = self.config.selection
        if not s.availability:
            return pool, skipped
        keep, gone = likely_gone(pool, need, self.book.presence, self.times.predict, self.clock(), s.min_sessions)
        if gone:
            log.info("round %d: deadline selection skipped %s", round,
                     ", ".join(f"{c} ({why})" for c, why in sorted(gone.items())))
        return keep, skipped + sorted(gone)

    def _skip_predicted_late(self, pool: list[str], round: int, need: int) -> tuple[list[str], list[str]]:
        timeout = self.config.clients.round_timeout
        keep, skipped = self._deadline_filter(pool, timeout, need, time.monotonic())
        if skipped:
            log.info("round %d: deadline selection skipped %s (round_timeout %.1f s)", round,
                     ", ".join(f"{s.client_id} (predicted {s.predicted_seconds:.1f} s)" for s in skipped), timeout)
        return keep, [s.client_id for s in skipped]
