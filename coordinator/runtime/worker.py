"""An aggregation worker: takes a share of the devices' results off the coordinator.

Workers subscribe to every device's result topic through one MQTT 5 shared subscription
(``$share/GROUP/PREFIX/clients/+/result``), so the broker hands each result to one of
them. A worker decodes and checks its result exactly as the coordinator would
(:func:`coordinator.runtime.intake.accept_result`, against the exchange's manifest and model
broadcast), then *claims* it: it sends the coordinator the result without its tensors
(sample count, metrics, profile, or the reason it is unusable). The coordinator sorts
the claim like any result (late, duplicate, unexpected, failed...) and answers: granted,
and the worker folds the tensors into its partial sum (weighted sum, weight), or not,
and the worker drops them. Granting is what keeps a result that a device sent twice, and
the broker handed to two workers, from being counted twice. When the coordinator asks
(the manifest's ``flush``), each worker publishes its partial sum with the receipts of the
tasks inside; the coordinator checks the receipts and the weight and adds the sums.

Nothing here is Mosquitto-specific: shared subscriptions are standard MQTT 5, so workers
run unchanged against a clustered broker. A shared subscription hands out each MQTT
message on its own, so results must arrive unchunked (``transport.max_message_bytes`` of
the devices above the result's size) or every worker would get only some chunks of a
result (docs/scale.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from coordinator.config import RunConfig
from coordinator.runtime.intake import accept_result, one_torch_thread
from coordinator.strategy_setup import make_strategy
from coordinator.strategies.base import ClientResult, Strategy, TaskPlan
from edge_client.bundle import Bundle
from edge_client.client import presence_payload
from edge_client.models import state_shapes
from edge_client.registry import build_aside
from edge_client.wire.chunking import ChunkingTransport
from edge_client.wire.codec import SEP
from edge_client.wire.protocol import (ClaimBody, ContentError, ManifestBody, Message, ModelBody, PartialBody,
                                       PresenceBody, ProtocolError, ResultBody, StatusBody, Topics, decode, encode)
from edge_client.wire.throttle import ThrottledLog
from edge_client.wire.transport import BrokerSettings, MqttTransport, Transport, TransportError, Will
from edge_client.wire.updates import decode_download

__all__ = ["AggregationWorker", "default_worker_id", "serve_worker"]

log = logging.getLogger("fedge.worker")
_KEEP_BROADCASTS = 2
_LATE_BATCH_S = 0.5   # longest a grant that came after the flush waits for others to share its partial sum


def default_worker_id() -> str:
    """``worker-HOST-PID``, cut to a valid id (it is a topic level)."""
    host = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in socket.gethostname())[:40]
    return f"worker-{host}-{os.getpid()}"


@dataclass
class _Exchange:
    """The exchange the coordinator's manifest names, and what this worker folded of it."""

    manifest: ManifestBody
    run_id: str
    round: int
    partial: Any = None                 # the strategy's partial aggregate of the granted results
    receipts: list[str] | None = None   # tasks folded into ``partial``
    flushed: bool = False               # asked for the partial: later grants go out together, soon
    late_since: float | None = None     # when the first grant after the flush was folded


