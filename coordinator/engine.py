"""The round engine: presence, sampling, tasks, results, aggregation, evaluation.

It speaks to clients only through a :class:`~edge_client.wire.transport.Transport` and
the protocol's encoder and decoder, and to the learning method only through a
:class:`~coordinator.strategies.base.Strategy`. Every received message is
checked; anything unacceptable is counted and logged, never raised.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from coordinator.aggregation import norm_bound_keep, update_norms
from coordinator.config import RunConfig
from coordinator.downlink import Downlink, shared_tensors
from coordinator.profiles import ProfileStore
from coordinator.selection import Absences, DeadlineFilter, RoundTimes
from coordinator.intake import accept_result, one_torch_thread
from coordinator.strategies.base import AggregationError, ClientResult, Strategy, TaskPlan, WeightedSum
from edge_client.wire.throttle import ThrottledLog
from coordinator.diagnostics import divergence_metrics
from edge_client.device import resolve_device
from edge_client.models import state_shapes
from edge_client.registry import build_aside
from edge_client.wire.protocol import (ClaimBody, ManifestBody, Message, PartialBody, PresenceBody, ProtocolError,
                                       ResultBody, StatusBody, TaskBody, Topics, check_tensors, decode, encode,
                                       valid_client_id)
from edge_client.wire.chunking import DEFAULT_PARTIAL_BYTES, ChunkingTransport
from edge_client.wire.transport import MessageTooLarge, Transport, TransportError
from profiling.schema import clean_profile
from storage.checkpoint import save_checkpoint
from storage.state import ServerState
from storage.errors import FedgeError

__all__ = ["RunError", "Coordinator", "EvalData"]

log = logging.getLogger("fedge.coordinator")
COUNTERS = ("late", "rejected", "duplicates", "unexpected", "failed")


class RunError(FedgeError, RuntimeError):
    """The run cannot go on (too few clients, repeated failed rounds)."""


@dataclass(frozen=True)
class EvalData:
    x: torch.Tensor
    y: torch.Tensor


@dataclass
class _Round:
    """Book-keeping for one attempt at one round."""

    round: int
    attempt: int
    phase: str = "train"
    streaming: bool = False        # results are folded into ``partial`` on arrival and their tensors dropped
    partial: Any = None            # the strategy's partial aggregate of the results so far (streaming only)
    plans: dict[str, TaskPlan] = field(default_factory=dict)       # task id -> plan
    results: dict[str, ClientResult] = field(default_factory=dict)  # client id -> result (no tensors if streaming)
    failed: set[str] = field(default_factory=set)    # clients that answered with an error
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)               # left out by deadline selection
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    bytes_down: int = 0
    bytes_up: int = 0
    bytes_broadcast: int = 0
    # With aggregation workers: the exchange's id in their manifest, and the results a worker holds
    # folded whose partial sum has not arrived (task id -> (worker, the result without tensors)).
    manifest: ManifestBody | None = None
    granted: dict[str, tuple[str, ClientResult]] = field(default_factory=dict)
    worker_lost: int = 0
    shared: frozenset[str] = frozenset()   # the tensors the tasks leave to the model broadcast
    broadcast: str | None = None           # ... and its hash

    @property
    def complete(self) -> bool:
        """Every client has answered (a result, or an error: waiting on would only burn the deadline).

        A rejected result does not count: the client may still send a good one."""
        return len(self.results.keys() | self.failed) >= len(self.plans)

    @property
    def answered(self) -> bool:
        """Every client has answered, counting results an aggregation worker folded but has not sent yet."""
        held = {result.client_id for _, result in self.granted.values()}
        return len(self.results.keys() | self.failed | held) >= len(self.plans)


@dataclass
class _Trained:
    """A trained round whose row is complete once its test-set evaluation (if any) is done."""

    row: dict[str, Any]
    state: ServerState                                      # snapshot: what is evaluated and checkpointed
    evaluation: Future[dict[str, Any]] | None = None      # None: no evaluation this round


def _snapshot(state: ServerState) -> ServerState:
    """A copy of ``state`` that nothing done in later rounds can change."""
    return dataclasses.replace(state, params={k: v.detach().clone() for k, v in state.params.items()},
                               spec=copy.deepcopy(state.spec), extra=copy.deepcopy(state.extra),
                               buffers={k: v.detach().clone() for k, v in state.buffers.items()})


def _check_finite(state: ServerState, round: int, phase: str, rule: str) -> None:
    """A non-finite aggregate ends the run here, saying so: every device would refuse it as a broadcast
    or train it into NaN results, and the run would end later blaming the round timeout."""
    bad = sorted(name for name, tensor in state.params.items() if not bool(torch.isfinite(tensor).all()))
    if bad:
        hint = ("one or a few results large enough to overflow the mean, typically hostile or broken devices: "
                "set aggregate.rule (median, trimmed_mean) or aggregate.norm_bound" if rule == "mean"
                else f"every result was finite, yet aggregate.rule = {rule!r} produced this")
        raise RunError(f"round {round} ({phase}) aggregated to a model with NaN or infinite values in "
                       f"{', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}; it was not checkpointed or sent: "
                       f"{hint}; resume from the last checkpoint once fixed")


class Coordinator:
    """Runs the rounds of one federated training run.

    ``on_progress`` is how a person watching, or a benchmark, follows the run without reaching into
    the engine. It gets dicts by ``kind`` (a consumer ignores kinds it does not know): ``waiting``
    (``online``, ``needed``: clients before round 1), ``exchange`` (a phase's results coming in:
    ``round``, ``phase``, ``attempt``, ``results``, ``selected``, ``bytes_down``, ``bytes_up``,
    ``started``, ``timeout``) and ``round`` (``round``, ``phase`` ``"start"`` or ``"end"``, and at the
    end the row's ``seconds``). The ``round`` events bound :meth:`train_round` on its own thread, so a
    caller may read its clocks there (wall, CPU, memory) to time a round.
    """

    def __init__(self, config: RunConfig, transport: Transport, *, run_id: str, out_dir: Path,
                 strategy: Strategy, state: ServerState, eval_data: EvalData,
                 on_progress: Callable[[dict[str, Any]], None] | None = None) -> None:
        if not state.spec:
            raise ValueError("the server state has no model spec; build it with Strategy.initialize(spec, params)")
        self.config = config
        self.run_id = run_id
        self.out = out_dir
        self.strategy = strategy
        self.state = state
        self._network_key = ""                        # the spec self.model was built from (JSON)
        self.model, self.shapes = self._network()
        t = config.transport
        if config.workers.count and self.fp32_model_bytes + 16384 > t.max_message_bytes:
            log.warning("a float32 result (%d bytes of tensors, and its envelope) is close to or over "
                        "transport.max_message_bytes (%d): it may travel in chunks, which a shared subscription "
                        "spreads over the aggregation workers; raise max_message_bytes (the devices' too) above "
                        "it, or use a compact codec.up", self.fp32_model_bytes, t.max_message_bytes)
        # Chunks what is over the broker's packet limit, reassembles what comes in chunks.
        self.transport = ChunkingTransport(transport, max_message_bytes=t.max_message_bytes,
                                           max_decoded_bytes=t.max_decoded_bytes, chunking=t.chunking,
                                           max_partial_bytes=self.max_partial_bytes)
        self.eval_data = eval_data
        self.eval_device = resolve_device(config.eval.device)   # where the test-set evaluation runs
        # What a person watching wants between rounds: who is online while waiting, results coming in.
        self.on_progress = on_progress or (lambda info: None)
        self.topics = Topics(config.transport.prefix)
        self.downlink = Downlink(config, run_id)
        self._broadcast_digest = ""                   # the model message last published
        self._broadcast_payload = b""                 # ... and its bytes, published again after a reconnect
        self._status_payload = b""                    # the run status last announced (retained), likewise
        self._was_connected = True
        self._warn = ThrottledLog(log)                # bad messages: a few lines each, then counts
        self._dropped_seen: dict[str, int] = {}       # the receive queue's drops already in a row
        self._failures: dict[str, str] = {}           # client -> why it could not run its task, this round
        self._rejections: dict[str, str] = {}         # client -> why its last result was rejected, this round
        self._client_bytes: dict[str, dict[str, int]] = {}   # this round: client id -> down/up bytes
        self.online: dict[str, PresenceBody] = {}
        self.workers_online: set[str] = set()         # aggregation workers (config.workers), by id
        self.sent_tasks: set[str] = set()
        # This process's turn at the run: a resumed run re-issues rounds its devices saw, under a new session.
        self.session = uuid.uuid4().hex[:12]
        self._earlier_tasks: set[str] = set()        # tasks of an earlier session whose results came (resume)
        self._other_runs: set[str] = set()           # results of other runs already acknowledged and logged
        self.started_after = state.round   # the last round done before this session (0: a new run)
        self.round_times = RoundTimes()
        self._deadline_filter = DeadlineFilter(self.round_times)
        self.absences = Absences(config.clients.max_misses)
        self.profile_store = ProfileStore(out_dir / "clients", completed_rounds=state.round)
        self._round = _Round(round=0, attempt=-1)   # between rounds: collects strays for the next row
        self.watchdog: Callable[[], None] = lambda: None   # raises RunError if spawned clients died
        # Evaluation off the critical path (run_rounds): trained rounds whose rows wait, in round order,
        # and the evaluation thread's own network (never used by two threads at once).
        self._trained: deque[_Trained] = deque()
        self._complete: Callable[[dict[str, Any], ServerState], None] = lambda row, state: None
        self._eval_model: nn.Module | None = None
        self._eval_model_key = ""
        self._torch_threads = torch.get_num_threads()   # what the evaluation thread uses

    # -- messages -------------------------------------------------------------
    def _pump(self, until: float, done: Callable[[], bool],
              progress: Callable[[], dict[str, Any]] | None = None) -> None:
        """Handle messages until ``done()`` or ``until``; report ``progress()`` whenever it changes."""
        shown: dict[str, Any] | None = None
        while not done() and time.monotonic() < until:
            if progress is not None and (now := progress()) != shown:
                self.on_progress(now)
                shown = now
            self.watchdog()
            self._after_reconnect()
            self._warn.flush()
            self._complete_rows()   # an earlier round's evaluation may have finished meanwhile
            incoming = self.transport.get(min(0.2, max(0.0, until - time.monotonic())))
            if incoming is None:
                continue
            client_id = self.topics.client_of(incoming.topic)
            kind = incoming.topic.rsplit("/", 1)[-1]
            if client_id is None:
                worker = self.topics.worker_of(incoming.topic)
                if worker is not None and self.config.workers.count:
                    self._on_worker(worker, kind, incoming)
                continue
            if kind == "result":
                if incoming.error:   # its chunks did not make a whole message
                    self._add_up(client_id, incoming.wire_bytes)
                    self._count("rejected", client_id, incoming.error)
                elif incoming.payload:
                    with one_torch_thread():
                        self._on_result(client_id, incoming.payload, incoming.wire_bytes)
            elif incoming.error:
                self._warn.warning("lost a message on %s: %s", incoming.topic, incoming.error)
            elif kind == "presence" and incoming.payload:
                self._on_presence(client_id, incoming.payload)
        if progress is not None and (now := progress()) != shown:
            self.on_progress(now)   # the change that ended the wait too ("3/3 online")

    def _network(self) -> tuple[nn.Module, dict[str, tuple[int, ...]]]:
        """The coordinator's copy of the network the state's spec describes, and its tensor shapes.

        Rebuilt only when a strategy changed the spec; the shapes are what results are checked against.
        """
        key = json.dumps(self.state.spec, sort_keys=True)
        if key != self._network_key:
            model = build_aside(self.state.spec)
            self.model, self.shapes, self._network_key = model, state_shapes(model), key
        return self.model, self.shapes

    @property
    def fp32_model_bytes(self) -> int:
        """The whole exchanged model in float32: the reference traffic is measured against."""
        return 4 * sum(math.prod(s) for s in self.shapes.values())

    @property
    def max_partial_bytes(self) -> int:
        """The bound on chunk data of incomplete results: ``transport.max_partial_bytes``, or one that
        holds a whole round of float32 results (a fixed 64 MiB evicted results from 40 of them on, and
        every eviction cost a device's re-send)."""
        t = self.config.transport
        if t.max_partial_bytes:
            return t.max_partial_bytes
        return max(DEFAULT_PARTIAL_BYTES, t.max_decoded_bytes, self.config.selected_per_round * self.fp32_model_bytes)

    def _add_bytes(self, client_id: str, direction: str, n: int) -> None:
        self._client_bytes.setdefault(client_id, {"down": 0, "up": 0})[direction] += n

    def _add_up(self, client_id: str, n: int) -> None:
        """Bytes that came on a client's result topic for this run: the round's and the client's."""
        self._round.bytes_up += n
        self._add_bytes(client_id, "up", n)

    def _of_another_run(self, client_id: str, msg: Message) -> bool:
        """A result of another run (one a dead coordinator gave): acknowledged so that the device stops
        re-sending it, logged once, and counted nowhere: this run's bytes and ``late`` are its own."""
        if msg.run_id == self.run_id:
            return False
        if msg.task_id not in self._other_runs:
            self._other_runs.add(msg.task_id)
            log.info("ignored a result from %s of another run (%s, task %s)", client_id, msg.run_id, msg.task_id)
        self._status(client_id, msg.task_id, "ack")
        return True

    def _on_presence(self, client_id: str, payload: bytes) -> None:
        try:
            msg = decode(payload, max_bytes=1024 * 1024)
        except ProtocolError as exc:
            self._warn.warning("ignored presence of %s: %s", client_id, exc)
            return
        if msg.sender != client_id or msg.kind != "presence":
            return
        try:
            body = PresenceBody.from_body(msg.body)
        except ProtocolError as exc:
            self._warn.warning("ignored presence of %s: %s", client_id, exc)
            return
        if body.state == "online":
            if client_id not in self.online:
                log.info("client %s online (%s samples)", client_id, body.num_samples)
            if self.absences.returned(client_id):
                log.info("client %s announced itself again: it may be selected again", client_id)
            self.online[client_id] = body
            self._resend_task(client_id)
        elif self.online.pop(client_id, None) is not None:
            log.info("client %s went offline", client_id)

    def _answering(self) -> list[str]:
        """The online clients selection may draw from: not those benched for unanswered tasks."""
        return self.absences.pool(self.online, 0, retry=False)

    def _device(self, client_id: str) -> dict[str, Any] | None:
        """The device facts a client announced with its presence, if it is online."""
        presence = self.online.get(client_id)
        return presence.device if presence is not None else None

    def _count(self, what: str, client_id: str, reason: str) -> None:
        self._round.counts[what] += 1
        if what == "failed":
            self._failures[client_id] = reason
        elif what == "rejected":
            self._rejections[client_id] = reason
        self._warn.warning("%s result from %s: %s", what, client_id, reason)

    def _status(self, client_id: str, task_id: str, state: str, reason: str = "") -> None:
        payload = encode("status", run_id=self.run_id, round=self._round.round, task_id=task_id,
                         sender="coordinator", body=StatusBody(state, task_id, reason).to_body())
        self._publish(self.topics.client(client_id, "status"), payload)

    def _on_result(self, client_id: str, payload: bytes, wire_bytes: int) -> None:
        try:
            msg = decode(payload, max_bytes=self.config.transport.max_decoded_bytes)
        except ProtocolError as exc:
            self._add_up(client_id, wire_bytes)
            self._count("rejected", client_id, str(exc))
            return
        if not self._of_another_run(client_id, msg):
            self._add_up(client_id, wire_bytes)
            self._sort_result(client_id, msg)

    def _sort_result(self, client_id: str, msg: Message, claim: tuple[str, ClaimBody] | None = None) -> bool:
        """Count, acknowledge and keep (or fold) one result; True when it was kept. With a ``claim`` (the
        worker and what it says) it is the result without tensors, which the worker checked and holds until
        granted."""
        book = self._round
        if msg.kind != "result" or msg.sender != client_id:
            self._count("rejected", client_id, f"a {msg.kind} from {msg.sender} on {client_id}'s result topic")
            return False
        try:   # a body that does not parse is rejected below, once the result is sorted
            body: ResultBody | None = ResultBody.from_body(msg.body)
            problem = ""
        except ProtocolError as exc:
            body, problem = None, str(exc)
        profile = clean_profile(body.profile if body is not None else None)
        if self.absences.returned(client_id):
            log.info("client %s answered again: it may be selected again", client_id)
        answered = self.round_times.answered(msg.task_id, client_id, time.monotonic())
        if answered is not None:   # the first answer to a task this coordinator gave this client
            self._store_profile(client_id, msg, body.error if body is not None else None, profile, *answered,
                                late=msg.task_id not in book.plans)
        plan = book.plans.get(msg.task_id)
        if plan is None and msg.task_id in self.sent_tasks:
            self._count("late", client_id, f"task {msg.task_id} of round {msg.round} is over")
            self._status(client_id, msg.task_id, "ack")
            return False
        if (plan is None and self.started_after and msg.round <= self.started_after + 2
                and msg.task_id not in self.sent_tasks):
            # A task the coordinator gave before it stopped (the round after the checkpoint, or the one after
            # that, which trained while the first one's evaluation ran): expected after --resume, late, and
            # counted once however often the device re-sends it before the acknowledgement reaches it.
            if msg.task_id not in self._earlier_tasks:
                self._earlier_tasks.add(msg.task_id)
                self._round.counts["late"] += 1
                log.info("late result from %s: task %s of round %d was given before this coordinator resumed",
                         client_id, msg.task_id, msg.round)
            self._status(client_id, msg.task_id, "ack")
            return False
        if plan is None or plan.client_id != client_id:
            self._count("unexpected", client_id, f"task {msg.task_id} was not given to this client")
            self._status(client_id, msg.task_id, "rejected", "this coordinator did not give you that task")
            return False
        if client_id in book.results or msg.task_id in book.granted:
            book.counts["duplicates"] += 1
            self._status(client_id, msg.task_id, "ack")
            return False
        book.profiles[client_id] = profile
        try:
            if body is None:
                raise ProtocolError(problem)
            announced = self.online.get(client_id)
            if body.error is None and announced is not None and body.num_samples > announced.num_samples:
                # The count is the result's weight in the mean: a device must not claim more than it has.
                raise ProtocolError(f"it claims {body.num_samples} samples but the device announced "
                                    f"{announced.num_samples}")
            if claim is not None:
                return self._grant(book, *claim, msg, body)
            result = accept_result(plan, msg, body, self.shapes, self.downlink.upload_codec(plan), self.strategy,
                                   self.state.spec if plan.model is None else plan.model)
            if book.streaming:
                result = self._fold(book, result)
        except ProtocolError as exc:
            what = "failed" if body is not None and body.error is not None else "rejected"
            self._count(what, client_id, str(exc))
            if what == "failed":   # the client said it cannot run the task: it will send nothing else
                book.failed.add(client_id)
            self._status(client_id, msg.task_id, "rejected", str(exc))
            return False
        book.results[client_id] = result
        self._status(client_id, msg.task_id, "ack")
        return True

    # -- aggregation workers ------------------------------------------------------
    def _on_worker(self, worker: str, kind: str, incoming: Any) -> None:
        """A message from an aggregation worker: its presence, a claim on a result it checked, or a partial sum."""
        if incoming.error:
            self._warn.warning("lost a message from worker %s: %s", worker, incoming.error)
        elif kind == "presence" and incoming.payload:
            try:
                msg = decode(incoming.payload, max_bytes=1024 * 1024)
                online = msg.sender == worker and PresenceBody.from_body(msg.body).state == "online"
            except ProtocolError as exc:
                self._warn.warning("ignored presence of worker %s: %s", worker, exc)
                return
            if online and worker not in self.workers_online:
                log.info("aggregation worker %s online", worker)
            elif not online and worker in self.workers_online:
                log.warning("aggregation worker %s went offline", worker)
            (self.workers_online.add if online else self.workers_online.discard)(worker)
        elif kind == "claim" and incoming.payload:
            self._on_claim(worker, incoming.payload)
        elif kind == "partial" and incoming.payload:
            with one_torch_thread():
                self._on_partial(worker, incoming.payload)

    def _on_claim(self, worker: str, payload: bytes) -> None:
        """A worker checked a result and holds it: grant it (the worker folds it) or not (it drops it)."""
        try:
            msg = decode(payload, max_bytes=1024 * 1024)
            if not valid_client_id(msg.sender):
                raise ProtocolError(f"sender {msg.sender!r} is not a client id")
            claim = ClaimBody.from_body(msg.body)
        except ProtocolError as exc:
            self._warn.warning("ignored a claim from worker %s: %s", worker, exc)
            return
        if self._of_another_run(msg.sender, msg):
            granted = False
        else:
            self._add_up(msg.sender, claim.wire_bytes)   # the result's bytes, as it came
            granted = self._sort_result(msg.sender, msg, (worker, claim))
        payload = encode("status", run_id=self.run_id, round=self._round.round, task_id=msg.task_id,
                         sender="coordinator", body=StatusBody("ack" if granted else "rejected", msg.task_id).to_body())
        self._publish(self.topics.worker(worker, "status"), payload)

    def _grant(self, book: _Round, worker: str, claim: ClaimBody, msg: Message, body: ResultBody) -> bool:
        """Let ``worker`` fold the result it claims; its partial sum brings the tensors (:meth:`_on_partial`)."""
        if body.error is not None:
            raise ProtocolError(f"client could not run the task: {body.error}")
        if claim.problem:   # the worker found the tensors unusable
            raise ProtocolError(claim.problem)
        if not claim.held:   # it could not read the result (no manifest yet): a re-send will come
            return False
        book.granted[msg.task_id] = (worker, ClientResult(msg.sender, body.num_samples, {}, dict(body.metrics)))
        self._status(msg.sender, msg.task_id, "ack")
        return True

    def _on_partial(self, worker: str, payload: bytes) -> None:
        """Merge a worker's partial sum after checking its receipts against what it was granted."""
        book = self._round
        try:
            msg = decode(payload, max_bytes=self.config.transport.max_decoded_bytes)
            if msg.kind != "partial" or msg.sender != worker:
                raise ProtocolError(f"a {msg.kind} from {msg.sender} on worker {worker}'s partial topic")
            body = PartialBody.from_body(msg.body)
            if book.manifest is None or body.exchange != book.manifest.exchange:
                raise ProtocolError(f"it is for exchange {body.exchange}, which is over")
            if len(set(body.tasks)) != len(body.tasks) or any(book.granted.get(t, ("",))[0] != worker
                                                               for t in body.tasks):
                raise ProtocolError("its receipts name tasks that were not granted to it, or one twice")
            results = [book.granted[t][1] for t in body.tasks]
            weight = sum(r.num_samples for r in results)
            if not math.isclose(body.weight, weight, rel_tol=1e-12):
                raise ProtocolError(f"its weight {body.weight} is not the {weight} samples of its receipts")
            check_tensors(msg.tensors, {k: self.shapes[k] for k in book.manifest.up}, torch.float64)
            partial = WeightedSum(dict(msg.tensors), float(body.weight))
            book.partial = partial if book.partial is None else book.partial + partial
        except (ProtocolError, AggregationError) as exc:
            self._warn.warning("ignored a partial sum from worker %s: %s", worker, exc)
            return
        for task_id, result in zip(body.tasks, results):
            del book.granted[task_id]
            book.results[result.client_id] = result

    def _publish_manifest(self, book: _Round) -> None:
        if book.manifest is not None:
            self._publish(self.topics.manifest, encode("manifest", run_id=self.run_id, round=book.round, task_id="",
                                                       sender="coordinator", body=book.manifest.to_body()), retain=True)

    def _collect_partials(self, book: _Round) -> None:
        """Ask the workers for what they folded and wait for it; results that never come are lost."""
        if book.manifest is None or not book.granted:
            return
        book.manifest = dataclasses.replace(book.manifest, flush=True)
        self._publish_manifest(book)
        self._pump(time.monotonic() + self.config.workers.flush_timeout, lambda: not book.granted)
        if book.granted:
            held = sorted({worker for worker, _ in book.granted.values()})
            log.warning("round %d: %d result(s) folded by worker(s) %s never arrived within workers.flush_timeout "
                        "(%.0f s); the round goes on without them", book.round, len(book.granted), ", ".join(held),
                        self.config.workers.flush_timeout)
            book.worker_lost += len(book.granted)
            book.granted.clear()

    def _store_profile(self, client_id: str, msg: Message, error: str | None, profile: dict[str, Any],
                       round_seconds: float, objective: str, *, late: bool) -> None:
        self.profile_store.add(client_id, round=msg.round, task_id=msg.task_id, objective=objective,
                               round_seconds=round_seconds, late=late,
                               error=None if error is None else error[:500], profile=profile,
                               device=self._device(client_id))

    def _streams(self, phase: str) -> bool:
        """Whether a phase's results are folded in as they arrive: where the strategy can, and nothing
        needs every client's tensors at the end (the norm bound's median, the divergence diagnostics)."""
        return (self.strategy.streams(phase) and self.config.aggregate.norm_bound == 0
                and not (phase == "train" and self.config.run.diagnostics))

    def _fold(self, book: _Round, result: ClientResult) -> ClientResult:
        """Fold ``result`` into the round's partial aggregate; what is kept of it has no tensors."""
        try:
            book.partial = self.strategy.fold(book.phase, book.partial, result)
        except AggregationError as exc:
            raise ProtocolError(f"cannot aggregate this result: {exc}") from None
        return dataclasses.replace(result, tensors={}, deltas={}, sent={})

    def _publish(self, topic: str, payload: bytes, *, retain: bool = False) -> int:
        """Publish (in chunks if needed) and return the bytes sent; a message too large ends the run."""
        try:
            return self.transport.publish(topic, payload, retain=retain)
        except MessageTooLarge as exc:
            raise RunError(f"cannot send to {topic}: {exc}") from None
        except TransportError as exc:
            log.error("could not publish to %s: %s", topic, exc)
            return 0

    def announce(self, state: str, round: int | None = None) -> None:
        """Tell every client the run's state and current round (older tasks are stale)."""
        current = self.state.round + 1 if round is None else round
        payload = encode("status", run_id=self.run_id, round=current, task_id="", sender="coordinator",
                         body=StatusBody(state, session=self.session).to_body())
        self._publish(self.topics.coordinator_status, payload, retain=True)
        self._status_payload = payload

    # -- rounds ---------------------------------------------------------------
    def wait_for_clients(self, count: int, timeout: float) -> None:
        """Block until ``count`` clients are online; raise RunError after ``timeout``."""
        workers = self.config.workers.count
        self.transport.subscribe(self.topics.all_clients("presence"))
        if workers:   # results go to the workers' shared subscription; claims and partial sums come here
            for kind in ("presence", "claim", "partial"):
                self.transport.subscribe(self.topics.all_workers(kind))
        else:
            self.transport.subscribe(self.topics.all_clients("result"))
        self._pump(time.monotonic() + timeout,
                   lambda: len(self._answering()) >= count and len(self.workers_online) >= workers,
                   lambda: {"kind": "waiting", "online": self._answering(), "needed": count})
        if len(self.workers_online) < workers:
            raise RunError(f"only {len(self.workers_online)} of {workers} aggregation workers came online within "
                           f"{timeout:.0f} s: start them (fedge-coordinator worker --config ... on the same broker) "
                           "or lower workers.count")
        if len(self._answering()) < count:
            benched = sorted(set(self.online) - set(self._answering()))
            raise RunError(f"only {len(self._answering())} of {count} clients came online within {timeout:.0f} s "
                           f"({self._answering()})" + (f", besides {benched}, online but not answering their tasks"
                                                 if benched else "") + "; start more clients or lower clients.expected")

    def _sample(self, round: int, attempt: int) -> list[str]:
        c = self.config
        want = c.selected_per_round
        if len(self._answering()) < c.required_results:
            self.wait_for_clients(c.required_results, c.clients.presence_timeout)
        pool = self.absences.pool(self.online, c.required_results, retry=attempt > 0)
        if c.clients.selection == "deadline":
            pool = self._skip_predicted_late(pool, round)
        rng = random.Random(f"{c.run.seed}/{round}/{attempt}")
        return sorted(rng.sample(pool, min(want, len(pool))))

    def _note_missed(self, book: _Round) -> None:
        """Tasks of an ended attempt without an answer took at least the timeout: for selection and the records."""
        timeout = self.config.clients.round_timeout
        missed = self.round_times.missed(book.plans, timeout)
        for task_id, client_id, objective in missed:
            self.profile_store.add(client_id, round=book.round, task_id=task_id, objective=objective,
                                   round_seconds=timeout, missed=True, device=self._device(client_id))
        for client_id in self.absences.missed(c for _, c, _ in missed):
            log.warning("client %s left %d tasks in a row unanswered: it is left out of selection until it "
                        "answers or reconnects (clients.max_misses)", client_id, self.absences.limit)

    def _skip_predicted_late(self, pool: list[str], round: int) -> list[str]:
        c = self.config.clients
        keep, skipped = self._deadline_filter(pool, c.round_timeout, self.config.required_results, time.monotonic())
        self._round.skipped = [s.client_id for s in skipped]
        if skipped:
            log.info("round %d: deadline selection skipped %s (round_timeout %.1f s)", round,
                     ", ".join(f"{s.client_id} (predicted {s.predicted_seconds:.1f} s)" for s in skipped),
                     c.round_timeout)
        return keep

    def _broadcast(self, book: _Round, tensors: dict[str, torch.Tensor]) -> str:
        """Publish the exchange's shared tensors (retained) unless already there; return their hash.

        A retry publishes it again even when unchanged: a broker that restarted without
        persistence has lost the retained copy, and devices waiting for it would never get it.
        """
        payload, digest = self.downlink.broadcast(book.round, tensors)
        if digest != self._broadcast_digest or book.attempt > 0:
            sent = self._publish(self.topics.model, payload, retain=True)
            book.bytes_down += sent
            book.bytes_broadcast += sent
            self._broadcast_digest = digest if sent else ""
            self._broadcast_payload = payload if sent else b""
        return digest

    def _after_reconnect(self) -> None:
        """Publish the retained run status and the model broadcast again once the broker is back (unanswered
        tasks go again as their devices announce themselves: :meth:`_resend_task`).

        A broker restarted without persistence (or before its autosave) has forgotten both:
        devices would park every task for want of a running status, or wait for a broadcast
        that never comes.
        """
        connected = self.transport.connected
        if connected and not self._was_connected:
            log.warning("reconnected to the broker: publishing the run status and the model broadcast again")
            if self._status_payload:
                self._publish(self.topics.coordinator_status, self._status_payload, retain=True)
            if self._broadcast_payload:
                self._publish(self.topics.model, self._broadcast_payload, retain=True)
            self._publish_manifest(self._round)
        self._was_connected = connected

    def _send_tasks(self, book: _Round, plans: list[TaskPlan]) -> None:
        shared = shared_tensors(plans) if self.config.codec.broadcast else {}
        digest = self._broadcast(book, shared) if shared else ""
        self.transport.prefer(self.topics.client(plan.client_id, "result") for plan in plans)
        task_ids = [uuid.uuid4().hex[:16] for _ in plans]
        if self.config.workers.count and plans:   # the workers learn the tasks before any result can come
            book.manifest = ManifestBody(uuid.uuid4().hex[:16], book.phase, self.state.spec, tuple(plans[0].up),
                                         self.downlink.upload_codec(plans[0]),
                                         {t: p.client_id for t, p in zip(task_ids, plans)}, digest or None)
            self._publish_manifest(book)
        book.shared, book.broadcast = frozenset(shared), digest or None
        for task_id, plan in zip(task_ids, plans):
            book.plans[task_id] = plan
            self.sent_tasks.add(task_id)
            self.round_times.sent(task_id, plan.client_id, plan.objective, time.monotonic())
            self._send_task(book, task_id, plan)

    def _send_task(self, book: _Round, task_id: str, plan: TaskPlan) -> None:
        c = self.config.clients
        body = TaskBody(objective=plan.objective, model=self.state.spec if plan.model is None else plan.model,
                        up=tuple(plan.up), hyper=plan.hyper, upload=self.downlink.upload(plan),
                        codec=self.downlink.spec, broadcast=book.broadcast, seed=self.config.run.seed,
                        timeout=c.round_timeout, resend_every=c.resend_every, deadline=time.time() + c.round_timeout,
                        session=self.session)
        own = {k: v for k, v in plan.down.items() if k not in book.shared}
        sent = self._publish(self.topics.client(plan.client_id, "task"), self.downlink.task(book.round, task_id, body, own))
        book.bytes_down += sent
        self._add_bytes(plan.client_id, "down", sent)

    def _resend_task(self, client_id: str) -> None:
        """Send the client's task of this attempt again, under its id, if it has not answered it.

        Called when the client announces itself online again: after a reconnect its subscriptions are
        back, and a broker that restarted without persistence (or a session that expired) has lost the
        task it had not delivered, which would cost the attempt its whole timeout. A device that did
        get the task answers the copy with the result it already has."""
        book = self._round
        held = {result.client_id for _, result in book.granted.values()}
        if client_id in book.results.keys() | book.failed | held:
            return
        for task_id, plan in book.plans.items():
            if plan.client_id == client_id:
                log.warning("round %d: sending %s's unanswered task again (it announced itself online)",
                            book.round, client_id)
                self._send_task(book, task_id, plan)

    def _exchange(self, round: int, phase: str) -> tuple[_Round, dict[str, int]]:
        """One task/result exchange of a phase, retried with fresh samples while results are too few."""
        c = self.config
        totals = dict(self._round.counts, bytes_down=0, bytes_up=self._round.bytes_up, bytes_broadcast=0)
        for attempt in range(c.clients.max_attempts):
            book = self._round = _Round(round=round, attempt=attempt, phase=phase, streaming=self._streams(phase))
            self.announce("running", round)
            clients = self._answering() if self.strategy.selects_all(phase) else self._sample(round, attempt)
            self._send_tasks(book, self.strategy.configure(phase, round, self.state, clients))
            started = time.monotonic()
            self._pump(started + c.clients.round_timeout, lambda: book.answered,
                       lambda: {"kind": "exchange", "round": round, "phase": phase, "attempt": attempt + 1,
                                "results": len(book.results) + len(book.granted), "selected": len(book.plans),
                                "bytes_down": book.bytes_down, "bytes_up": book.bytes_up, "started": started,
                                "timeout": c.clients.round_timeout})
            self._collect_partials(book)
            self._note_missed(book)
            for key in COUNTERS:
                totals[key] += book.counts[key]
            totals["bytes_down"] += book.bytes_down
            totals["bytes_up"] += book.bytes_up
            totals["bytes_broadcast"] += book.bytes_broadcast
            if book.worker_lost:   # results acknowledged but lost with a worker's partial sum
                totals["worker_lost"] = totals.get("worker_lost", 0) + book.worker_lost
            if book.results and len(book.results) >= min(c.required_results, len(book.plans)):
                self._round = _Round(round=round, attempt=-1)   # collects strays until the next exchange
                return book, totals
            log.warning("round %d %s attempt %d: %d of %d results (need %d); retrying with a fresh sample",
                        round, phase, attempt + 1, len(book.results), len(book.plans), c.required_results)
        raise RunError(f"round {round} ({phase}) got too few results in {c.clients.max_attempts} attempts; "
                       + self._why_too_few())

    def _why_too_few(self) -> str:
        """What the round's clients said or sent, which explains a round without enough results better
        than the timeout does."""
        said = "; ".join(f"{cid}: {why}" for cid, why in sorted(self._failures.items())[:3])
        rejected = sorted(self._rejections.items())
        if rejected and all("NaN or infinite" in why or "non-finite" in why for _, why in rejected):
            return (f"the results of {len(rejected)} client(s) held NaN or infinite values, which is what training "
                    "a diverged global model gives: a hostile or broken update (set aggregate.rule or "
                    "aggregate.norm_bound, docs/robustness.md) or a learning rate too high; resume from an earlier "
                    f"checkpoint once fixed (first: {rejected[0][0]}: {rejected[0][1]})")
        if said:
            return f"the clients said: {said}"
        if rejected:
            shown = "; ".join(f"{cid}: {why}" for cid, why in rejected[:3])
            return f"results were rejected: {shown}"
        return "check the clients' logs, raise clients.round_timeout or lower clients.min_results"

    def _norm_bound(self, results: list[ClientResult]) -> tuple[list[ClientResult], list[str]]:
        """The results whose update norm is within ``aggregate.norm_bound`` x the round's median, and the
        ids of the others (rejected before aggregation, and logged)."""
        norms = update_norms([r.deltas for r in results])
        keep = norm_bound_keep(norms, self.config.aggregate.norm_bound)
        dropped = [r.client_id for r, ok in zip(results, keep) if not ok]
        if dropped:
            log.warning("round %d: rejected %d update(s) above %.3g x the median norm: %s", self.state.round + 1,
                        len(dropped), self.config.aggregate.norm_bound, ", ".join(dropped))
        return [r for r, ok in zip(results, keep) if ok], dropped

    def _inbox_drops(self) -> dict[str, int]:
        """Messages the receive queue dropped since the last round's row, by reason."""
        now = self.transport.dropped_by
        since = {k: v - self._dropped_seen.get(k, 0) for k, v in now.items() if v > self._dropped_seen.get(k, 0)}
        self._dropped_seen = now
        return since

    def evaluates(self, round: int) -> bool:
        """Whether ``round`` ends with a test-set evaluation: every ``eval.every`` rounds and in the last."""
        return round % self.config.eval.every == 0 or round == self.config.run.rounds

    def run_round(self, round: int) -> dict[str, Any]:
        """One round with its test-set evaluation, if due, done here and now: the whole row at once."""
        row = self.train_round(round)
        if self.evaluates(round):
            row.update(self.evaluate())
        return row

    def train_round(self, round: int) -> dict[str, Any]:
        """Run one round's phases (training, then any the strategy adds) and return its metrics row,
        without the test-set evaluation; ``seconds`` is the phases' wall time."""
        self.on_progress({"kind": "round", "round": round, "phase": "start"})
        started = time.monotonic()
        self._failures, self._rejections = {}, {}
        row: dict[str, Any] = {"round": round}
        counts: dict[str, int] = dict.fromkeys((*COUNTERS, "bytes_down", "bytes_up", "bytes_broadcast"), 0)
        self._client_bytes = {}
        last = round == self.config.run.rounds
        for phase in self.strategy.phases(round, last):
            book, totals = self._exchange(round, phase)
            results = [book.results[k] for k in sorted(book.results)]   # fixed order: reproducible sums
            for key, value in totals.items():
                counts[key] = counts.get(key, 0) + value
            if phase == "train" and self.config.aggregate.norm_bound > 0:
                results, dropped = self._norm_bound(results)
                row.update({"norm_rejected": len(dropped), "norm_rejected_clients": dropped})
            if phase == "train":
                n = sum(r.num_samples for r in results)
                slowest = max(book.profiles.items(), key=lambda kv: kv[1].get("seconds") or 0, default=(None, {}))
                row.update({
                    "selected": len(book.plans), "returned": len(book.results), "attempts": book.attempt + 1,
                    "train_samples": n,
                    "train_loss": sum(r.metrics.get("train_loss", 0.0) * r.num_samples for r in results) / n,
                    "slowest_client": slowest[0], "slowest_seconds": slowest[1].get("seconds"),
                    "skipped": book.skipped,
                    "bytes_down_per_client": totals["bytes_down"] // max(len(book.plans), 1),
                    "bytes_up_per_client": totals["bytes_up"] // max(len(book.results), 1),
                    # the reference: the whole float32 model to and from every selected client
                    "fp32_bytes_down": self.fp32_model_bytes * len(book.plans),
                    "fp32_bytes_up": self.fp32_model_bytes * len(book.plans),
                })
                if self.config.run.diagnostics:   # before aggregation: how far apart the clients went
                    row.update(divergence_metrics([r.values() for r in results], [r.num_samples for r in results]))
            else:
                row.update({f"{phase}_selected": len(book.plans), f"{phase}_returned": len(book.results),
                            f"{phase}_bytes_down": totals["bytes_down"], f"{phase}_bytes_up": totals["bytes_up"]})
            self.state, phase_metrics = self.strategy.aggregate(phase, round, self.state, results, book.partial)
            _check_finite(self.state, round, phase, self.config.aggregate.rule)
            self._network()   # the strategy may have changed the network: the next phase checks against it
            row.update(phase_metrics)
        row.update(counts)
        dropped = self._inbox_drops()
        if dropped:
            row["inbox_dropped"] = dropped
        row["bytes_per_client"] = {k: self._client_bytes[k] for k in sorted(self._client_bytes)}
        row["seconds"] = time.monotonic() - started
        self.on_progress({"kind": "round", "round": round, "phase": "end", "seconds": row["seconds"]})
        return row

    def run_rounds(self, first: int, last: int, complete: Callable[[dict[str, Any], ServerState], None]) -> None:
        """Rounds ``first`` to ``last``, each test-set evaluation on a thread of its own while the next round trains.

        ``complete(row, state)`` gets each round's finished row (its evaluation included) and a snapshot
        of the state the round ended on, in round order, on this thread, as soon as the evaluation is
        done: rows and checkpoints written there agree. At most one evaluation runs at a time; one that
        fails ends the run. If something else ends it, rows already trained are completed first.
        """
        self._complete = complete
        try:
            for r in range(first, last + 1):
                row = self.train_round(r)
                trained = _Trained(row, _snapshot(self.state))
                if self.evaluates(r):
                    self._complete_rows(wait=True)   # the evaluation in flight, and the rows behind it
                    trained.evaluation = self._evaluate_in_background(trained.state)
                self._trained.append(trained)
                self._complete_rows()
            self._complete_rows(wait=True)
        except BaseException:
            try:   # keep what was trained: a resumed run need not do it again
                self._complete_rows(wait=True)
            except Exception as exc:
                log.error("could not complete the rows of the rounds trained before the run stopped: %s", exc)
            raise
        finally:
            self._trained.clear()
            self._complete = lambda row, state: None

    def _complete_rows(self, wait: bool = False) -> None:
        """Complete trained rounds in order while their evaluation is done (``wait``: wait for it)."""
        while self._trained:
            head = self._trained[0]
            if head.evaluation is not None and not wait and not head.evaluation.done():
                return
            self._trained.popleft()
            try:
                if head.evaluation is not None:
                    try:
                        head.row.update(head.evaluation.result())
                    except Exception as exc:
                        raise RunError(f"the test-set evaluation of round {head.row['round']} failed: "
                                       f"{type(exc).__name__}: {exc}") from exc
                self._complete(head.row, head.state)
            except BaseException:
                self._trained.clear()   # a later round's row must not be written before this one's
                raise

    def _evaluation(self, state: ServerState) -> Callable[[], dict[str, Any]]:
        """The strategy's evaluation of ``state`` (a snapshot), on the evaluation network and device."""
        key = json.dumps(state.spec, sort_keys=True)
        if key != self._eval_model_key:
            self._eval_model, self._eval_model_key = build_aside(state.spec).to(self.eval_device), key
        if self.eval_data.x.device != self.eval_device:   # moved once, not per evaluation
            self.eval_data = EvalData(self.eval_data.x.to(self.eval_device), self.eval_data.y.to(self.eval_device))
        model, data = self._eval_model, self.eval_data

        def work() -> dict[str, Any]:
            model.load_state_dict(state.params, strict=False)
            return self.strategy.evaluate(state, model, data.x, data.y)
        return work

    def _evaluate_in_background(self, state: ServerState) -> Future[dict[str, Any]]:
        """The strategy's evaluation of ``state`` (a snapshot) on a new thread, with the thread's own network."""
        evaluation = self._evaluation(state)
        future: Future[dict[str, Any]] = Future()

        def work() -> None:
            torch.set_num_threads(self._torch_threads)   # a new thread would take the default of the moment
            try:
                future.set_result(evaluation())
            except BaseException as exc:   # handed to the run's thread, which raises it
                future.set_exception(exc)

        threading.Thread(target=work, name=f"fedge-evaluate-{state.round}", daemon=True).start()
        return future

    def evaluate(self) -> dict[str, Any]:
        """The strategy's evaluation of the current global state on the coordinator's test split, here and now
        (never while a background evaluation runs: they share the evaluation network)."""
        return self._evaluation(self.state)()

    def checkpoint(self, state: ServerState | None = None) -> Path:
        """Save ``state`` (the current one by default) as the checkpoint of its round."""
        info = {"run_id": self.run_id, "strategy": self.strategy.name}
        state = self.state if state is None else state
        try:
            return save_checkpoint(self.out / "checkpoints", state, info,
                                   keep_all=self.config.checkpoint.keep == "all")
        except OSError as exc:
            raise RunError(f"could not write the checkpoint of round {state.round} in {self.out / 'checkpoints'} "
                           f"({exc.strerror or exc}); the checkpoints before it are intact: free space and run "
                           "again with --resume") from None
