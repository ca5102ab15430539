"""The round engine: presence, sampling, tasks, results, aggregation, evaluation.

It speaks to clients only through a :class:`~edge_client.transport.Transport` and
the protocol's encoder and decoder, and to the learning method only through a
:class:`~coordinator.strategies.base.Strategy`. Every received message is
checked; anything unacceptable is counted and logged, never raised.
"""

from __future__ import annotations

import json
import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from coordinator.checkpoint import save_checkpoint
from coordinator.config import RunConfig
from coordinator.strategies.base import ClientResult, ServerState, Strategy, TaskPlan
from edge_client.models import build_model, state_shapes
from edge_client.objectives import evaluate
from edge_client.protocol import Message, ProtocolError, Topics, check_tensors, decode, encode
from edge_client.transport import Transport, TransportError

__all__ = ["RunError", "Coordinator", "EvalData"]

log = logging.getLogger("fedge.coordinator")
COUNTERS = ("late", "rejected", "duplicates", "unexpected", "failed")


class RunError(RuntimeError):
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
    plans: dict[str, TaskPlan] = field(default_factory=dict)       # task id -> plan
    results: dict[str, ClientResult] = field(default_factory=dict)  # client id -> result
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    bytes_down: int = 0
    bytes_up: int = 0

    @property
    def complete(self) -> bool:
        return len(self.results) >= len(self.plans)