class AggregationWorker:
    """Checks and folds the results the broker hands it; see the module docstring for the exchange."""

    def __init__(self, config: RunConfig, transport: Transport, worker_id: str) -> None:
        t = config.transport
        self.config = config
        self.worker_id = worker_id
        self.topics = Topics(t.prefix)
        self.transport = ChunkingTransport(transport, max_message_bytes=t.max_message_bytes,
                                           max_decoded_bytes=t.max_decoded_bytes, chunking=t.chunking)
        self.strategy: Strategy = make_strategy(config)
        self.exchange: _Exchange | None = None
        self.pending: dict[str, ClientResult] = {}            # claimed, not yet granted: task id -> result
        self.broadcasts: dict[str, dict[str, torch.Tensor]] = {}   # model broadcasts by SHA-256, newest last
        self._shapes: tuple[str, dict[str, tuple[int, ...]]] = ("", {})
        self._warn = ThrottledLog(log)
        self.finished = False                  # a run this worker served was announced finished
        self._served: set[str] = set()        # runs whose manifest this worker read
        self.stats = {"claimed": 0, "folded": 0, "dropped": 0, "partials": 0, "unusable": 0, "bytes_received": 0}

    def start(self) -> None:
        """Subscribe and say we are here (retained; the last will says when we are not)."""
        for topic in (self.topics.manifest, self.topics.coordinator_status):
            self.transport.subscribe(topic)
        self.transport.subscribe(self.topics.model, parts=True)
        self.transport.subscribe(self.topics.worker(self.worker_id, "status"))
        self.transport.subscribe(self.topics.shared_results(self.config.workers.group))
        # Verdicts first: a grant waiting behind a backlog of results keeps a decoded model in ``pending``
        # (a worker with 1,000 results queued held 1.7 GB that way).
        self.transport.prefer([self.topics.worker(self.worker_id, "status"), self.topics.manifest])
        self.transport.announce(self.topics.worker(self.worker_id, "presence"),
                                presence_payload(self.worker_id, PresenceBody("online")))

    def run(self, stop: threading.Event | None = None, *, exit_after_run: bool = False) -> None:
        """Handle messages until ``stop`` is set (or the run finishes, with ``exit_after_run``)."""
        stop = stop or threading.Event()
        while not stop.is_set() and not (exit_after_run and self.finished):
            self._warn.flush()
            incoming = self.transport.get(0.2)
            try:
                if incoming is not None:
                    self._handle(incoming)
                self._send_late(quiet=incoming is None)
            except TransportError as exc:
                log.error("could not publish: %s", exc)

    def close(self) -> None:
        self.transport.publish(self.topics.worker(self.worker_id, "presence"),
                               presence_payload(self.worker_id, PresenceBody("offline")), retain=True)
        self.transport.close()

    # -- messages ----------------------------------------------------------------------
    def _handle(self, incoming: Any) -> None:
        topic = incoming.topic
        if self.topics.client_of(topic) is not None:   # a device's result, our share of them
            self.stats["bytes_received"] += incoming.wire_bytes or len(incoming.payload)
            if incoming.error:
                self._warn.warning("lost a result on %s: %s. If results come in chunks, a shared subscription "
                                   "spreads their chunks over the workers: raise the devices' max_message_bytes "
                                   "above a result's size (docs/scale.md)", topic, incoming.error)
            elif incoming.payload:
                with one_torch_thread():
                    self._on_result(self.topics.client_of(topic), incoming)
            return
        if incoming.error or not incoming.payload:
            if incoming.error:
                self._warn.warning("lost a message on %s: %s", topic, incoming.error)
            return
        try:
            if topic == self.topics.manifest:
                self._on_manifest(decode(incoming.payload, max_bytes=self.config.transport.max_decoded_bytes))
            elif topic == self.topics.model:
                self._on_broadcast(incoming.payload)
            elif topic == self.topics.coordinator_status:   # retained: an older run's "finished" is no news
                status = decode(incoming.payload)
                self.finished = (StatusBody.from_body(status.body).state == "finished"
                                 and status.run_id in self._served)
            elif topic == self.topics.worker(self.worker_id, "status"):
                self._on_verdict(decode(incoming.payload))
        except ProtocolError as exc:
            self._warn.warning("ignored a message on %s: %s", topic, exc)

    def _on_manifest(self, msg: Message) -> None:
        if msg.kind != "manifest" or msg.sender != "coordinator":
            raise ProtocolError(f"a {msg.kind} from {msg.sender} on the manifest topic")
        manifest = ManifestBody.from_body(msg.body)
        self._served.add(msg.run_id)
        current = self.exchange
        if current is None or current.manifest.exchange != manifest.exchange:
            if current is not None and current.receipts and not current.flushed:
                log.warning("exchange %s ended before its partial sum was asked for: dropped %d folded result(s)",
                            current.manifest.exchange, len(current.receipts))
            self.exchange = _Exchange(manifest, msg.run_id, msg.round)
            self.pending.clear()
        else:
            self.exchange.manifest = manifest
        if manifest.flush and not self.exchange.flushed:
            self.exchange.flushed = True
            self._send_partial()

    def _on_broadcast(self, payload: bytes) -> None:
        msg = decode(payload, max_bytes=self.config.transport.max_decoded_bytes)
        if msg.kind != "model" or msg.sender != "coordinator":
            raise ProtocolError(f"a {msg.kind} from {msg.sender} on the model topic")
        shapes = {k: tuple(v.shape) for k, v in msg.tensors.items() if SEP not in k}   # dense: values as shaped
        self.broadcasts[hashlib.sha256(payload).hexdigest()] = decode_download(
            msg.tensors, ModelBody.from_body(msg.body).codec, shapes)
        while len(self.broadcasts) > _KEEP_BROADCASTS:
            self.broadcasts.pop(next(iter(self.broadcasts)))

    def _network_shapes(self, spec: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        key = json.dumps(spec, sort_keys=True)
        if key != self._shapes[0]:
            self._shapes = (key, state_shapes(build_aside(spec)))
        return self._shapes[1]

    def _on_result(self, client_id: str, incoming: Any) -> None:
        """Check a device's result against the manifest and claim it (without its tensors)."""
        unreadable = ""
        try:
            msg = decode(incoming.payload, max_bytes=self.config.transport.max_decoded_bytes)
        except ContentError as exc:   # a sound header: claimed as unusable, so the coordinator tells the device why
            msg, unreadable = exc.head, str(exc)
        except ProtocolError as exc:   # not even an envelope: nothing to claim, the coordinator never hears of it
            self.stats["unusable"] += 1
            self._warn.warning("ignored a result on %s: %s", incoming.topic, exc)
            return
        if msg.kind != "result" or msg.sender != client_id:
            self.stats["unusable"] += 1
            self._warn.warning("ignored a %s from %s on %s's result topic", msg.kind, msg.sender, client_id)
            return
        exchange, problem, held = self.exchange, "", False
        manifest = exchange.manifest if exchange is not None else None
        if manifest is not None and manifest.tasks.get(msg.task_id) == client_id and msg.run_id == exchange.run_id:
            try:
                if unreadable:
                    raise ProtocolError(unreadable)
                result = self._accept(manifest, client_id, msg)
            except ProtocolError as exc:
                problem = str(exc)
            except _NoBroadcast:
                self._warn.warning("result for task %s came before the model broadcast %s; waiting for a re-send",
                                   msg.task_id, (manifest.broadcast or "")[:16])
                return
            else:
                if result is not None:
                    self.pending[msg.task_id] = result
                    held = True
        claim = ClaimBody(problem, held, incoming.wire_bytes or len(incoming.payload))
        body = {**msg.body, **claim.to_body()}
        self.transport.publish(self.topics.worker(self.worker_id, "claim"),
                               encode("result", run_id=msg.run_id, round=msg.round, task_id=msg.task_id,
                                      sender=client_id, body=body))
        self.stats["claimed"] += 1

    def _accept(self, manifest: ManifestBody, client_id: str, msg: Message) -> ClientResult | None:
        """The checked result (None for a device's error, which the coordinator reads from the claim)."""
        body = ResultBody.from_body(msg.body)
        if body.error is not None:
            return None
        down: dict[str, torch.Tensor] = {}
        if manifest.broadcast is not None:
            if manifest.broadcast not in self.broadcasts:
                raise _NoBroadcast()
            down = self.broadcasts[manifest.broadcast]
        plan = TaskPlan(client_id=client_id, objective=manifest.phase, hyper={}, down=down, up=list(manifest.up),
                        clip_norm=manifest.clip_norm, noise_multiplier=manifest.noise_multiplier)
        return accept_result(plan, msg, body, self._network_shapes(manifest.model), manifest.codec, self.strategy,
                             manifest.model)

    def _on_verdict(self, msg: Message) -> None:
        """The coordinator granted a claim (fold it) or not (drop it)."""
        if msg.kind != "status" or msg.sender != "coordinator":
            raise ProtocolError(f"a {msg.kind} from {msg.sender} on this worker's status topic")
        verdict = StatusBody.from_body(msg.body)
        result = self.pending.pop(msg.task_id, None)
        if result is None or self.exchange is None:
            return
        if verdict.state != "ack":
            self.stats["dropped"] += 1
            return
        exchange = self.exchange
        with one_torch_thread():
            exchange.partial = self.strategy.fold(exchange.manifest.phase, exchange.partial, result)
        exchange.receipts = (exchange.receipts or []) + [msg.task_id]
        self.stats["folded"] += 1
        if exchange.flushed and exchange.late_since is None:   # the coordinator is already collecting
            exchange.late_since = time.monotonic()

    def _send_late(self, quiet: bool) -> None:
        """Send what was granted after the flush once no message waits or half a second has passed.

        Grants and the flush travel on different topics, so a few grants often come just after
        it; each sent at once would be a partial sum of its own, a model's size in float64 (a
        site aggregator sent 16 partials in 3 rounds that way, over its site's uplink)."""
        exchange = self.exchange
        if exchange is None or exchange.late_since is None:
            return
        if quiet or time.monotonic() - exchange.late_since >= _LATE_BATCH_S:
            self._send_partial()

    def _send_partial(self) -> None:
        exchange = self.exchange
        if exchange is None or not exchange.receipts:
            return
        partial = exchange.partial
        body = PartialBody(exchange.manifest.exchange, partial.weight, tuple(exchange.receipts))
        payload = encode("partial", run_id=exchange.run_id, round=exchange.round, task_id="", sender=self.worker_id,
                         body=body.to_body(), tensors=dict(partial.sums))
        self.transport.publish(self.topics.worker(self.worker_id, "partial"), payload)
        self.stats["partials"] += 1
        exchange.partial, exchange.receipts, exchange.late_since = None, None, None


class _NoBroadcast(Exception):
    """The manifest's model broadcast has not arrived yet."""


def serve_worker(config: RunConfig, worker_id: str, *, exit_after_run: bool = False,
                 stop: threading.Event | None = None, say: Any = print, bundle: Bundle | None = None,
                 metrics: tuple[str, int] | None = None) -> dict[str, int]:
    """Connect to the run's broker as aggregation worker ``worker_id`` and serve until stopped; the counts.

    ``bundle``: a site aggregator's bundle (``fedge-coordinator provision --sites``): the password and CA
    come from it, so a worker on a site machine needs no secret in its environment; the caller has put
    its broker, user name and prefix into ``config``.
    ``metrics``: (host, port) to serve the worker's counters at for Prometheus (coordinator/telemetry.py)."""
    t = config.transport
    password, source = os.environ.get(t.password_env), t.password_env
    if bundle is not None and bundle.password:
        password, source = bundle.password, "the aggregator bundle"
    tls = t.broker.startswith("mqtts:")
    ca_data = bundle.ca_cert if bundle is not None and bundle.ca_cert and tls and not t.ca_file else None
    settings = BrokerSettings(url=t.broker, username=t.username or None, password=password,
                              protocol=t.protocol, max_message_bytes=t.max_message_bytes,
                              ca_file=t.ca_file or None, ca_data=ca_data, cert_file=t.cert_file or None,
                              key_file=t.key_file or None,
                              session_expiry=0,   # no session outlives us: the broker stops handing us results
                              password_source=source)
    topics = Topics(t.prefix)
    will = Will(topics.worker(worker_id, "presence"), presence_payload(worker_id, PresenceBody("offline")))
    # No flow control here: a worker's verdicts and the flush come on its own session, and held back by the
    # broker behind a window of results they arrived late (measured with one worker and 1,000 fp32 results a
    # round: results granted but never flushed within workers.flush_timeout, 2.7 GB waiting for verdicts).
    transport = MqttTransport(settings, f"fedge-{worker_id}", will=will).connect()
    worker = AggregationWorker(config, transport, worker_id)
    server = None
    try:
        if metrics is not None:
            from coordinator.telemetry import MetricsServer, WorkerTelemetry

            server = MetricsServer(WorkerTelemetry(worker.worker_id, worker.stats).registry, *metrics)
            say(f"serving metrics at {server.url}")
        worker.start()
        say(f"aggregation worker {worker_id} on {t.broker}, shared subscription group {config.workers.group!r}")
        worker.run(stop, exit_after_run=exit_after_run)
    finally:
        worker.close()
        if server is not None:
            server.close()
    return worker.stats
