"""The edge client loop: announce, take tasks, train, send results until acknowledged.

The loop is transport-agnostic (MQTT on a device, in-process in simulations) and
never trusts what it receives: every task is decoded and checked before use, and
a bad one is answered with a rejection instead of an exception. A task may
reference the round's model broadcast by its hash: the client then fetches it
(subscribing to the retained model topic) only when it does not hold it already.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

from edge_client.wire.chunking import DEFAULT_PACKET_BYTES, ChunkingTransport
from edge_client.wire.codec import parse_codec
from edge_client.models import ModelSpecError, federated_names, state_shapes
from edge_client.registry import OBJECTIVES, build_model
from edge_client.objectives import LocalData, ObjectiveError, TaskContext, shuffle_seed, warm_up
from edge_client.wire.protocol import DEFAULT_MAX_MESSAGE_BYTES, Message, ProtocolError, Topics, decode, encode
from edge_client.wire.transport import MessageTooLarge, Transport, TransportError, Will
from edge_client.wire.updates import ResidualStore, UploadSettings, decode_download, encode_upload
from profiling.device import device_facts
from profiling.history import append_history
from profiling.profiler import Profiler

__all__ = ["ClientSettings", "EdgeClient", "presence_payload"]

log = logging.getLogger("fedge.client")


@dataclass(frozen=True)
class ClientSettings:
    client_id: str
    topics: Topics = field(default_factory=Topics)
    state_dir: Path | None = None
    max_message_bytes: int = DEFAULT_PACKET_BYTES          # largest publish; longer messages go in chunks
    max_decoded_bytes: int = DEFAULT_MAX_MESSAGE_BYTES     # largest whole message accepted
    chunking: bool = True
    exit_after_run: bool = False     # leave once a run we took part in finishes
    parent_pid: int | None = None    # leave when this process is gone (spawned simulations)


def presence_payload(client_id: str, state: str, **body: Any) -> bytes:
    return encode("presence", run_id="", round=0, task_id="", sender=client_id, body={"state": state, **body})


def _seconds(value: Any, default: float) -> float:
    """A duration from a task body; anything but a finite positive number means the default."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")
    return float(value) if ok else default


@dataclass
class _Pending:
    """A result sent but not yet acknowledged; re-sent until ack or give-up time."""

    run_id: str
    round: int
    task_id: str
    payload: bytes
    give_up_at: float
    resend_every: float
    next_send_at: float = 0.0