class Coordinator:
    """Runs the rounds of one federated training run."""

    def __init__(self, config: RunConfig, transport: Transport, *, run_id: str, out_dir: Path,
                 strategy: Strategy, state: ServerState, model_spec: dict[str, Any], eval_data: EvalData,
                 on_round: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.config = config
        self.transport = transport
        self.run_id = run_id
        self.out = out_dir
        self.strategy = strategy
        self.state = state
        self.model_spec = model_spec
        self.eval_data = eval_data
        self.on_round = on_round or (lambda row: None)
        self.topics = Topics(config.transport.prefix)
        self.model = build_model(model_spec)
        self.shapes = state_shapes(self.model)
        self.online: dict[str, dict[str, Any]] = {}
        self.sent_tasks: set[str] = set()
        self._round = _Round(round=0, attempt=-1)   # between rounds: collects strays for the next row
        self.watchdog: Callable[[], None] = lambda: None   # raises RunError if spawned clients died

    # -- messages -------------------------------------------------------------
    def _pump(self, until: float, done: Callable[[], bool]) -> None:
        while not done() and time.monotonic() < until:
            self.watchdog()
            incoming = self.transport.get(min(0.2, max(0.0, until - time.monotonic())))
            if incoming is None:
                continue
            client_id = self.topics.client_of(incoming.topic)
            kind = incoming.topic.rsplit("/", 1)[-1]
            if client_id is None:
                continue
            if kind == "presence":
                self._on_presence(client_id, incoming.payload)
            elif kind == "result":
                self._round.bytes_up += len(incoming.payload)
                self._on_result(client_id, incoming.payload)

    def _on_presence(self, client_id: str, payload: bytes) -> None:
        try:
            msg = decode(payload, max_bytes=1024 * 1024)
        except ProtocolError as exc:
            log.warning("ignored presence of %s: %s", client_id, exc)
            return
        if msg.sender != client_id:
            return
        if msg.body.get("state") == "online":
            if client_id not in self.online:
                log.info("client %s online (%s samples)", client_id, msg.body.get("num_samples"))
            self.online[client_id] = msg.body
        elif self.online.pop(client_id, None) is not None:
            log.info("client %s went offline", client_id)

    def _count(self, what: str, client_id: str, reason: str) -> None:
        self._round.counts[what] += 1
        log.warning("%s result from %s: %s", what, client_id, reason)

    def _status(self, client_id: str, task_id: str, state: str, reason: str = "") -> None:
        body = {"state": state, "task_id": task_id, **({"reason": reason} if reason else {})}
        payload = encode("status", run_id=self.run_id, round=self._round.round, task_id=task_id,
                         sender="coordinator", body=body)
        self._publish(self.topics.client(client_id, "status"), payload)

    def _on_result(self, client_id: str, payload: bytes) -> None:
        book = self._round
        try:
            msg = decode(payload, max_bytes=self.config.transport.max_message_bytes)
        except ProtocolError as exc:
            self._count("rejected", client_id, str(exc))
            return
        if msg.kind != "result" or msg.sender != client_id:
            self._count("rejected", client_id, f"a {msg.kind} from {msg.sender} on {client_id}'s result topic")
            return
        plan = book.plans.get(msg.task_id)
        if msg.run_id != self.run_id or (plan is None and msg.task_id in self.sent_tasks):
            self._count("late", client_id, f"task {msg.task_id} of round {msg.round} is over")
            self._status(client_id, msg.task_id, "ack")
            return
        if plan is None or plan.client_id != client_id:
            self._count("unexpected", client_id, f"task {msg.task_id} was not given to this client")
            return
        if client_id in book.results:
            book.counts["duplicates"] += 1
            self._status(client_id, msg.task_id, "ack")
            return
        book.profiles[client_id] = msg.body.get("profile", {})
        try:
            result = self._accept(plan, msg)
        except ProtocolError as exc:
            what = "failed" if "error" in msg.body else "rejected"
            self._count(what, client_id, str(exc))
            self._status(client_id, msg.task_id, "rejected", str(exc))
            return
        book.results[client_id] = result
        self._status(client_id, msg.task_id, "ack")

    def _accept(self, plan: TaskPlan, msg: Message) -> ClientResult:
        if "error" in msg.body:
            raise ProtocolError(f"client could not run the task: {msg.body['error']}")
        n = msg.body.get("num_samples")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ProtocolError(f"num_samples must be a positive integer, got {n!r}")
        check_tensors(msg.tensors, {k: self.shapes[k] for k in plan.up})
        metrics = msg.body.get("metrics", {})
        return ClientResult(plan.client_id, n, msg.tensors, metrics if isinstance(metrics, dict) else {})

    def _publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        try:
            self.transport.publish(topic, payload, retain=retain)
        except TransportError as exc:
            log.error("could not publish to %s: %s", topic, exc)

    def announce(self, state: str) -> None:
        payload = encode("status", run_id=self.run_id, round=self.state.round + (state == "running"),
                         task_id="", sender="coordinator", body={"state": state})
        self._publish(self.topics.coordinator_status, payload, retain=True)

    # -- rounds ---------------------------------------------------------------
    def wait_for_clients(self, count: int, timeout: float) -> None:
        """Block until ``count`` clients are online; raise RunError after ``timeout``."""
        self.transport.subscribe(self.topics.all_clients("presence"))
        self.transport.subscribe(self.topics.all_clients("result"))
        self._pump(time.monotonic() + timeout, lambda: len(self.online) >= count)
        if len(self.online) < count:
            raise RunError(f"only {len(self.online)} of {count} clients came online within {timeout:.0f} s "
                           f"({sorted(self.online)}); start more clients or lower clients.expected")

    def _sample(self, round: int, attempt: int) -> list[str]:
        c = self.config
        want = c.selected_per_round
        if len(self.online) < c.required_results:
            self.wait_for_clients(c.required_results, c.clients.presence_timeout)
        pool = sorted(self.online)
        rng = random.Random(f"{c.run.seed}/{round}/{attempt}")
        return sorted(rng.sample(pool, min(want, len(pool))))

    def _send_tasks(self, book: _Round, plans: list[TaskPlan]) -> None:
        c = self.config.clients
        for plan in plans:
            task_id = uuid.uuid4().hex[:16]
            body = {"objective": plan.objective, "hyper": plan.hyper, "model": self.model_spec, "up": plan.up,
                    "seed": self.config.run.seed, "timeout": c.round_timeout, "resend_every": c.resend_every,
                    "deadline": time.time() + c.round_timeout}
            payload = encode("task", run_id=self.run_id, round=book.round, task_id=task_id,
                             sender="coordinator", body=body, tensors=plan.down)
            book.plans[task_id] = plan
            self.sent_tasks.add(task_id)
            book.bytes_down += len(payload)
            self._publish(self.topics.client(plan.client_id, "task"), payload)

    def run_round(self, round: int) -> dict[str, Any]:
        """Run one round (retrying with fresh samples if too few results) and return its metrics row."""
        c = self.config
        started = time.monotonic()
        totals = dict(self._round.counts)
        bytes_down, bytes_up = 0, self._round.bytes_up
        for attempt in range(c.clients.max_attempts):
            book = self._round = _Round(round=round, attempt=attempt)
            self.announce("running")
            clients = self._sample(round, attempt)
            self._send_tasks(book, self.strategy.configure_train(round, self.state, clients))
            self._pump(time.monotonic() + c.clients.round_timeout, lambda: book.complete)
            for key in COUNTERS:
                totals[key] += book.counts[key]
            bytes_down += book.bytes_down
            bytes_up += book.bytes_up
            if book.results and len(book.results) >= c.required_results:
                break
            log.warning("round %d attempt %d: %d of %d results (need %d); retrying with a fresh sample",
                        round, attempt + 1, len(book.results), len(book.plans), c.required_results)
        else:
            raise RunError(f"round {round} got too few results in {c.clients.max_attempts} attempts; "
                           "check the clients' logs, raise clients.round_timeout or lower clients.min_results")
        results = [book.results[k] for k in sorted(book.results)]   # fixed order: reproducible sums
        self.state = self.strategy.aggregate_train(round, self.state, results)
        self._round = _Round(round=round, attempt=-1)
        self._write_profiles(round, book.profiles)
        loss, acc = self.evaluate()
        slowest = max(book.profiles.items(), key=lambda kv: kv[1].get("seconds") or 0, default=(None, {}))
        n = sum(r.num_samples for r in results)
        return {
            "round": round, "test_accuracy": acc, "test_loss": loss,
            "selected": len(book.plans), "returned": len(book.results), "attempts": book.attempt + 1,
            **totals, "bytes_down": bytes_down, "bytes_up": bytes_up,
            "bytes_down_per_client": bytes_down // max(len(book.plans), 1),
            "bytes_up_per_client": bytes_up // max(len(book.results), 1),
            "train_loss": sum(r.metrics.get("train_loss", 0.0) * r.num_samples for r in results) / n,
            "slowest_client": slowest[0], "slowest_seconds": slowest[1].get("seconds"),
            "seconds": time.monotonic() - started,
        }

    def evaluate(self) -> tuple[float, float]:
        self.model.load_state_dict(self.state.params, strict=False)
        return evaluate(self.model, self.eval_data.x, self.eval_data.y)

    def _write_profiles(self, round: int, profiles: dict[str, dict[str, Any]]) -> None:
        directory = self.out / "clients"
        directory.mkdir(parents=True, exist_ok=True)
        for client_id, profile in profiles.items():
            record = {"client_id": client_id, "round": round, "profile": profile,
                      "device": self.online.get(client_id, {}).get("device")}
            (directory / f"{client_id}.json").write_text(json.dumps(record, indent=1), encoding="utf-8")

    def checkpoint(self) -> Path:
        info = {"run_id": self.run_id, "model": self.model_spec, "strategy": self.strategy.name}
        return save_checkpoint(self.out / "checkpoints", self.state, info,
                               keep_all=self.config.checkpoint.keep == "all")
