"""The coordinator's result intake: the one place that decides what becomes of a result.

Every result reaches :class:`ResultIntake`, straight from a device or as an aggregation
worker's claim (the device's header and body without the tensors, which the worker checked
and holds). The intake sorts it (which run, round, task and client it answers; late,
duplicate, unexpected), decodes and checks it (:func:`accept_result`: its tensors back to
values, against the network's shapes, then the strategy's own check), bounds its weight
(:mod:`coordinator.runtime.weights`), and folds it into the round's partial aggregate, keeps it,
or grants it to the worker that holds it; it answers the device (``ack`` or ``rejected``) and
counts and logs what it refused. A device whose result is refused is told why, even when only
the envelope's header could be read (NaN tensors), and the attempt does not wait for it any
more: it sends nothing else for that task. An aggregation worker runs :func:`accept_result` on
its share, so both accept and refuse the same results.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from coordinator.runtime.attempts import Attempts
from coordinator.runtime.round_book import Network, RoundBook, RoundNotes
from coordinator.runtime.weights import WeightBound
from coordinator.strategies.base import AggregationError, ClientResult, Strategy, TaskPlan
from edge_client.memory_guard import REFUSAL_PREFIX
from edge_client.privacy import clip_update
from edge_client.wire.codec import CodecSpec
from edge_client.wire.protocol import (REFUSAL_APP, ClaimBody, ContentError, Message, ProtocolError, ResultBody,
                                      Topics, check_tensors, decode)
from edge_client.wire.throttle import ThrottledLog
from edge_client.wire.updates import decode_parts
from profiling.schema import clean_profile

if TYPE_CHECKING:
    from coordinator.config import RunConfig
    from coordinator.runtime.device_book import DeviceBook
    from coordinator.runtime.downlink import Downlink
    from coordinator.runtime.outbox import Outbox
    from coordinator.runtime.presence import Roster
    from coordinator.runtime.profiles import ProfileStore
    from coordinator.runtime.round_times import RoundTimes

__all__ = ["Claim", "ResultIntake", "accept_result", "one_torch_thread"]

log = logging.getLogger("fedge.coordinator")
MEMORY_REFUSAL = f"could not run the task: {REFUSAL_PREFIX}"   # how a device's memory refusal reads when counted
_MAX_CLOSED = 100_000   # closed tasks remembered, so a late result of one is counted once


def accept_result(plan: TaskPlan, msg: Message, body: ResultBody, shapes: Mapping[str, tuple[int, ...]],
                  codec: CodecSpec, strategy: Strategy, spec: dict[str, Any]) -> ClientResult:
    """The result of ``plan`` that ``msg`` carries; ProtocolError with the reason when it cannot be used.

    ``shapes``: the network's tensor shapes (what ``plan.up`` names must have unless ``plan.expect``
    says otherwise); ``codec``: the upload codec the task asked for (its dtype is the values' dtype);
    ``spec``: the model spec the task ran, for the strategy's own check.
    """
    if body.error is not None:
        raise ProtocolError(f"client could not run the task: {body.error}")
    expect = plan.expect if plan.expect is not None else {k: shapes[k] for k in plan.up}
    values, deltas = decode_parts(msg.tensors, body, expect, plan.down)
    check_tensors({**values, **deltas}, expect, codec.dtype)   # float64 for fp64 statistics
    if plan.update == "delta":   # a sent parameter answered with its value is an update all the same
        for name in [k for k in values if k in plan.down]:
            value = values.pop(name)
            deltas[name] = value - plan.down[name].to(value.dtype)
    # Central DP: the bound the coordinator's noise is calibrated to, whatever the codec or device did. Not under
    # local DP (a device noise multiplier): clipping a noisy update would cut its signal, not its noise.
    if plan.clip_norm is not None and plan.noise_multiplier is None:
        deltas = clip_update(deltas, plan.clip_norm)[0]
    result = ClientResult(plan.client_id, body.num_samples, values, dict(body.metrics), deltas, plan.down)
    problem = strategy.check_result(plan, result, spec)
    if problem:
        raise ProtocolError(problem)
    return result


@dataclass(frozen=True)
class Claim:
    """An aggregation worker's claim on a result: the worker, and what it says of the tensors it holds."""

    worker: str
    body: ClaimBody


class ResultIntake:
    """Sorts, checks and keeps the results of the round in progress (:attr:`book`).

    The round loop opens a new book for each attempt (:meth:`open`) and a fresh :attr:`notes`
    for each round; between exchanges the book collects strays (late results) for the next row.
    """

    def __init__(self, config: RunConfig, *, outbox: Outbox, topics: Topics, strategy: Strategy,
                 downlink: Downlink, roster: Roster, round_times: RoundTimes, profile_store: ProfileStore,
                 network: Callable[[], Network], warn: ThrottledLog, started_after: int,
                 device_book: DeviceBook | None = None) -> None:
        self.config = config
        self.run_id = outbox.run_id
        self.outbox = outbox
        self.topics = topics
        self.strategy = strategy
        self.downlink = downlink
        self.roster = roster
        self.round_times = round_times
        self.profile_store = profile_store
        self.device_book = device_book      # per-device knowledge for profile selection
        self.network = network              # what results are checked against, as it is now
        self._warn = warn
        self.started_after = started_after  # the last round done before this session (0: a new run)
        self.book = RoundBook(round=0, attempt=-1)   # between rounds: collects strays for the next row
        self.notes = RoundNotes()
        self.sent_tasks: set[str] = set()           # every task this coordinator process gave
        self._earlier_tasks: set[str] = set()       # tasks of an earlier session whose results came (resume)
        self._other_runs: set[str] = set()          # results of other runs already acknowledged and logged
        self.attempts = Attempts()                  # the phase's earlier attempts, whose results still count
        self._heard: dict[str, float] = {}          # client -> its last first answer to a task of ours (monotonic)
        self._app_said: dict[str, str] = {}         # client -> the app refusal logged for it (once per device and line)
        # Tasks an over-selected attempt closed before their results came (task id -> whether one came since):
        # the first copy of a result counts as late, the others as duplicates.
        self.closed_tasks: dict[str, bool] = {}
        # What must be on disk before a result is acknowledged: an asynchronous run journals it here
        # (coordinator/runtime/async_journal.py), with the task id; an exception leaves the result unacknowledged.
        self.keep: Callable[[str, ClientResult], None] | None = None
        # A secure round's stage results go here instead of being decoded (coordinator/runtime/secure_round.py):
        # it checks the stage's message and returns the result to keep; ProtocolError refuses it.
        self.secure: Callable[[TaskPlan, Message, ResultBody], ClientResult] | None = None
        c = config.clients
        self.weights = WeightBound(c.max_weight_ratio, c.max_samples,
                                   lambda: [p.num_samples for p in roster.online.values()])

    # -- the round's book --------------------------------------------------------------
    def open(self, book: RoundBook) -> RoundBook:
        """Make ``book`` the one results go to (a new attempt, or strays between exchanges); a retry keeps
        the earlier attempts' tasks open and, without aggregation workers, their results."""
        self.attempts.opened(self.book, book, carry=not self.config.workers.count)
        self.book = book
        return book

    def still_working(self, now: float) -> set[str]:
        """Clients presumably still working on a task an earlier attempt of this phase gave them: a retry
        waits for them instead of giving them a new task, which would only queue behind the old one.
        None with aggregation workers: a worker's claim on an earlier attempt's result cannot be taken."""
        if self.config.workers.count:
            return set()
        timeout = self.config.clients.round_timeout
        return {client for task_id, client in self.attempts.unanswered(self.book.answered_by).items()
                if self.round_times.working(task_id, client, now, timeout)}

    def deadline(self, book: RoundBook) -> float:
        """How long the attempt waits for the clients it waits for, from their measured round times
        (:meth:`RoundTimes.deadline`); kept in ``book.wait`` for the records of the tasks it misses."""
        timeout = self.config.clients.round_timeout
        waits = [(p.client_id, p.objective) for p in book.plans.values()]
        waits += [(p.client_id, p.objective) for b in self.attempts.earlier for p in b.plans.values()
                  if p.client_id in book.carried]
        book.wait = self.round_times.deadline(waits, timeout)
        if book.wait > timeout:
            log.info("round %d %s attempt %d: waiting %.1f s instead of clients.round_timeout %.1f s: the devices' "
                     "measured round times need longer", book.round, book.phase, book.attempt + 1, book.wait, timeout)
        return book.wait

    def issued(self, book: RoundBook, task_id: str, plan: TaskPlan) -> None:
        """A task is about to go out: its result is expected in ``book``, and timed from now."""
        book.plans[task_id] = plan
        self.sent_tasks.add(task_id)
        self.attempts.issued(task_id, book)
        self.round_times.sent(task_id, plan.client_id, plan.objective, time.monotonic())

    def close(self, book: RoundBook) -> None:
        """An attempt ended: its unanswered tasks took at least the timeout, for selection and the records;
        their clients count as missing them unless they answered something during the attempt (a device
        slower than the timeout, answering an earlier task: it has not gone away). An over-selected attempt
        that closed with the results it counts tells the others instead (:meth:`close_rest`): they missed nothing."""
        timeout = book.wait or self.config.clients.round_timeout
        if book.enough and not book.told_closed:
            self.close_rest(book)
        missed = self.round_times.missed([t for t in book.plans if t not in self.closed_tasks], timeout)
        for task_id, client_id, objective in missed:
            self.profile_store.add(client_id, round=book.round, task_id=task_id, objective=objective,
                                   round_seconds=timeout, missed=True, device=self.roster.device(client_id))
        gone = [c for _, c, _ in missed if self._heard.get(c, -math.inf) < book.opened]
        for client_id in self.roster.absences.missed(gone):
            log.warning("client %s left %d tasks in a row unanswered: it is left out of selection until it "
                        "answers or reconnects (clients.max_misses)", client_id, self.roster.absences.limit)
        self._fold_held(book, final=True)   # the attempt's results are all in: the rest, in their order

    def close_rest(self, book: RoundBook) -> None:
        """Tell every client the attempt still waited for (a task of it or of an earlier attempt) that its task is
        closed: the round has the results it counts. The device drops the task if it has not started it; a result
        it still sends is acknowledged and counted ``late`` (and ``late_closed``), never aggregated, and its round
        time is measured as any other's. A secure round closes its advertise stage so (its cohort is who advertised).
        """
        book.closed, book.told_closed = book.waiting_for - book.answered_by, True
        tasks = {task_id: plan.client_id for b in (*self.attempts.earlier, book) for task_id, plan in b.plans.items()
                 if plan.client_id in book.closed}
        reason = (f"round {book.round} closed with the {book.close_at} results it counts (clients.over_select); "
                  "a result of this task counts as late")
        for task_id, client_id in sorted(tasks.items()):
            self.closed_tasks[task_id] = False
            self._answer(client_id, task_id, "closed", reason)
        while len(self.closed_tasks) > _MAX_CLOSED:
            del self.closed_tasks[next(iter(self.closed_tasks))]
        if book.closed:
            log.info("round %d %s attempt %d: closed with %d results; told %s the round closed", book.round,
                     book.phase, book.attempt + 1, len(book.results) + len(book.granted), ", ".join(sorted(book.closed)))

    # -- what arrives ----------------------------------------------------------------------
    def on_result(self, client_id: str, payload: bytes, wire_bytes: int) -> None:
        """A whole message on a client's result topic."""
        try:
            msg = decode(payload, max_bytes=self.config.transport.max_decoded_bytes)
        except ContentError as exc:   # a sound header: the device can be told why, and need not be waited for
            if not self._of_another_run(client_id, exc.head):
                self.add_up(client_id, wire_bytes)
                self._sort(client_id, exc.head, unreadable=str(exc))
            return
        except ProtocolError as exc:   # nothing in it can be trusted, not even the task it claims to answer
            self.add_up(client_id, wire_bytes)
            self.count("rejected", client_id, str(exc))
            return
        if not self._of_another_run(client_id, msg):
            self.add_up(client_id, wire_bytes)
            self._sort(client_id, msg)

    def on_broken(self, client_id: str, wire_bytes: int, reason: str) -> None:
        """Chunks on a client's result topic that did not make a whole message."""
        self.add_up(client_id, wire_bytes)
        self.count("rejected", client_id, reason)

    def on_claim(self, msg: Message, claim: Claim) -> bool:
        """A worker's claim on a result (sorted as the result itself); True when granted: the worker folds it."""
        if self._of_another_run(msg.sender, msg):
            return False
        self.add_up(msg.sender, claim.body.wire_bytes)   # the result's bytes, as it came
        return self._sort(msg.sender, msg, claim)

    def add_up(self, client_id: str, n: int) -> None:
        """Bytes that came on a client's result topic for this run: the round's and the client's."""
        self.book.tally.bytes_up += n
        self.notes.add_bytes(client_id, "up", n)

    def count(self, what: str, client_id: str, reason: str, *, logged: bool = False) -> None:
        """One refused result, logged (throttled) with its reason unless ``logged`` already; failures and
        rejections also explain a round that got too few results."""
        self.book.tally.counts[what] += 1
        if what == "failed":
            self.notes.failures[client_id] = reason
            if MEMORY_REFUSAL in reason:   # the device said the task would run it out of memory
                self.book.tally.counts["failed_memory"] = self.book.tally.counts.get("failed_memory", 0) + 1
        elif what == "rejected":
            self.notes.rejections[client_id] = reason
        if not logged:
            self._warn.warning("%s result from %s: %s", what, client_id, reason)

    # -- sorting -----------------------------------------------------------------------
    def _sort(self, client_id: str, msg: Message, claim: Claim | None = None, unreadable: str = "") -> bool:
        """Count, acknowledge and keep (or fold, or grant) one result; True when it was kept or granted.
        With a ``claim`` it is the result without tensors, which the worker checked and holds until granted;
        with ``unreadable`` only its header could be read (the reason why): it is sorted, and refused."""
        book = self.book
        if msg.kind != "result" or msg.sender != client_id:
            self.count("rejected", client_id, f"a {msg.kind} from {msg.sender} on {client_id}'s result topic")
            return False
        body: ResultBody | None = None
        problem = unreadable
        try:   # a body that does not parse is rejected below, once the result is sorted
            if not unreadable:
                body = ResultBody.from_body(msg.body)
        except ProtocolError as exc:   # a worker's claim on a result it could not read says why
            problem = claim.body.problem if claim is not None and claim.body.problem else str(exc)
        profile = clean_profile(body.profile if body is not None else None)
        self._record_answer(client_id, msg, body, profile)
        plan = self._waiting_plan(client_id, msg, earlier=claim is None)
        if plan is None:
            return False
        book.profiles[client_id] = profile
        book.tally.fetched(body.model_from if body is not None else None, book.sent_model)
        try:
            if body is None:
                raise ProtocolError(problem)
            body = self._weigh(client_id, body, worker=claim is not None, secure=plan.secagg is not None)
            if claim is not None:
                return self._grant(claim, msg, body)
            result = self._take(plan, msg, body)
        except ProtocolError as exc:
            self._refuse(client_id, msg.task_id, body, str(exc))
            return False
        if self.keep is not None:
            self.keep(msg.task_id, result)
        book.results[client_id] = result
        self.roster.absences.accepted(client_id)
        self._answer(client_id, msg.task_id, "ack")
        if client_id in book.held:
            self._fold_held(book)
        return True

    def _of_another_run(self, client_id: str, msg: Message) -> bool:
        """A result of another run (one a dead coordinator gave): acknowledged so that the device stops
        re-sending it, logged once, and counted nowhere: this run's bytes and ``late`` are its own."""
        if msg.run_id == self.run_id:
            return False
        if msg.task_id not in self._other_runs:
            self._other_runs.add(msg.task_id)
            log.info("ignored a result from %s of another run (%s, task %s)", client_id, msg.run_id, msg.task_id)
        self._answer(client_id, msg.task_id, "ack")
        return True

    def _record_answer(self, client_id: str, msg: Message, body: ResultBody | None, profile: dict[str, Any]) -> None:
        """Any answer brings a benched client back; the first answer to a task this coordinator gave this
        client is recorded with its profile and the round time measured here (late ones included)."""
        if self.roster.absences.returned(client_id):
            log.info("client %s answered again: it may be selected again", client_id)
        if body is not None and body.withdrawn and self.roster.absences.withdraw(client_id):
            log.warning("client %s withdrew from the run: %s; it is not drawn again in this run", client_id,
                        (body.error or "")[:300])
        if body is not None and body.error is not None and body.refusal == REFUSAL_APP:
            self._refused_for_app(client_id, body.error[:500])
        answered = self.round_times.answered(msg.task_id, client_id, time.monotonic())
        if answered is None:
            return
        self._heard[client_id] = time.monotonic()
        seconds, objective = answered
        error = body.error if body is not None else None
        self.profile_store.add(client_id, round=msg.round, task_id=msg.task_id, objective=objective,
                               round_seconds=seconds, late=self._plan_of(msg.task_id, True) is None,
                               error=None if error is None else error[:500],
                               refusal=body.refusal if body is not None and error is not None else "",
                               profile=profile, device=self.roster.device(client_id),
                               model_from=body.model_from if body is not None else None)
        if self.device_book is not None and body is not None:   # its utility counts its samples: within the bound
            samples = self.weights.cap(body.num_samples)[0]
            self.device_book.answered(client_id, seconds, profile, body.metrics, samples, error)

    def _refused_for_app(self, client_id: str, why: str) -> None:
        """The device's app is not the run's (``why`` names both): it refuses every task alike until it restarts
        with the run's app, so it is given none until it comes online again; said once per device (and line)."""
        self.roster.absences.refused_for_app(client_id, why)
        if self._app_said.get(client_id) != why:
            self._app_said[client_id] = why
            log.warning("client %s refuses this run's tasks: %s; it gets no task until it comes online again "
                        "(restarted with the run's app)", client_id, why)

    def _plan_of(self, task_id: str, earlier: bool) -> TaskPlan | None:
        """The plan of a task of the current attempt or, with ``earlier``, of an earlier attempt of the
        phase (same run, round, phase and global state): its result is as good now as it was then."""
        plan = self.book.plans.get(task_id)
        if plan is None and earlier and (found := self.attempts.find(task_id)) is not None:
            plan = found[1]
        return plan

    def _waiting_plan(self, client_id: str, msg: Message, earlier: bool = True) -> TaskPlan | None:
        """The plan of the task ``msg`` answers, if that task still waits for this client's answer; else
        None, with the answer counted (late, unexpected, duplicate) and the device told. A task of an
        earlier attempt of the phase still waits (not with an aggregation worker's claim: the worker
        holds the result under that attempt's exchange, whose partial sum can no longer be merged)."""
        book, task_id = self.book, msg.task_id
        plan = self._plan_of(task_id, earlier)
        if plan is None and self.closed_tasks.get(task_id) is not None:
            self._closed_late(client_id, task_id, msg.round)
            return None
        if plan is None and task_id in self.sent_tasks:
            self.count("late", client_id, self.attempts.why_late(task_id, msg.round))
            self._answer(client_id, task_id, "ack")
            return None
        if plan is None and self._given_before_resume(client_id, msg):
            self._answer(client_id, task_id, "ack")
            return None
        if plan is None or plan.client_id != client_id:
            self.count("unexpected", client_id, f"task {task_id} was not given to this client")
            self._answer(client_id, task_id, "rejected", "this coordinator did not give you that task")
            return None
        if client_id in book.results or task_id in book.granted:
            book.tally.counts["duplicates"] += 1
            self._answer(client_id, task_id, "ack")
            return None
        return plan

    def _closed_late(self, client_id: str, task_id: str, round: int) -> None:
        """A result of a task an over-selected attempt closed: counted once as ``late`` and ``late_closed`` (copies
        the device re-sent before the acknowledgement reached it as ``duplicates``), acknowledged, never kept."""
        counts = self.book.tally.counts
        if self.closed_tasks[task_id]:
            counts["duplicates"] += 1
        else:
            self.closed_tasks[task_id] = True
            counts["late_closed"] = counts.get("late_closed", 0) + 1
            self.count("late", client_id, "", logged=True)   # expected of over-selection: no warning
            log.info("late result from %s: task %s of round %d closed with the results the round counted before it "
                     "came (clients.over_select)", client_id, task_id, round)
        self._answer(client_id, task_id, "ack")

    def _given_before_resume(self, client_id: str, msg: Message) -> bool:
        """A task the coordinator gave before it stopped (the round after the checkpoint, or the one after
        that, which trained while the first one's evaluation ran): expected after --resume, late, and
        counted once however often the device re-sends it before the acknowledgement reaches it."""
        if not (self.started_after and msg.round <= self.started_after + 2 and msg.task_id not in self.sent_tasks):
            return False
        if msg.task_id not in self._earlier_tasks:
            self._earlier_tasks.add(msg.task_id)
            self.book.tally.counts["late"] += 1
            log.info("late result from %s: task %s of round %d was given before this coordinator resumed",
                     client_id, msg.task_id, msg.round)
        return True

    def _weigh(self, client_id: str, body: ResultBody, worker: bool, secure: bool) -> ResultBody:
        """The count is the result's weight in the mean: a device must not claim more than it announced, and
        a claim above the fleet's bound is capped (``weight_capped``). A ``worker``'s claim cannot be
        reweighed (the worker folds with the device's count): above the bound it is refused instead. A
        ``secure`` round's stage result weighs nothing itself: its weight is inside the masked sum, bounded
        by the round's weight unit (:class:`~coordinator.runtime.secure_round.SecureRound`)."""
        if body.error is not None:
            return body
        announced = self.roster.announced_samples(client_id)
        if announced is not None and body.num_samples > announced:
            raise ProtocolError(f"it claims {body.num_samples} samples but the device announced {announced}")
        weight, why = self.weights.cap(body.num_samples)
        if not why or secure:
            return body
        if worker:
            raise ProtocolError(f"{why}; an aggregation worker cannot fold it with less weight")
        counts = self.book.tally.counts
        counts["weight_capped"] = counts.get("weight_capped", 0) + 1
        self._warn.warning("capped the weight of %s's result at %s samples: %s", client_id, f"{weight:,}", why)
        return dataclasses.replace(body, num_samples=weight)

    def _take(self, plan: TaskPlan, msg: Message, body: ResultBody) -> ClientResult:
        """The checked result, folded into the round's partial aggregate when the phase streams; a secure
        round's stage result goes to the secure round, which keeps its message and folds nothing."""
        if plan.secagg is not None:
            if self.secure is None:
                raise ProtocolError("a secure-aggregation result came, but no secure round is running")
            return self.secure(plan, msg, body)
        network = self.network()
        result = accept_result(plan, msg, body, network.shapes, self.downlink.upload_codec(plan), self.strategy,
                               network.spec if plan.model is None else plan.model)
        if not self.book.streaming:
            return result
        if self.config.aggregate.order == "sorted":
            self.book.held[plan.client_id] = result   # folded in its place by _fold_held, once _sort kept it
            self.book.held_peak = max(self.book.held_peak, len(self.book.held))
            return result
        return self._fold(self.book, result)

    def _fold(self, book: RoundBook, result: ClientResult) -> ClientResult:
        """Fold ``result`` into the book's partial aggregate; what is kept of it has no tensors."""
        try:
            book.partial = self.strategy.fold(book.phase, book.partial, result)
        except AggregationError as exc:
            raise ProtocolError(f"cannot aggregate this result: {exc}") from None
        return dataclasses.replace(result, tensors={}, deltas={}, sent={})

    def _fold_held(self, book: RoundBook, final: bool = False) -> None:
        """``aggregate.order = "sorted"``: fold the held results by client id, each as soon as no client
        before it can still send one (or all of them, ``final``, when the attempt closes). Float64 sums
        are not associative to the last bit, so a fixed order gives the same bits whatever the timing (the
        unstreamed sum's bits too: it adds the results in the same order); a result is held only while
        one before it is missing, so with tasks answered roughly in order few are held at once."""
        if not book.held:
            return
        pending = book.waiting_for - book.results.keys() - book.failed   # may still answer
        first = min(pending, default=None)
        for client_id in sorted(book.held):
            if not final and first is not None and first < client_id:
                break
            result = book.held.pop(client_id)
            try:
                book.results[client_id] = self._fold(book, result)
            except ProtocolError as exc:   # already acknowledged: dropped, and counted as a refusal
                del book.results[client_id]
                book.failed.add(client_id)   # it sends nothing more: the attempt need not wait for it
                self.count("rejected", client_id, str(exc))

    def _grant(self, claim: Claim, msg: Message, body: ResultBody) -> bool:
        """Let the claiming worker fold the result; its partial sum brings the tensors (the worker exchange)."""
        if body.error is not None:
            raise ProtocolError(f"client could not run the task: {body.error}")
        if claim.body.problem:   # the worker found the tensors unusable
            raise ProtocolError(claim.body.problem)
        if not claim.body.held:   # it could not read the result (no manifest yet): a re-send will come
            return False
        self.book.granted[msg.task_id] = (claim.worker, ClientResult(msg.sender, body.num_samples, {},
                                                                     dict(body.metrics)))
        self._answer(msg.sender, msg.task_id, "ack")
        return True

    def _refuse(self, client_id: str, task_id: str, body: ResultBody | None, reason: str) -> None:
        """A result that cannot be used: the device is told why (``rejected``), so it stops sending it; if it
        answers the task the attempt waits for, the attempt waits no more for this client."""
        book = self.book
        what = "failed" if body is not None and body.error is not None else "rejected"
        self.count(what, client_id, reason, logged=what == "failed" and body.refusal == REFUSAL_APP)
        if task_id in book.plans or client_id in book.carried:   # not a task an earlier attempt replaced
            book.failed.add(client_id)
            self._fold_held(book)   # the results held behind it need not wait for it
        if what == "rejected" and self.roster.absences.refused(client_id, task_id):
            log.warning("client %s had its results to %d tasks in a row rejected (last: %s): it is left out of "
                        "selection for rejected results until it announces itself again (clients.max_rejected)",
                        client_id, self.roster.absences.rejected_limit, reason[:300])
        self._answer(client_id, task_id, "rejected", reason)

    def _answer(self, client_id: str, task_id: str, state: str, reason: str = "") -> None:
        self.outbox.status(self.topics.client(client_id, "status"), self.book.round, task_id, state, reason)


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run the block on one intra-op thread (this thread only; others keep their own count).

    Checking and folding a result are many small element-wise ops: torch's thread pool makes
    each cost 10 to 30 times more CPU on a busy 2-core coordinator (28.6 ms against 1.7 ms to
    fold a 1.7 MB model) while devices, broker and the evaluation want the same cores.
    """
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
