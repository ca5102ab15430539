"""The coordinator's side of the aggregation workers (``workers.count > 0``, docs/scale.md).

Results go to the workers through a shared subscription; what comes here is each worker's
presence, its claims (a result it checked and holds, without the tensors) and its partial
sums. A claim is sorted by the result intake like the result itself; the worker is told
``ack`` (fold it) only for a result the intake grants. Each exchange has a retained
manifest (its tasks, the network, the codec, the broadcast) published before the tasks;
published again with ``flush``, it asks the workers for what they folded, and a partial
sum is merged only when its receipts name tasks granted to its worker, once, with their
total weight, and its tensors have the expected names, shapes and dtype.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from coordinator.runtime.intake import Claim, ResultIntake, one_torch_thread
from coordinator.runtime.presence import PRESENCE_BYTES
from coordinator.runtime.round_book import Network, RoundBook
from coordinator.strategies.base import AggregationError, TaskPlan, WeightedSum
from edge_client.wire.codec import CodecSpec
from edge_client.wire.protocol import (ClaimBody, ManifestBody, PartialBody, PresenceBody, ProtocolError, Topics,
                                       check_tensors, decode, encode, valid_client_id)
from edge_client.wire.throttle import ThrottledLog
from edge_client.wire.transport import Incoming

if TYPE_CHECKING:
    from coordinator.config import RunConfig
    from coordinator.runtime.outbox import Outbox

__all__ = ["WorkerExchange"]

log = logging.getLogger("fedge.coordinator")

Wait = Callable[[float, Callable[[], bool]], None]   # handle messages until the deadline or the condition holds


class WorkerExchange:
    """Workers online, the exchange's manifest, claims and partial sums."""

    def __init__(self, config: RunConfig, *, outbox: Outbox, topics: Topics, intake: ResultIntake,
                 network: Callable[[], Network], warn: ThrottledLog, wait: Wait) -> None:
        self.config = config
        self.outbox = outbox
        self.topics = topics
        self.intake = intake
        self.network = network
        self.online: set[str] = set()   # aggregation workers, by id
        self._warn = warn
        self._wait = wait

    def on_message(self, worker: str, kind: str, incoming: Incoming) -> None:
        """A message from an aggregation worker: its presence, a claim on a result it checked, or a partial sum."""
        if incoming.error:
            self._warn.warning("lost a message from worker %s: %s", worker, incoming.error)
        elif kind == "presence" and incoming.payload:
            self._on_presence(worker, incoming.payload)
        elif kind == "claim" and incoming.payload:
            self.on_claim(worker, incoming.payload)
        elif kind == "partial" and incoming.payload:
            with one_torch_thread():
                self.on_partial(worker, incoming.payload)

    def _on_presence(self, worker: str, payload: bytes) -> None:
        try:
            msg = decode(payload, max_bytes=PRESENCE_BYTES)
            online = msg.sender == worker and PresenceBody.from_body(msg.body).state == "online"
        except ProtocolError as exc:
            self._warn.warning("ignored presence of worker %s: %s", worker, exc)
            return
        if online and worker not in self.online:
            log.info("aggregation worker %s online", worker)
        elif not online and worker in self.online:
            log.warning("aggregation worker %s went offline", worker)
        (self.online.add if online else self.online.discard)(worker)

    def on_claim(self, worker: str, payload: bytes) -> None:
        """A worker checked a result and holds it: grant it (the worker folds it) or not (it drops it)."""
        try:
            msg = decode(payload, max_bytes=PRESENCE_BYTES)
            if not valid_client_id(msg.sender):
                raise ProtocolError(f"sender {msg.sender!r} is not a client id")
            claim = ClaimBody.from_body(msg.body)
        except ProtocolError as exc:
            self._warn.warning("ignored a claim from worker %s: %s", worker, exc)
            return
        granted = self.intake.on_claim(msg, Claim(worker, claim))
        self.outbox.status(self.topics.worker(worker, "status"), self.intake.book.round, msg.task_id,
                           "ack" if granted else "rejected")

    def on_partial(self, worker: str, payload: bytes) -> None:
        """Merge a worker's partial sum after checking its receipts against what it was granted."""
        book = self.intake.book
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
            # Under differential privacy (the tasks carry a clip norm) every result weighs 1, whatever its samples.
            equal = book.manifest.clip_norm is not None
            weight = len(results) if equal else sum(r.num_samples for r in results)
            if not math.isclose(body.weight, weight, rel_tol=1e-12):
                raise ProtocolError(f"its weight {body.weight} is not the {weight} "
                                    f"{'results' if equal else 'samples'} of its receipts")
            shapes = self.network().shapes
            check_tensors(msg.tensors, {k: shapes[k] for k in book.manifest.up}, torch.float64)
            partial = WeightedSum(dict(msg.tensors), float(body.weight))
            book.partial = partial if book.partial is None else book.partial + partial
        except (ProtocolError, AggregationError) as exc:
            self._warn.warning("ignored a partial sum from worker %s: %s", worker, exc)
            return
        for task_id, result in zip(body.tasks, results):
            del book.granted[task_id]
            book.results[result.client_id] = result

    def open(self, book: RoundBook, plans: Sequence[TaskPlan], task_ids: Sequence[str], codec: CodecSpec,
             broadcast: str | None) -> None:
        """The exchange's manifest, published before its tasks so the workers know them before any result."""
        book.manifest = ManifestBody(uuid.uuid4().hex[:16], book.phase, self.network().spec, tuple(plans[0].up),
                                     codec, {t: p.client_id for t, p in zip(task_ids, plans)}, broadcast,
                                     clip_norm=plans[0].clip_norm, noise_multiplier=plans[0].noise_multiplier)
        self.publish_manifest(book)

    def publish_manifest(self, book: RoundBook) -> None:
        """The exchange's manifest (retained), if it has one; also after a reconnect, for a broker that forgot it."""
        if book.manifest is not None:
            self.outbox.publish(self.topics.manifest, encode("manifest", run_id=self.outbox.run_id, round=book.round,
                                                             task_id="", sender="coordinator",
                                                             body=book.manifest.to_body()), retain=True)

    def collect(self, book: RoundBook) -> None:
        """Ask the workers for what they folded and wait for it; results that never come are lost."""
        if book.manifest is None or not book.granted:
            return
        book.manifest = dataclasses.replace(book.manifest, flush=True)
        self.publish_manifest(book)
        self._wait(time.monotonic() + self.config.workers.flush_timeout, lambda: not book.granted)
        if book.granted:
            held = sorted({worker for worker, _ in book.granted.values()})
            log.warning("round %d: %d result(s) folded by worker(s) %s never arrived within workers.flush_timeout "
                        "(%.0f s); the round goes on without them", book.round, len(book.granted), ", ".join(held),
                        self.config.workers.flush_timeout)
            book.tally.worker_lost += len(book.granted)
            book.granted.clear()
