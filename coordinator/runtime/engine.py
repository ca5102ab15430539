"""The round engine: runs each round's phases and asks its parts to do the work.

It speaks to clients only through a :class:`~edge_client.wire.transport.Transport` and
the protocol's encoder and decoder, and to the learning method only through a
:class:`~coordinator.strategies.base.Strategy`. The parts, one job each:

- :class:`~coordinator.runtime.presence.Roster`: which clients are online;
- :class:`~coordinator.runtime.selection.Sampler`: which of them an attempt draws;
- :class:`~coordinator.runtime.tasks.TaskSender` and :class:`~coordinator.runtime.broadcast.Broadcast`: what goes
  down (tasks, the model broadcast, the run status, each again when needed);
- :class:`~coordinator.runtime.intake.ResultIntake`: what becomes of every result;
- :class:`~coordinator.runtime.worker_exchange.WorkerExchange`: the aggregation workers' claims and partial sums;
- :mod:`coordinator.runtime.bookkeeping`: evaluation off the critical path, rows in order, checkpoints.

Every received message is checked; anything unacceptable is counted and logged, never raised.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from coordinator.runtime.device_book import BOOK_EXTRA, DeviceBook, ModelSize
from coordinator.runtime.bookkeeping import (EvalData, Evaluation, RunRecords, TrainedRound, TrainedRounds,
                                             snapshot, write_checkpoint)
from coordinator.ops.spawn import sim_client_id
from coordinator.runtime.attempts import silent_note
from coordinator.runtime.broadcast import Broadcast
from coordinator.config import RunConfig
from coordinator.diagnostics import divergence_metrics
from coordinator.runtime.downlink import Downlink
from coordinator.runtime.guards import check_finite, check_private_divergence, within_norm_bound
from coordinator.runtime.intake import ResultIntake, one_torch_thread
from coordinator.runtime.outbox import Outbox
from coordinator.runtime.presence import PRESENCE_FILE, PresenceLog, Roster
from coordinator.runtime.profiles import ProfileStore
from coordinator.runtime.round_book import Network, RoundBook, RoundNotes, Tally
from coordinator.runtime.round_row import phase_columns, train_columns
from coordinator.runtime.run_error import RunError
from coordinator.runtime.secure_round import SecureRound
from coordinator.runtime.round_times import RoundTimes
from coordinator.runtime.selection import Absences, Draw, Sampler
from coordinator.runtime.task_journal import TaskJournal
from coordinator.strategies.base import Strategy
from coordinator.runtime.tasks import TaskSender
from coordinator.runtime.worker_exchange import WorkerExchange
from edge_client.device import resolve_device
from edge_client.models import state_shapes
from edge_client.registry import build_aside
from edge_client.wire.chunking import DEFAULT_PARTIAL_BYTES, ChunkingTransport
from edge_client.wire.protocol import PresenceBody, Topics
from edge_client.wire.throttle import ThrottledLog
from edge_client.wire.transport import Incoming, Transport
from storage.state import ServerState

__all__ = ["RunError", "Coordinator", "EvalData"]

log = logging.getLogger("fedge.coordinator")


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
        # Site aggregators (direct_results) are alone on their brokers' shared subscriptions and reassemble chunks.
        shared = config.workers.count and not config.workers.direct_results
        if shared and self.fp32_model_bytes + 16384 > t.max_message_bytes:
            log.warning("a float32 result (%d bytes of tensors, and its envelope) is close to or over "
                        "transport.max_message_bytes (%d): it may travel in chunks, which a shared subscription "
                        "spreads over the aggregation workers; raise max_message_bytes (the devices' too) above "
                        "it, or use a compact codec.up", self.fp32_model_bytes, t.max_message_bytes)
        # Chunks what is over the broker's packet limit, reassembles what comes in chunks.
        self.transport = ChunkingTransport(transport, max_message_bytes=t.max_message_bytes,
                                           max_decoded_bytes=t.max_decoded_bytes, chunking=t.chunking,
                                           max_partial_bytes=self.max_partial_bytes)
        # What a person watching wants between rounds: who is online while waiting, results coming in.
        self.on_progress = on_progress or (lambda info: None)
        self.watchdog: Callable[[], None] = lambda: None   # raises RunError if spawned clients died
        self.started_after = state.round   # the last round done before this session (0: a new run)
        # Local DP's account sees every task sent, those of a round a stop or a crash cut short included.
        self.journal = TaskJournal(out_dir) if strategy.counts_tasks else None
        if self.journal is not None:
            self.state, replayed = self.journal.replay(self.state, strategy)
            if replayed:
                log.warning("counted the devices of %d training exchange(s) sent after round %d and never completed "
                            "in the privacy account (%s)", replayed, state.round, self.journal.path)
        # This process's turn at the run: a resumed run re-issues rounds its devices saw, under a new session.
        self.session = uuid.uuid4().hex[:12]
        self._dropped_seen: dict[str, int] = {}       # the receive queue's drops already in a row
        self._assemble(eval_data)

    def _assemble(self, eval_data: EvalData) -> None:
        """The engine's parts, wired to each other."""
        config, warn = self.config, ThrottledLog(log)   # bad messages: a few lines each, then counts
        self._warn = warn
        self.topics = Topics(config.transport.prefix)
        self.outbox = Outbox(self.transport, self.run_id)
        self.downlink = Downlink(config, self.run_id)
        self.round_times = RoundTimes()
        self.absences = Absences(config.clients.max_misses, config.clients.max_rejected)
        self.device_book = DeviceBook(lambda: ModelSize.of(self.network.spec, config.train.batch_size))
        self.device_book.restore(self.state.extra.get(BOOK_EXTRA))   # a resumed run's knowledge of its devices
        self.roster = Roster(self.absences, warn, PresenceLog(self.out / PRESENCE_FILE, lambda: self.state.round),
                             self.device_book.presence)
        self.sampler = Sampler(config, self.absences, self.round_times, self.device_book)
        done = self.state.round + (1 if config.run.mode == "async" else 0)   # async: version v's tasks are round v+1
        self.profile_store = ProfileStore(self.out / "clients", completed_rounds=done)
        network = self._current_network
        self.intake = ResultIntake(config, outbox=self.outbox, topics=self.topics, strategy=self.strategy,
                                   downlink=self.downlink, roster=self.roster, round_times=self.round_times,
                                   profile_store=self.profile_store, device_book=self.device_book,
                                   network=network, warn=warn, started_after=self.started_after)
        self.workers = WorkerExchange(config, outbox=self.outbox, topics=self.topics, intake=self.intake,
                                      network=network, warn=warn, wait=self.pump)
        self.broadcast = Broadcast(self.outbox, self.topics, self.downlink, self.session)
        self.tasks = TaskSender(config, outbox=self.outbox, topics=self.topics, downlink=self.downlink,
                                broadcast=self.broadcast, workers=self.workers, intake=self.intake, network=network)
        self.secure = SecureRound(config, intake=self.intake, tasks=self.tasks, roster=self.roster, network=network,
                                  pump=self.pump, await_answers=self._await_answers) if config.secagg.enabled else None
        self.evaluation = Evaluation(self.strategy, eval_data, resolve_device(config.eval.device))
        self.trained = TrainedRounds()   # rounds whose rows wait for their evaluation (run_rounds)

    @property
    def online(self) -> dict[str, PresenceBody]:
        return self.roster.online

    @property
    def workers_online(self) -> set[str]:
        return self.workers.online

    @property
    def sent_tasks(self) -> set[str]:
        return self.intake.sent_tasks

    # -- messages -------------------------------------------------------------
    def pump(self, until: float, done: Callable[[], bool],
             progress: Callable[[], dict[str, Any]] | None = None) -> None:
        """Handle messages until ``done()`` or ``until``; report ``progress()`` whenever it changes."""
        shown: dict[str, Any] | None = None
        while not done() and time.monotonic() < until:
            if progress is not None and (now := progress()) != shown:
                self.on_progress(now)
                shown = now
            self.watchdog()
            if self.broadcast.reconnected(self.transport.connected):
                self.workers.publish_manifest(self.intake.book)   # unanswered tasks go as devices come back
            self._warn.flush()
            self.trained.complete()   # an earlier round's evaluation may have finished meanwhile
            incoming = self.transport.get(min(0.2, max(0.0, until - time.monotonic())))
            if incoming is not None:
                self._dispatch(incoming)
        if progress is not None and (now := progress()) != shown:
            self.on_progress(now)   # the change that ended the wait too ("3/3 online")

    def _dispatch(self, incoming: Incoming) -> None:
        """Hand a message to the part it is for, by its topic; other topics are ignored."""
        client_id = self.topics.client_of(incoming.topic)
        kind = incoming.topic.rsplit("/", 1)[-1]
        if client_id is None:
            worker = self.topics.worker_of(incoming.topic)
            if worker is not None and self.config.workers.count:
                self.workers.on_message(worker, kind, incoming)
        elif kind == "result":
            if incoming.error:   # its chunks did not make a whole message
                self.intake.on_broken(client_id, incoming.wire_bytes, incoming.error)
            elif incoming.payload:
                with one_torch_thread():
                    self.intake.on_result(client_id, incoming.payload, incoming.wire_bytes)
        elif incoming.error:
            self._warn.warning("lost a message on %s: %s", incoming.topic, incoming.error)
        elif kind == "presence" and incoming.payload:
            if self.roster.on_presence(client_id, incoming.payload):
                self.device_book.hello(client_id, self.roster.device(client_id))
                self.tasks.resend_unanswered(self.intake.book, client_id)

    def _network(self) -> tuple[nn.Module, dict[str, tuple[int, ...]]]:
        """The coordinator's copy of the network the state's spec describes, and its tensor shapes.

        Rebuilt only when a strategy changed the spec; the shapes are what results are checked against.
        """
        key = json.dumps(self.state.spec, sort_keys=True)
        if key != self._network_key:
            model = build_aside(self.state.spec)
            self.model, self.shapes, self._network_key = model, state_shapes(model), key
        self.network = Network(self.state.spec, self.shapes)
        return self.model, self.shapes

    def _current_network(self) -> Network:
        """What results are checked against, as it is now (the parts ask for it when they need it)."""
        return self.network

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
        return max(DEFAULT_PARTIAL_BYTES, t.max_decoded_bytes, self.config.drawn_per_round * self.fp32_model_bytes)

    def announce(self, state: str, round: int | None = None) -> None:
        """Tell every client the run's state and current round (older tasks are stale)."""
        self.broadcast.announce(state, self.state.round + 1 if round is None else round)

    # -- rounds ---------------------------------------------------------------
    def wait_for_clients(self, count: int, timeout: float) -> None:
        """Block until ``count`` clients are online; raise RunError after ``timeout``."""
        workers = self.config.workers.count
        self.transport.subscribe(self.topics.all_clients("presence"))
        if workers:   # results go to the workers' shared subscription; claims and partial sums come here
            for kind in ("presence", "claim", "partial"):
                self.transport.subscribe(self.topics.all_workers(kind))
        if not workers or self.config.workers.direct_results:   # site aggregators keep their sites' results
            self.transport.subscribe(self.topics.all_clients("result"))
        answering = self.roster.answering
        self.pump(time.monotonic() + timeout,
                  lambda: len(answering()) >= count and len(self.workers.online) >= workers,
                  lambda: {"kind": "waiting", "online": answering(), "needed": count})
        if len(self.workers.online) < workers:
            raise RunError(f"only {len(self.workers.online)} of {workers} aggregation workers came online within "
                           f"{timeout:.0f} s (clients.presence_timeout): start them (fedge-coordinator worker "
                           "--config ... on the same broker) or lower workers.count")
        if len(answering()) < count:
            withdrawn = sorted(set(self.roster.online) & self.absences.withdrawn)
            benched = [c for c in self.roster.benched_online() if c not in withdrawn]
            wrong_app = [c for c in benched if c in self.absences.wrong_app]
            refusing = [c for c in benched if c in self.absences.refusing and c not in wrong_app]
            benched = [c for c in benched if c not in refusing and c not in wrong_app]
            expected = {sim_client_id(i): "spawned for this run" for i in range(self.config.clients.spawn)}
            expected.update((p.stem, "took part in this run") for p in self.profile_store.directory.glob("*.json"))
            missing = self.roster.missing(expected)
            raise RunError(f"only {len(answering())} of {count} clients came online within {timeout:.0f} s "
                           f"(clients.presence_timeout) ({answering()})"
                           + (f", besides {benched}, online but not answering their tasks" if benched else "")
                           + (f", besides {refusing}, whose results were rejected (coordinator.log says why)"
                              if refusing else "")
                           + (f", besides {withdrawn}, which withdrew from the run (their own privacy budgets: "
                              "clients/ID.jsonl says why)" if withdrawn else "")
                           + (f", besides {wrong_app}, whose app is not the run's ({wrong_app[0]}: "
                              f"{self.absences.wrong_app[wrong_app[0]]}; restart them once it is installed)"
                              if wrong_app else "")
                           + (f"; waiting for {', '.join(missing)}" if missing else
                              f"; no other device announced itself on {self.topics.all_clients('presence')}")
                           + "; start more clients (or bring those back), lower clients.expected, or raise "
                             "clients.presence_timeout")

    def _sample(self, round: int, attempt: int, taken: set[str]) -> Draw:
        """The attempt's clients (besides ``taken``, which it already counts on), once enough are online."""
        c = self.config
        if len(self.roster.answering()) < c.required_results:
            self.wait_for_clients(c.required_results, c.clients.presence_timeout)
        barred = self.strategy.not_drawn(self.state)
        return self.sampler.draw([k for k in self.roster.online if k not in barred], round, attempt, taken)

    def _choose(self, book: RoundBook) -> list[str]:
        """The clients to give a task in this attempt. A retry gives none to a client whose result of an
        earlier attempt it holds, nor to one still working on an earlier attempt's task: it waits for
        that task's result (``book.carried``) and draws only the rest."""
        if book.attempt:
            book.carried = self.intake.still_working(time.monotonic()) - book.results.keys()
            if book.carried:
                log.info("round %d %s attempt %d: waiting for %s, still working on an earlier attempt's task",
                         book.round, book.phase, book.attempt + 1, ", ".join(sorted(book.carried)))
        taken = book.results.keys() | book.carried
        if self.strategy.selects_all(book.phase):
            return [c for c in self.roster.answering() if c not in taken]
        draw = self._sample(book.round, book.attempt, taken)
        book.skipped = draw.skipped
        return draw.clients

    def _streams(self, phase: str) -> bool:
        """Whether a phase's results are folded in as they arrive: where the strategy can, and nothing
        needs every client's tensors at the end (the norm bound's median, the divergence diagnostics)."""
        return (self.strategy.streams(phase) and self.config.aggregate.norm_bound == 0
                and not (phase == "train" and self.config.run.diagnostics))

    def _exchange(self, round: int, phase: str) -> tuple[RoundBook, Tally]:
        """One task/result exchange of a phase, retried with fresh samples while results are too few;
        the last attempt's book and the traffic of all of them."""
        c = self.config
        totals = self.intake.book.tally.carried()
        tasked: set[str] = set()   # every device given a task in any attempt
        for attempt in range(c.clients.max_attempts):
            book = self.intake.open(RoundBook(round=round, attempt=attempt, phase=phase,
                                              streaming=self._streams(phase), close_at=self._close_at(phase)))
            self.announce("running", round)
            clients = self._choose(book)
            plans = self.strategy.configure(phase, round, self.state, clients) if clients else []
            if plans and phase == "train" and self.journal is not None:
                self.journal.sent(round, attempt, [p.client_id for p in plans])
            if plans and self.secure is not None and phase == "train":
                self.secure.run(book, plans)   # four exchanges; the survivors' sum in book.partial
            else:
                if plans:
                    self.tasks.send_all(book, plans)
                self._await_answers(book)
            self.workers.collect(book)
            self.intake.close(book)
            totals.add(book.tally)
            tasked |= book.selected
            # A Poisson-sampled training round counts whatever came back, none included: its noise covers it, and
            # its fixed denominator keeps a device that did not answer from changing what the others weigh.
            any_count = phase == "train" and self.sampler.poisson is not None
            if phase == "train":
                check_private_divergence(c, self.state, self.intake.notes, round, got=len(book.results),
                                         needed=1 if any_count else min(c.required_results, len(book.selected)))
            if any_count or (book.results and len(book.results) >= min(c.required_results, len(book.selected))):
                self.state = self.strategy.tasked(phase, self.state, frozenset(tasked))
                self.intake.open(RoundBook(round=round, attempt=-1))   # collects strays until the next exchange
                return book, totals
            if attempt + 1 == c.clients.max_attempts:   # no attempt follows: the error below says why
                break
            log.warning("round %d %s attempt %d: %d of %d results (need %d); retrying: results still count if "
                        "they come, devices still working are waited for, the rest drawn afresh", round, phase,
                        attempt + 1, len(book.results), len(book.selected), c.required_results)
        silent = silent_note(self.intake.attempts.silent(book, self.intake.notes.rejections),
                             self.intake.round_times, book.wait or c.clients.round_timeout, self.profile_store)
        raise RunError(f"round {round} ({phase}) got too few results in {c.clients.max_attempts} attempts; "
                       + silent + self.intake.notes.why_too_few())

    def _close_at(self, phase: str) -> int:
        """The results that close an attempt at ``phase`` early: ``clients.per_round`` when it draws more devices
        than that (``clients.over_select``); 0 (wait for every client) otherwise, and in phases that go to all."""
        c = self.config
        return c.selected_per_round if c.closes_early and not self.strategy.selects_all(phase) else 0

    def _await_answers(self, book: RoundBook) -> None:
        """Handle messages until every client the attempt waits for answered, an over-selected attempt has the
        results it counts, or its deadline passed."""
        started, timeout = time.monotonic(), self.intake.deadline(book)
        self.pump(started + timeout, lambda: book.answered or book.enough,
                  lambda: {"kind": "exchange", "round": book.round, "phase": book.phase, "attempt": book.attempt + 1,
                           "results": len(book.results) + len(book.granted), "selected": len(book.selected),
                           "bytes_down": book.tally.bytes_down, "bytes_up": book.tally.bytes_up,
                           "started": started, "timeout": timeout})

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
        self.intake.notes = RoundNotes()
        row: dict[str, Any] = {"round": round}
        tally = Tally()
        for phase in self.strategy.phases(round, round == self.config.run.rounds):
            book, totals = self._exchange(round, phase)
            tally.add(totals)
            row.update(self._aggregate(round, phase, book, totals))
        self.intake.attempts.ended_round = round   # a late result of this round now missed it for good
        row.update(tally.row())
        row.update(self.app_columns())
        dropped = self._inbox_drops()
        if dropped:
            row["inbox_dropped"] = dropped
        row["bytes_per_client"] = self.intake.notes.bytes_per_client()
        row["seconds"] = time.monotonic() - started
        self.on_progress({"kind": "round", "round": round, "phase": "end", "seconds": row["seconds"]})
        return row

    def _aggregate(self, round: int, phase: str, book: RoundBook, totals: Tally) -> dict[str, Any]:
        """Aggregate a phase's results into the global state; the phase's columns of the row."""
        results = [book.results[k] for k in sorted(book.results)]   # fixed order: reproducible sums
        row: dict[str, Any] = {}
        if phase == "train" and self.config.aggregate.norm_bound > 0:
            results, dropped = within_norm_bound(results, self.config.aggregate.norm_bound, self.state.round + 1)
            row.update({"norm_rejected": len(dropped), "norm_rejected_clients": dropped})
        if phase == "train":
            row.update(train_columns(book, results, totals, self.fp32_model_bytes), **self.lr_columns(round))
            if self.config.run.diagnostics:   # before aggregation: how far apart the clients went
                row.update(divergence_metrics([r.values() for r in results], [r.num_samples for r in results]))
        else:
            row.update(phase_columns(phase, book, totals))
        row.update(book.columns)
        self.state, phase_metrics = self.strategy.aggregate(phase, round, self.state, results, book.partial)
        check_finite(self.state, round, phase, self.config.aggregate.rule)
        self._network()   # the strategy may have changed the network: the next phase checks against it
        row.update(phase_metrics)
        return row

    def app_columns(self) -> dict[str, int]:
        """``app_refused``: the devices out of the run for their app, as the round ends: each refused a task because
        its installed app is not the run's and has not come online again since (clients/ID.jsonl and coordinator.log
        name both apps); only when there are any."""
        refused = len(self.absences.wrong_app)
        return {"app_refused": refused} if refused else {}

    def lr_columns(self, round: int) -> dict[str, float]:
        """``train_lr``, the local rate the round's training tasks carried, when ``[schedule]`` sets one."""
        factor = self.strategy.lr_factor
        return {} if factor is None else {"train_lr": self.config.train.lr * factor(round)}

    def run_rounds(self, first: int, last: int, records: RunRecords) -> None:
        """Rounds ``first`` to ``last``, each test-set evaluation on a thread of its own while the next round trains.

        Each round's row and checkpoint go to ``records`` as soon as it is aggregated (a coordinator killed
        afterwards resumes from it), and its row is completed with its evaluation in round order, on this
        thread, as soon as the evaluation is done. At most one evaluation runs at a time; one that fails ends
        the run. If something else ends it, the evaluations under way are waited for first.
        """
        with self.trained.completing(records.completed) as trained:
            for r in range(first, last + 1):
                why = self.strategy.stop_before(r, self.state)
                if why:
                    log.warning("%s; the run ends after round %d", why, r - 1)
                    break
                row, state = self.train_round(r), snapshot(self.state)
                records.trained(row, state, evaluating=self.evaluates(r))
                done = TrainedRound(row)
                if self.evaluates(r):
                    trained.complete(wait=True)   # the evaluation in flight, and the rows behind it
                    done.evaluation = self.evaluation.in_background(state)
                trained.add(done)
                trained.complete()

    def evaluate(self) -> dict[str, Any]:
        """The strategy's evaluation of the current global state on the coordinator's test split, here and now
        (never while a background evaluation runs: they share the evaluation network)."""
        return self.evaluation.now(self.state)

    def checkpoint(self, state: ServerState | None = None, *, keep_all: bool | None = None) -> Path:
        """Save ``state`` (the current one by default) as the checkpoint of its round; ``keep_all`` (default:
        ``checkpoint.keep``) False deletes the others."""
        state = self.state if state is None else state
        if self.config.clients.selection != "random":   # the book selection reads, for a resumed run
            state = dataclasses.replace(state, extra={**state.extra, BOOK_EXTRA: self.device_book.saved()})
        return write_checkpoint(self.out, state,
                                {"run_id": self.run_id, "strategy": self.strategy.name},
                                keep_all=self.config.checkpoint.keep == "all" if keep_all is None else keep_all)