class EdgeClient:
    """Runs tasks for a coordinator on this device's private data."""

    def __init__(self, settings: ClientSettings, transport: Transport, data: LocalData) -> None:
        self.settings = settings
        self.transport = ChunkingTransport(transport, max_message_bytes=settings.max_message_bytes,
                                           max_decoded_bytes=settings.max_decoded_bytes, chunking=settings.chunking)
        self.data = data
        self.topics = settings.topics
        self._models: dict[str, nn.Module] = {}
        self._pending: _Pending | None = None
        self._done: dict[str, bytes] = {}          # task id -> result payload, for re-sends
        self._latest_round: dict[str, int] = {}    # run id -> newest round the coordinator announced
        self._runs_seen: set[str] = set()
        self._finished = False
        self._previous_send: dict[str, Any] = {}   # encode/publish times of the last result, for the next
        self._broadcasts: OrderedDict[str, Message] = OrderedDict()   # model messages by SHA-256, newest last
        self._waiting: tuple[Message, Profiler, float] | None = None   # a task waiting for its broadcast
        self._residuals = ResidualStore(settings.state_dir)
        self.tasks_run = 0

    @staticmethod
    def will(settings: ClientSettings) -> Will:
        return Will(settings.topics.client(settings.client_id, "presence"),
                    presence_payload(settings.client_id, "offline"))

    # -- main loop ------------------------------------------------------------
    def run(self, stop: threading.Event | None = None) -> None:
        cid = self.settings.client_id
        for kind in ("task", "status"):
            self.transport.subscribe(self.topics.client(cid, kind))
        self.transport.subscribe(self.topics.coordinator_status)
        warm_up()   # before announcing: the first task's time should be the task's own
        sample = self.data.x[:1]
        self.transport.announce(self.topics.client(cid, "presence"), presence_payload(
            cid, "online", num_samples=len(self.data), input_shape=list(sample.shape[1:]),
            num_classes=int(self.data.y.max()) + 1 if len(self.data) else 0, device=device_facts()))
        log.info("client %s online with %d samples", cid, len(self.data))
        while not self._finished and not (stop is not None and stop.is_set()):
            if self.settings.parent_pid and not psutil.pid_exists(self.settings.parent_pid):
                log.info("parent process %d is gone; leaving", self.settings.parent_pid)
                break
            incoming = self.transport.get(0.2)
            if incoming is not None and incoming.error:
                log.warning("lost a message on %s: %s", incoming.topic, incoming.error)
            elif incoming is not None and incoming.payload:
                self._handle(incoming.topic, incoming.payload, incoming.received_at)
            self._give_up_waiting()
            self._resend_if_due()
        self.transport.publish(self.topics.client(cid, "presence"), presence_payload(cid, "offline"), retain=True)

    def _handle(self, topic: str, payload: bytes, received_at: float | None = None) -> None:
        taken_up, started = time.monotonic(), time.perf_counter()
        if topic == self.topics.model:
            self._on_model(payload)
            return
        try:
            msg = decode(payload, max_bytes=self.settings.max_decoded_bytes)
        except ProtocolError as exc:
            log.warning("ignored a message on %s: %s", topic, exc)
            return
        if topic == self.topics.coordinator_status:
            self._on_coordinator_status(msg)
        elif msg.kind == "task" and topic == self.topics.client(self.settings.client_id, "task"):
            profiler = Profiler(started=started)
            if received_at is not None:   # how long the task waited on this device before we took it up
                profiler.add("receive", max(0.0, taken_up - received_at))
            profiler.add("decode", time.perf_counter() - started)
            self._on_task(msg, profiler)
        elif msg.kind == "status":
            self._on_status(msg)

    def _on_coordinator_status(self, msg: Message) -> None:
        state = msg.body.get("state")
        if state == "running":
            self._runs_seen.add(msg.run_id)
            self._latest_round[msg.run_id] = max(self._latest_round.get(msg.run_id, 0), msg.round)
        elif state == "finished" and msg.run_id in self._runs_seen:
            log.info("run %s finished", msg.run_id)
            self._pending = None
            if self.settings.exit_after_run:
                self._finished = True

    def _on_status(self, msg: Message) -> None:
        task_id = msg.body.get("task_id")
        if self._pending is not None and task_id == self._pending.task_id:
            if msg.body.get("state") == "rejected":
                log.warning("coordinator rejected result of %s: %s", task_id, msg.body.get("reason"))
            self._pending = None

    # -- the model broadcast ----------------------------------------------------
    def _on_model(self, payload: bytes) -> None:
        digest = hashlib.sha256(payload).hexdigest()
        try:
            msg = decode(payload, max_bytes=self.settings.max_decoded_bytes)
        except ProtocolError as exc:
            log.warning("ignored a model broadcast: %s", exc)
            return
        if msg.kind != "model":
            return
        self._broadcasts[digest] = msg
        while len(self._broadcasts) > 2:   # the current model and the one before are enough
            self._broadcasts.popitem(last=False)
        if self._waiting is not None and self._waiting[0].body.get("broadcast") == digest:
            task, profiler, since = self._waiting
            self._stop_waiting()
            profiler.add("fetch_model", time.monotonic() - since)
            self._on_task(task, profiler)

    def _needs_broadcast(self, msg: Message, profiler: Profiler) -> bool:
        """Park a task whose broadcast is not here yet and fetch it (the retained model topic)."""
        digest = msg.body.get("broadcast")
        if not digest or digest in self._broadcasts:
            self._stop_waiting()
            return False
        if self._waiting is None:
            self.transport.subscribe(self.topics.model, parts=True)
        self._waiting = (msg, profiler, time.monotonic())
        return True

    def _stop_waiting(self) -> None:
        if self._waiting is not None:
            self._waiting = None
            self.transport.unsubscribe(self.topics.model, parts=True)

    def _give_up_waiting(self) -> None:
        """A task whose broadcast never came is answered with an error at its timeout."""
        if self._waiting is None:
            return
        task, profiler, since = self._waiting
        if time.monotonic() - since > _seconds(task.body.get("timeout"), 600.0):
            self._stop_waiting()
            self._on_task(task, profiler, wait=False)

    # -- tasks ----------------------------------------------------------------
    def _on_task(self, msg: Message, profiler: Profiler | None = None, *, wait: bool = True) -> None:
        self._runs_seen.add(msg.run_id)
        if msg.task_id in self._done:  # the coordinator asked again: it missed our result
            self._send(msg, self._done[msg.task_id])
            return
        if msg.round < self._latest_round.get(msg.run_id, 0):
            log.info("skipped stale task %s for round %d", msg.task_id, msg.round)
            return
        self._latest_round[msg.run_id] = msg.round
        profiler = Profiler() if profiler is None else profiler
        if wait and self._needs_broadcast(msg, profiler):
            return
        try:
            tensors, output, fields = self._execute(msg, profiler)
            body = {"num_samples": output.num_samples, "metrics": output.metrics, **fields}
        except (ObjectiveError, ModelSpecError, ProtocolError) as exc:
            log.warning("task %s failed: %s", msg.task_id, exc)
            tensors, body = {}, {"error": str(exc)}
        except Exception as exc:  # a task must never take the device's client down
            log.exception("task %s failed unexpectedly", msg.task_id)
            tensors, body = {}, {"error": f"{type(exc).__name__}: {exc}"}
        # Encoding and publishing come after the profile is sealed into the result, so
        # their times travel with the next result, as `previous_send`.
        body["profile"] = {**profiler.summary(), **self._previous_send}
        with profiler.phase("encode"):
            payload = encode("result", run_id=msg.run_id, round=msg.round, task_id=msg.task_id,
                             sender=self.settings.client_id, body=body, tensors=tensors)
            payload = parse_codec(body["codec"]).compress(payload) if "codec" in body else payload
        try:
            self.transport.check_size(payload)
        except MessageTooLarge as exc:   # tell the coordinator now rather than let its round time out
            log.warning("task %s: %s", msg.task_id, exc)
            payload = encode("result", run_id=msg.run_id, round=msg.round, task_id=msg.task_id,
                             sender=self.settings.client_id, body={"error": str(exc), "profile": body["profile"]})
        self._done = {msg.task_id: payload}
        with profiler.phase("publish"):
            self._send(msg, payload)
        sent = {"task_id": msg.task_id, **{k: profiler.phases[k] for k in ("encode", "publish")}}
        self._previous_send = {"previous_send": sent}
        self.tasks_run += 1
        self._write_profile(msg, {**body["profile"], "phases": profiler.phases})

    def _execute(self, msg: Message, profiler: Profiler) -> tuple[dict[str, torch.Tensor], Any, dict[str, Any]]:
        """Run the task; return the wire tensors, the objective's output and the result's codec fields."""
        body = msg.body
        objective = OBJECTIVES.get(body.get("objective"))
        if objective is None:
            raise ObjectiveError(f"unknown objective {body.get('objective')!r}; this client knows {sorted(OBJECTIVES)}")
        with profiler.phase("decode"):
            model = self._model_for(body.get("model"))
            self._check_data_fits(body["model"])
            up = body.get("up")
            known = set(federated_names(model))
            if not isinstance(up, list) or not all(isinstance(n, str) for n in up):
                raise ProtocolError("the task's 'up' must be a list of tensor names")
            upload = UploadSettings.from_body(body)
            received = self._received(msg, state_shapes(model))
            model.load_state_dict(received, strict=False)
        ctx = TaskContext(seed=shuffle_seed(int(body.get("seed", 0)), msg.round, self.settings.client_id),
                          round=msg.round, client_id=self.settings.client_id, state_dir=self.settings.state_dir,
                          profiler=profiler)
        with profiler.phase("train"):
            output = objective(model, self.data, body.get("hyper", {}), ctx)
        if output.tensors is not None:
            if sorted(output.tensors) != sorted(up):
                raise ProtocolError(f"objective produced {sorted(output.tensors)[:5]}, the task asked for {up[:5]}")
            tensors, raw_only = output.tensors, True
        elif not set(up) <= known:
            raise ProtocolError(f"the task asks for parameters this model does not have: {sorted(set(up) - known)[:5]}")
        else:
            state = model.state_dict()
            tensors, raw_only = {name: state[name].detach().clone() for name in up}, False
        with profiler.phase("codec"):
            wire, fields = encode_upload(tensors, received, upload, self._residuals, msg.run_id, raw_only=raw_only,
                                         generator=torch.Generator().manual_seed(ctx.seed))
        return wire, output, fields

    def _received(self, msg: Message, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """The task's tensors plus its broadcast's, decoded to float32 and checked against the model."""
        tensors = {}
        digest = msg.body.get("broadcast")
        if digest:
            shared = self._broadcasts.get(digest)
            if shared is None:
                raise ProtocolError(f"the model broadcast {str(digest)[:16]}... did not arrive within the task's "
                                    "timeout; check that this device may read the coordinator's model topic")
            tensors.update(decode_download(shared.tensors, shared.body, shapes))
        tensors.update(decode_download(msg.tensors, msg.body, shapes))
        return tensors

    def _model_for(self, spec: Any) -> nn.Module:
        key = json.dumps(spec, sort_keys=True)
        if key not in self._models:
            self._models = {key: build_model(spec)}  # keep one: a device has little memory
        return self._models[key]

    def _check_data_fits(self, spec: dict[str, Any]) -> None:
        c, h = int(self.data.x.shape[1]), int(self.data.x.shape[2])
        if (c, h) != (spec["in_channels"], spec["image_size"]):
            raise ObjectiveError(f"model expects {spec['in_channels']}x{spec['image_size']}x{spec['image_size']} "
                                 f"inputs but this device's data is {c}x{h}x{self.data.x.shape[3]}")
        if len(self.data) and int(self.data.y.max()) >= spec["num_classes"]:
            raise ObjectiveError(f"this device has label {int(self.data.y.max())} but the model has "
                                 f"{spec['num_classes']} classes")

    def _send(self, task: Message, payload: bytes) -> None:
        body = task.body
        now = time.monotonic()
        self._pending = _Pending(task.run_id, task.round, task.task_id, payload,
                                 give_up_at=now + _seconds(body.get("timeout"), 600.0),
                                 resend_every=max(0.5, _seconds(body.get("resend_every"), 10.0)))
        self._resend_if_due()

    def _resend_if_due(self) -> None:
        p = self._pending
        if p is None:
            return
        now = time.monotonic()
        if now > p.give_up_at or p.round < self._latest_round.get(p.run_id, 0):
            self._pending = None
            return
        if now >= p.next_send_at:
            try:
                self.transport.publish(self.topics.client(self.settings.client_id, "result"), p.payload)
            except TransportError as exc:
                log.warning("could not send result of %s: %s", p.task_id, exc)
                self._pending = None
                return
            p.next_send_at = now + p.resend_every

    def _write_profile(self, task: Message, profile: dict[str, Any]) -> None:
        if self.settings.state_dir is None:
            return
        record = {"run_id": task.run_id, "round": task.round, "task_id": task.task_id,
                  "objective": task.body.get("objective"), **profile}
        record.pop("previous_send", None)   # this line already has its own encode and publish times
        append_history(self.settings.state_dir, "task", record)
