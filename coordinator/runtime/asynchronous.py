"""Asynchronous buffered aggregation (``run.mode = "async"``, FedBuff; docs/async.md).

Rounds wait for their slowest device; here nobody waits. Up to ``async.concurrency`` devices
train at once, each from the model version that was current when it got its task; every result
is folded into a buffer discounted by its staleness (:mod:`async_buffer`), and every
``async.buffer_size`` results, never more, the strategy's ``server_step`` makes the next version
from them. A version is what a round is elsewhere: ``run.rounds`` counts them, ``eval.every`` applies to
them, each has one row in ``metrics.jsonl`` and one checkpoint.

The driver reuses the round engine's parts as they are: the sampler draws idle devices (those in
flight are ``taken``), the task sender sends, the intake sorts, checks and acknowledges every
result into one long-lived book, the roster and absences bench devices that miss their tasks.
Tasks of version ``v`` travel as round ``v + 1`` (what they train towards) and carry their own
tensors: a retained model broadcast lasts one version, while a task may start after the next.
The run status keeps the round it announced at the start, so devices never take a task or a
result of an older version for a stale round. A device whose results are predicted to come too stale
to count gets shorter tasks or none (``async.slow``, :mod:`async_pace`), and every version's row
says what each device contributed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from coordinator.ops.spawn import sim_client_id
from coordinator.runtime.async_buffer import AsyncBuffer, Batch, result_terms
from coordinator.runtime.async_journal import AsyncJournal
from coordinator.runtime.async_pace import Pace, PaceBook, VersionClock
from coordinator.runtime.bookkeeping import snapshot
from coordinator.runtime.guards import check_finite
from coordinator.runtime.round_book import RoundBook, RoundNotes, Tally
from coordinator.runtime.run_error import RunError
from coordinator.runtime.selection import Sampler
from coordinator.runtime.tasks import new_task_ids
from coordinator.strategies.base import AggregationError, ClientResult, TaskPlan
from coordinator.strategies.fedavg import FedAvg
from storage.state import ServerState

if TYPE_CHECKING:
    from coordinator.runtime.engine import Coordinator

__all__ = ["AsyncRun", "Flight"]

log = logging.getLogger("fedge.coordinator")

Pump = Callable[..., None]                                   # Coordinator.pump(until, done, progress)
Complete = Callable[[dict[str, Any], ServerState], None]    # a version's row and the state to checkpoint
POLL = 0.25   # seconds between looks at idle devices and expired tasks while no result comes


@dataclass(frozen=True)
class Flight:
    """A task out on a device: who trains it, from which model version, and until when it is waited for."""

    task_id: str
    client_id: str
    version: int
    plan: TaskPlan
    sent: float       # monotonic
    deadline: float   # monotonic; after it the task is missed and the device free for another


class AsyncRun:
    """Model versions of one coordinator session in ``run.mode = "async"``."""

    def __init__(self, coordinator: Coordinator, pump: Pump) -> None:
        c = coordinator.config
        if not isinstance(coordinator.strategy, FedAvg) or coordinator.strategy.capabilities.sync_only:
            raise RunError(f"run.mode = 'async' needs a strategy with a server step over one update; "
                           f"{coordinator.strategy.name!r} has none: use run.mode = 'sync'")
        self.co, self.pump, self.strategy = coordinator, pump, coordinator.strategy
        self.settings = c.asynchronous
        self.concurrency, self.buffer_size = self.settings.sizes(c.selected_per_round)
        # The engine's sampler draws a round's clients; here as many as free slots, among those not in flight.
        clients = dataclasses.replace(c.clients, per_round=self.concurrency, min_results=0)
        self.sampler = Sampler(dataclasses.replace(c, clients=clients), coordinator.absences,
                               coordinator.round_times, coordinator.device_book)
        s = self.settings
        mark = AsyncBuffer.journal_mark(coordinator.state)
        self.buffer, coordinator.state, before = AsyncBuffer.taken_from(coordinator.state, self.buffer_size,
                                                                        s.weighting, s.staleness_exponent)
        self.journal = AsyncJournal(coordinator.out, mark)
        self.flights: dict[str, Flight] = {}
        self.book = RoundBook(round=coordinator.state.round + 1, attempt=0)   # every task and result of the run
        self._earlier = RoundBook(round=coordinator.state.round + 1, attempt=0)   # tasks a stopped coordinator gave
        self.given = self.dropped = self._draws = 0   # this version's tasks, stale drops and sampler draws
        self._started = time.monotonic()
        self._idle_since: float | None = None
        self.pace = PaceBook(s.slow, s.max_staleness, VersionClock(self._started))
        self.contributions: dict[str, dict[str, float]] = {}   # this version's, per device (the row's column)
        self._making: tuple[ServerState, Batch] | None = None   # the state and batch a new version came from
        self._resume(mark, before)
        # Before any message is handled (a resumed coordinator's session may hold results queued while it was
        # down): results go to the run's book, those to the earlier tasks too, each journaled before its ack.
        coordinator.intake.open(self.book)
        coordinator.intake.attempts.earlier = [self._earlier]
        coordinator.intake.keep = self._keep

    # -- the loop -----------------------------------------------------------------
    def run(self, last: int, complete: Complete) -> None:
        """Make versions until ``last``; ``complete(row, state)`` writes each row and its checkpoint. A run
        that stops before (Ctrl-C, SIGTERM, an error) checkpoints the results it buffered meanwhile."""
        co = self.co
        co.on_progress({"kind": "round", "round": co.state.round + 1, "phase": "start"})
        try:
            while co.state.round < last:
                self._step()
                while self.buffer.due() and co.state.round < last:
                    row, state = self._make_version()
                    complete(row, state)
                    self._making = None
                    self.journal.forget(AsyncBuffer.journal_mark(state), state.round)
        except BaseException:
            self._save_buffer()
            raise
        finally:
            co.intake.open(RoundBook(round=co.state.round + 1, attempt=-1))
            co.intake.keep = None

    def _resume(self, mark: int, in_flight: dict[str, Any]) -> None:
        """Where a stopped coordinator left off. The results its journal kept after the checkpoint's ``mark``
        go to the buffer, in the order they were taken, as they went to its buffer; the tasks it had in
        flight (the checkpoint's, and those it gave since) that none of them answers are awaited: their
        results are applied when they come (within ``async.max_staleness``), as this coordinator's are."""
        co = self.co
        given = {**in_flight, **self.journal.tasks_since(co.state.round)}
        restored = self.journal.results_after(mark)
        for entry in restored:
            given.pop(entry.task_id, None)
            self._take(entry.task_id, entry.result.client_id, entry.version, entry.result)
        if restored:
            log.warning("restored %d result(s) taken after version %d's checkpoint from %s (tasks %s)",
                        len(restored), co.state.round, self.journal.dir, ", ".join(e.task_id for e in restored))
        # A device trains one task at a time: the last one it was given. Spawned clients are new processes (or
        # threads): what the stopped coordinator gave their predecessors died with them.
        spawned = {sim_client_id(i) for i in range(co.config.clients.spawn)}
        latest = {entry[0]: (task_id, entry) for task_id, entry in given.items() if _in_flight_entry(entry)}
        now, wall = time.monotonic(), time.time()
        awaited = []
        for client_id, (task_id, (_, version, *times)) in sorted(latest.items()):
            plan = self.strategy.configure("train", co.state.round + 1, co.state, [client_id])[0]
            # Until the deadline the stopped coordinator set, timed from when it sent the task (Unix times); a
            # checkpoint written before they were kept: a deadline anew, from now.
            if times:
                until, sent = times
            else:
                until, sent = wall + co.round_times.deadline([(client_id, plan.objective)],
                                                             co.config.clients.round_timeout), wall
            if client_id in spawned or until <= wall:
                continue   # a result that comes all the same counts as late
            self.flights[task_id] = Flight(task_id, client_id, version, plan, now + sent - wall, now + until - wall)
            self._earlier.plans[task_id] = plan
            co.round_times.sent(task_id, client_id, plan.objective, now + sent - wall)   # for its profile record
            awaited.append(task_id)
        if awaited:
            log.info("awaiting %d task(s) a stopped coordinator gave, up to the deadlines it set: their results are "
                     "applied when they come (async.max_staleness %d)", len(awaited), self.settings.max_staleness)

    def _keep(self, task_id: str, result: ClientResult) -> None:
        """A result the intake takes, in the journal before its device is acknowledged: a coordinator killed
        before the next checkpoint leaves it to the one that resumes."""
        flight = self.flights.get(task_id)
        if flight is not None:   # else not a task in flight: the harvest drops it, and so would a resumed run
            self.journal.taken(task_id, flight.version, result)

    def _step(self) -> None:
        """Give idle devices tasks, then take what comes for a moment; free the devices whose tasks expired."""
        self._fill()
        book = self.book
        self.pump(time.monotonic() + POLL, lambda: bool(book.results or book.failed), self._progress)
        self._harvest()
        now = time.monotonic()
        self._expire(now)
        self._check_starved(now)

    def _progress(self) -> dict[str, Any]:
        """The version in progress as the live report shows an exchange: results buffered of those needed."""
        tally = self.book.tally
        return {"kind": "exchange", "round": self.co.state.round + 1, "phase": "train", "attempt": 1,
                "results": min(self.buffer.count, self.buffer_size), "selected": self.buffer_size,
                "bytes_down": tally.bytes_down, "bytes_up": tally.bytes_up, "started": self._started,
                "timeout": self.co.config.clients.round_timeout}

    # -- tasks ----------------------------------------------------------------------
    def _fill(self) -> None:
        """Tasks on the current version to idle devices, drawn by the engine's sampler, up to the concurrency."""
        co = self.co
        busy = {f.client_id for f in self.flights.values()}
        if len(busy) >= self.concurrency or not set(co.roster.answering()) - busy:
            return
        version = co.state.round
        paces = self._paces(busy, version)
        online = [c for c in co.roster.online if c not in paces or paces[c].action != "rest"] if paces else \
            co.roster.online
        clients = self.sampler.draw(online, version + 1, self._draws, busy).clients
        self._draws += 1
        if not clients:
            return
        self.book.round = version + 1
        plans = [self._paced(plan, paces.get(plan.client_id)) for plan in
                 self.strategy.configure("train", version + 1, co.state, clients)]
        task_ids = new_task_ids(len(plans))
        timeout = co.config.clients.round_timeout
        waits = [co.round_times.deadline([(plan.client_id, plan.objective)], timeout) for plan in plans]
        for task_id, plan, wait in zip(task_ids, plans, waits):   # known to a coordinator that resumes, if this dies
            self.journal.given(task_id, plan.client_id, version, time.time() + wait, time.time())
        now = time.monotonic()
        for task_id, plan, wait in zip(co.tasks.send_all(self.book, plans, broadcast=False, task_ids=task_ids),
                                       plans, waits):
            self.flights[task_id] = Flight(task_id, plan.client_id, version, plan, now, now + wait)
            if plan.client_id in paces and (said := self.pace.given(plan.client_id, paces[plan.client_id], version,
                                                                     now)):
                log.warning("%s", said)
        self.given += len(plans)

    def _paces(self, busy: set[str], version: int) -> dict[str, Pace]:
        """``async.slow``'s decision for each idle device online (none when it changes nothing); those it rests
        are said once in the log."""
        if not self.pace.active:
            return {}
        now = time.monotonic()
        paces = {c: self.pace.pace(c, version, now) for c in self.co.roster.online if c not in busy}
        for client_id, pace in sorted(paces.items()):
            if pace.action == "rest" and (said := self.pace.rested(client_id, pace, version)):
                log.warning("%s", said)
        return paces

    def _paced(self, plan: TaskPlan, pace: Pace | None) -> TaskPlan:
        """The plan as the policy has it go: at most ``pace.max_steps`` local steps when it shortens the task."""
        if pace is None or pace.action != "shorten":
            return plan
        self._count(plan.client_id, "shortened")
        return dataclasses.replace(plan, hyper={**plan.hyper, "max_steps": pace.max_steps})

    def _count(self, client_id: str, key: str, amount: float = 1) -> None:
        """Add to the device's contribution to the version being filled (the row's ``contributions``)."""
        counts = self.contributions.setdefault(client_id, {"counted": 0, "dropped": 0, "shortened": 0, "rested": 0,
                                                           "weight": 0.0})
        counts[key] += amount

    def _harvest(self, report: bool = True) -> None:
        """The intake's accepted results and failures: their devices are free; results go to the buffer (all
        of them before anyone watching hears of one: what the intake acknowledged must reach the buffer)."""
        book, events = self.book, []
        by_client = {f.client_id: f for f in self.flights.values()}
        for client_id in sorted(book.results.keys() | book.failed):
            result = book.results.pop(client_id, None)
            book.failed.discard(client_id)
            book.profiles.pop(client_id, None)
            flight = by_client.get(client_id)
            if flight is None:   # the intake takes only answers to tasks in flight
                continue
            self._land(flight)
            if result is not None:
                self.pace.answered(client_id, flight.plan.hyper, result.num_samples, time.monotonic() - flight.sent)
            if result is not None and (event := self._take(flight.task_id, client_id, flight.version,
                                                            result)) is not None:
                events.append(event)
        for event in events if report else ():
            self.co.on_progress(event)

    def _land(self, flight: Flight) -> None:
        """A task is over (answered or expired): its device is free, and a later answer to it is late."""
        del self.flights[flight.task_id]
        self.book.plans.pop(flight.task_id, None)
        self._earlier.plans.pop(flight.task_id, None)

    def _take(self, task_id: str, client_id: str, version: int, result: ClientResult) -> dict[str, Any] | None:
        """Fold a result trained from ``version`` into the buffer, or drop it as too stale (``async.max_staleness``,
        0: never); what the progress hears of it. Its staleness is counted against the version it will meet:
        past the full batches waiting ahead of it."""
        co, limit = self.co, self.settings.max_staleness
        staleness = self.buffer.staleness(version, co.state.round)
        if limit and staleness > limit:
            self.dropped += 1
            self._count(client_id, "dropped")
            log.info("dropped the result of %s: trained from version %d, %d versions behind (async.max_staleness "
                     "%d)", client_id, version, staleness, limit)
            return None
        try:
            self.buffer.add(result, staleness)
        except AggregationError as exc:
            co.intake.count("rejected", client_id, f"cannot aggregate this result: {exc}")
            return None
        self._count(client_id, "counted")
        self._count(client_id, "weight", result_terms(self.buffer.weighting, result.num_samples, staleness,
                                                      self.settings.staleness_exponent)[0])
        return {"kind": "buffered", "version": co.state.round, "client": client_id,
                "task_id": task_id, "staleness": staleness, "buffered": self.buffer.count}

    def _expire(self, now: float) -> None:
        """Tasks past their deadline are missed (recorded, counted towards benching, as in a round's close)."""
        for flight in [f for f in self.flights.values() if now > f.deadline]:
            self._land(flight)
            self.co.intake.close(RoundBook(round=flight.version + 1, attempt=0, plans={flight.task_id: flight.plan},
                                           wait=flight.deadline - flight.sent, opened=flight.sent))

    def _check_starved(self, now: float) -> None:
        """Nothing in flight for ``clients.presence_timeout``: no device takes tasks, and none will."""
        if self.flights:
            self._idle_since = None
            return
        self._idle_since = self._idle_since or now
        timeout = self.co.config.clients.presence_timeout
        if now - self._idle_since > timeout:
            raise RunError(f"no client took a task for {timeout:.0f} s (online: {sorted(self.co.roster.online)}, "
                           f"answering: {self.co.roster.answering()}); start clients or raise "
                           "clients.presence_timeout")

    # -- versions ---------------------------------------------------------------------
    def _make_version(self) -> tuple[dict[str, Any], ServerState]:
        """The strategy's server step on the first batch's update: the next version, its row, what to checkpoint."""
        co = self.co
        version = co.state.round + 1
        batch = self.buffer.take()
        self._making = (co.state, batch)   # until the version is checkpointed: a stop goes back to these
        state = self.strategy.server_step(version, co.state, batch.update(self.settings.server_lr))
        check_finite(state, version, "train", co.config.aggregate.rule)
        now = time.monotonic()
        self.pace.clock.made(now)
        busy = {f.client_id for f in self.flights.values()}
        for client_id in self.pace.resting():
            if client_id not in busy and client_id in co.roster.online:   # resting now, not on a probe
                self._count(client_id, "rested")
        tally, model_bytes = self.book.tally, co.fp32_model_bytes
        row = {"round": version, "version": version, **batch.columns(),
               "returned": batch.count + self.dropped, "dropped_stale": self.dropped,
               "contributions": {c: self.contributions[c] for c in sorted(self.contributions)},
               "in_flight": len(self.flights), "selected": self.given, **tally.row(), **co.app_columns(),
               "bytes_per_client": co.intake.notes.bytes_per_client(),
               "fp32_bytes_down": model_bytes * self.given,
               "fp32_bytes_up": model_bytes * (batch.count + self.dropped), **co.lr_columns(version),
               "seconds": now - self._started}
        co.state = state
        self.given = self.dropped = self._draws = 0
        self.contributions = {}
        self.book.tally, co.intake.notes, self._started = Tally(), RoundNotes(), now
        if co.evaluates(version):   # here and now: the checkpoint of a version is written before the next one
            row.update(co.evaluate())
        co.on_progress({"kind": "round", "round": version, "phase": "end", "seconds": row["seconds"]})
        if version < co.config.run.rounds:
            co.on_progress({"kind": "round", "round": version + 1, "phase": "start"})
        return row, snapshot(self.buffer.saved_in(state, self._in_flight(), self.journal.seq))

    def _in_flight(self) -> dict[str, list[Any]]:
        """The tasks in flight as a checkpoint keeps them: task id -> [client, version, deadline, sent] (Unix times)."""
        now, wall = time.monotonic(), time.time()
        return {f.task_id: [f.client_id, f.version, wall + f.deadline - now, wall + f.sent - now]
                for f in self.flights.values()}

    def _save_buffer(self) -> None:
        """On a stop: the last version's checkpoint again, now with the results buffered since (never lost).
        A stop while a new version was being made, evaluated or written goes back to the state and batch it
        came from: that version has no row and no checkpoint, so a resumed run makes it again from them.
        Results taken meanwhile go to the batches after it, never into it."""
        if self._making is not None:
            self.co.state, batch = self._making
            self.buffer.put_back(batch)
            self._making = None
        self._harvest(report=False)   # results the intake acknowledged while the stop came
        if not self.buffer.count or not self.buffer.finite():   # a NaN buffer would make the checkpoint unreadable
            return
        try:
            self.co.checkpoint(self.buffer.saved_in(self.co.state, self._in_flight(), self.journal.seq))
        except (RunError, OSError) as exc:
            log.error("could not checkpoint the %d buffered result(s) as the run stopped (the journal keeps them "
                      "for --resume): %s", self.buffer.count, exc)
            return
        self.journal.forget(self.journal.seq, self.co.state.round)


def _in_flight_entry(entry: Any) -> bool:
    """Whether a checkpoint's or the journal's in-flight entry reads: [client, version], or with the deadline and
    the time sent (a checkpoint written before they were kept has neither)."""
    return (isinstance(entry, list) and len(entry) in (2, 4) and isinstance(entry[0], str)
            and isinstance(entry[1], int) and all(isinstance(v, (int, float)) for v in entry[2:]))
