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
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

from edge_client.wire.chunking import DEFAULT_PACKET_BYTES, ChunkingTransport
from edge_client.wire.codec import CodecSpec
from edge_client.models import ModelSpecError, federated_names, state_shapes
from edge_client.registry import OBJECTIVES, build_model
from edge_client.device import GpuMeter
from edge_client.inputs import for_model
from edge_client.objectives import LocalData, Objective, ObjectiveError, TaskContext, shuffle_seed, warm_up
from edge_client.wire.protocol import (DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_RESEND_EVERY, DEFAULT_TASK_TIMEOUT, Message,
                                       ModelBody, PresenceBody, ProtocolError, ResultBody, StatusBody, TaskBody,
                                       Topics, decode, encode)
from edge_client.wire.transport import MessageTooLarge, Transport, TransportError, Will
from edge_client.wire.updates import ResidualStore, decode_download, encode_upload
from profiling.device import device_facts
from profiling.history import append_history
from profiling.profiler import Profiler
from profiling.units import human_bytes

__all__ = ["BroadcastCache", "ClientSettings", "EdgeClient", "ModelCache", "presence_payload"]

log = logging.getLogger("fedge.client")
BROADCAST_PATIENCE = 0.5   # share of a task's timeout spent waiting for its model broadcast
# One line per task, on connecting and at a run's end: what a person at the device sees without -v.
activity = logging.getLogger("fedge.client.activity")


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
    presence_echo_timeout: float = 10.0   # our own presence must come back from the broker within this
    device: str = "cpu"              # torch device the model and data live on (edge_client.device.resolve_device)
    # Objectives this client runs instead of the registry's of the same name: the extension point for a
    # simulated device that behaves otherwise (a hostile one in a robustness benchmark, an experiment).
    objectives: Mapping[str, Objective] = field(default_factory=dict)


def _task_line(msg: Message, task: TaskBody | None, answer: ResultBody, wire_bytes: int) -> str:
    """The line a person at the device sees for each task: what ran on how much, how long, what went up."""
    if answer.error is not None:
        return f"round {msg.round}: task failed: {answer.error}"
    objective = task.objective if task is not None else "task"
    seconds = answer.profile.get("seconds")
    took = f" in {seconds:.1f} s" if isinstance(seconds, (int, float)) else ""
    m = answer.metrics
    figure = next((f", {name.replace('_', ' ')} {m[name]:.4f}" for name in ("local_accuracy", "train_loss")
                   if name in m), "")
    return f"round {msg.round}: {objective} on {answer.num_samples} samples{took}, {human_bytes(wire_bytes)} up{figure}"


def _on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy for the wire, whatever device the tensor lives on."""
    tensor = tensor.detach()
    return tensor.clone() if tensor.device.type == "cpu" else tensor.cpu()


def presence_payload(client_id: str, body: PresenceBody) -> bytes:
    return encode("presence", run_id="", round=0, task_id="", sender=client_id, body=body.to_body())


class ModelCache:
    """Networks built from task model specs, by spec, newest last; keeps ``keep`` (a device has little memory).

    A task loads every exchanged tensor into the network it gets from here, so any client may use
    a cached network (simulated clients share one per worker).
    """

    def __init__(self, keep: int = 1, device: torch.device | str = "cpu") -> None:
        self.keep = keep
        self.device = torch.device(device)
        self._models: OrderedDict[str, nn.Module] = OrderedDict()

    def get(self, spec: Any) -> nn.Module:
        key = json.dumps(spec, sort_keys=True)
        model = self._models.pop(key, None)
        if model is None:
            while len(self._models) >= self.keep:
                self._models.popitem(last=False)
            model = build_model(spec).to(self.device)
        self._models[key] = model
        return model


class BroadcastCache:
    """Model broadcasts by SHA-256, newest last: their wire tensors and codec. Keeps the current
    model and the one before; safe to share between clients in one process."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._items: OrderedDict[str, tuple[dict[str, torch.Tensor], CodecSpec]] = OrderedDict()

    def __contains__(self, digest: object) -> bool:
        with self._lock:
            return digest in self._items

    def get(self, digest: str) -> tuple[dict[str, torch.Tensor], CodecSpec] | None:
        with self._lock:
            return self._items.get(digest)

    def add(self, digest: str, tensors: dict[str, torch.Tensor], codec: CodecSpec) -> None:
        with self._lock:
            self._items[digest] = (tensors, codec)
            while len(self._items) > self.keep:
                self._items.popitem(last=False)


@dataclass(frozen=True)
class _Task:
    """A task message with its body parsed once; ``body`` is None when it does not parse (``problem``: why)."""

    msg: Message
    body: TaskBody | None
    problem: str = ""

    @classmethod
    def read(cls, msg: Message) -> _Task:
        try:
            return cls(msg, TaskBody.from_body(msg.body))
        except ProtocolError as exc:
            return cls(msg, None, str(exc))

    @property
    def timeout(self) -> float:
        return self.body.timeout if self.body is not None else DEFAULT_TASK_TIMEOUT

    @property
    def resend_every(self) -> float:
        return self.body.resend_every if self.body is not None else DEFAULT_RESEND_EVERY


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
    """Runs tasks for a coordinator on this device's private data.

    :meth:`run` is a device's whole life; a simulation drives many clients itself with
    :meth:`start`, :meth:`step` and :meth:`leave`, giving them shared ``models`` and
    ``broadcasts`` caches so that an idle client holds no network and no model copy.
    """

    def __init__(self, settings: ClientSettings, transport: Transport, data: LocalData, *,
                 models: ModelCache | None = None, broadcasts: BroadcastCache | None = None) -> None:
        self.settings = settings
        self.transport = ChunkingTransport(transport, max_message_bytes=settings.max_message_bytes,
                                           max_decoded_bytes=settings.max_decoded_bytes, chunking=settings.chunking)
        self.device = torch.device(settings.device)
        self.data = data.to(self.device)
        self.topics = settings.topics
        self._models = models if models is not None else ModelCache(device=self.device)
        self._gpu = GpuMeter(self.device)
        self._pending: _Pending | None = None
        self._done: dict[str, bytes | None] = {}   # task id -> result payload for re-sends; None once acknowledged
        self._latest_round: dict[str, int] = {}    # run id -> newest round the coordinator announced
        self._runs_seen: set[str] = set()
        self._runs_trained: set[str] = set()       # runs this device ran a task for
        self._runs_ended: set[str] = set()
        # The coordinator's current running run, from its retained status ("" once it finished). Only its
        # tasks run: a persistent session can hold tasks a dead run queued, and training them is waste.
        self._running_run: str | None = None      # None: no status seen yet
        self._sessions: dict[str, str] = {}       # run id -> the coordinator session last heard running it
        self._parked: list[tuple[_Task, Profiler]] = []   # tasks that came before any run status
        self._parked_since = 0.0
        self._presence = b""          # the presence we announced, and when it must have come back
        self._echo_due = 0.0
        self._finished = False
        self._previous_send: dict[str, Any] = {}   # encode/publish times of the last result, for the next
        self._broadcasts = broadcasts if broadcasts is not None else BroadcastCache()
        self._waiting: tuple[_Task, Profiler, float] | None = None   # a task waiting for its broadcast
        self._seen_while_waiting: list[str] = []   # what came on the model topic meanwhile, for the error
        self._disconnects_before_wait = 0
        self._residuals = ResidualStore(settings.state_dir)
        self.tasks_run = 0

    @staticmethod
    def will(settings: ClientSettings) -> Will:
        return Will(settings.topics.client(settings.client_id, "presence"),
                    presence_payload(settings.client_id, PresenceBody("offline")))

    # -- main loop ------------------------------------------------------------
    def run(self, stop: threading.Event | None = None) -> None:
        self.start()
        while not self.finished and not (stop is not None and stop.is_set()):
            if self.settings.parent_pid and not psutil.pid_exists(self.settings.parent_pid):
                log.info("parent process %d is gone; leaving", self.settings.parent_pid)
                break
            self.step(0.2)
        self.leave()

    @property
    def finished(self) -> bool:
        """The run this client took part in finished and it was asked to leave then (``exit_after_run``)."""
        return self._finished

    def start(self) -> None:
        """Subscribe to this client's topics and announce it online."""
        cid = self.settings.client_id
        for kind in ("task", "status", "presence"):   # our own presence: to see that the broker passes it on
            self.transport.subscribe(self.topics.client(cid, kind))
        self.transport.subscribe(self.topics.coordinator_status)
        warm_up()   # before announcing: the first task's time should be the task's own
        sample = self.data.x[:1]
        self._presence = presence_payload(cid, PresenceBody(
            "online", num_samples=len(self.data), input_shape=tuple(sample.shape[1:]),
            num_classes=int(self.data.y.max()) + 1 if len(self.data) else 0, device=device_facts()))
        self._echo_due = time.monotonic() + self.settings.presence_echo_timeout
        self.transport.announce(self.topics.client(cid, "presence"), self._presence)
        activity.info("client %s online with %d samples, training on %s", cid, len(self.data), self.device)

    def step(self, timeout: float) -> bool:
        """Handle the next incoming message (waiting up to ``timeout`` s for one), then what is due
        (re-sends, give-ups, warnings); return whether a message came."""
        incoming = self.transport.get(timeout)
        if incoming is not None and incoming.error:
            log.warning("lost a message on %s: %s", incoming.topic, incoming.error)
        elif incoming is not None and incoming.payload:
            self._handle(incoming.topic, incoming.payload, incoming.received_at)
        self._give_up_waiting()
        self._warn_if_unseen()
        self._warn_if_parked()
        self._resend_if_due()
        return incoming is not None

    def leave(self) -> None:
        """Say this client is offline."""
        cid = self.settings.client_id
        self.transport.publish(self.topics.client(cid, "presence"), presence_payload(cid, PresenceBody("offline")),
                               retain=True)

    def _warn_if_unseen(self) -> None:
        """Our presence never came back: the broker drops what this device publishes (an ACL that does
        not match its client id, typically), so no coordinator will ever see it. Say so, once."""
        if self._echo_due and time.monotonic() > self._echo_due:
            self._echo_due = 0.0
            log.error("this device's presence on %s did not come back from the broker within %.0f s, so no "
                      "coordinator can see it: the broker drops what it publishes. Check the broker's ACL; "
                      "with fedge's ACL (deploy/mosquitto.acl) --client-id must equal the MQTT --username",
                      self.topics.client(self.settings.client_id, "presence"), self.settings.presence_echo_timeout)

    def _handle(self, topic: str, payload: bytes, received_at: float | None = None) -> None:
        taken_up, started = time.monotonic(), time.perf_counter()
        if topic == self.topics.client(self.settings.client_id, "presence"):
            if payload == self._presence:
                self._echo_due = 0.0   # the broker passes on what we publish
            return
        if topic == self.topics.model:
            self._on_model(payload)
            return
        try:
            msg = decode(payload, max_bytes=self.settings.max_decoded_bytes)
        except ProtocolError as exc:
            log.warning("ignored a message on %s: %s", topic, exc)
            return
        if msg.kind == "status" and topic == self.topics.coordinator_status:
            self._on_coordinator_status(msg)
        elif msg.kind == "task" and topic == self.topics.client(self.settings.client_id, "task"):
            profiler = Profiler(started=started)
            if received_at is not None:   # how long the task waited on this device before we took it up
                profiler.add("receive", max(0.0, taken_up - received_at))
            task = _Task.read(msg)
            profiler.add("decode", time.perf_counter() - started)
            self._take(task, profiler)
        elif msg.kind == "status":
            self._on_status(msg)

    def _on_coordinator_status(self, msg: Message) -> None:
        try:
            status = StatusBody.from_body(msg.body)
        except ProtocolError as exc:
            log.warning("ignored the coordinator's status: %s", exc)
            return
        if status.state == "running":
            self._running_run = msg.run_id
            self._runs_seen.add(msg.run_id)
            known = self._sessions.get(msg.run_id)
            if status.session and known is not None and status.session != known:
                # The run resumed from a checkpoint: the rounds since come again, so none of them is stale.
                activity.info("run %s resumed by its coordinator at round %d", msg.run_id, msg.round)
                self._latest_round[msg.run_id] = msg.round
                self._pending = None   # counted as late by the resumed coordinator at best
            else:
                self._latest_round[msg.run_id] = max(self._latest_round.get(msg.run_id, 0), msg.round)
            if status.session:
                self._sessions[msg.run_id] = status.session
        elif status.state == "stopped":
            # Its coordinator stopped (Ctrl-C, SIGTERM, an error) and may resume it: its queued tasks are waste.
            if self._running_run in (None, msg.run_id):
                self._running_run = ""
                if msg.run_id in self._runs_trained:
                    activity.info("run %s stopped by its coordinator; waiting for it to resume or a new run",
                                  msg.run_id)
            if self._pending is not None and self._pending.run_id == msg.run_id:
                self._pending = None
        elif status.state == "finished":
            self._running_run = "" if self._running_run in (None, msg.run_id) else self._running_run
            if msg.run_id in self._runs_trained and msg.run_id not in self._runs_ended:
                activity.info("run %s finished", msg.run_id)
            self._runs_ended.add(msg.run_id)
            if msg.run_id in self._runs_seen:
                self._pending = None
                if self.settings.exit_after_run:
                    self._finished = True
        parked, self._parked = self._parked, []
        for task, profiler in parked:
            self._take(task, profiler)

    def _take(self, task: _Task, profiler: Profiler) -> None:
        """Run a new task if it belongs to the coordinator's current running run; park it while no run
        status has arrived (the retained status may come after a persistent session's queued tasks)."""
        run = task.msg.run_id
        if self._running_run is None:
            if not self._parked:
                self._parked_since = time.monotonic()
            self._parked = [*self._parked[-7:], (task, profiler)]   # a few; the coordinator re-sends
            return
        if run != self._running_run:
            log.info("dropped task %s of run %s: it is not the coordinator's current run (%s)", task.msg.task_id,
                     run, self._running_run or "none running")
            return
        session = task.body.session if task.body is not None else ""
        if session and session != self._sessions.get(run, session):
            log.info("dropped task %s of run %s: a coordinator that has since stopped gave it", task.msg.task_id, run)
            return
        self._on_task(task, profiler)

    def _warn_if_parked(self) -> None:
        """Tasks waiting long for a run status mean this device cannot read it: say so, once."""
        if self._parked and self._parked_since and time.monotonic() - self._parked_since > 15.0:
            log.warning("tasks are waiting for the coordinator's run status on %s, which has not arrived; check "
                        "that this device may read that topic (the broker's ACL)", self.topics.coordinator_status)
            self._parked_since = 0.0

    def _on_status(self, msg: Message) -> None:
        try:
            status = StatusBody.from_body(msg.body)
        except ProtocolError as exc:
            log.warning("ignored a status: %s", exc)
            return
        if self._pending is not None and status.task_id == self._pending.task_id:
            if status.state == "rejected":
                log.warning("coordinator rejected result of %s: %s", status.task_id, status.reason)
            self._pending = None
            self._done[status.task_id] = None   # the coordinator has it: keep no copy (a model's size)

    # -- the model broadcast ----------------------------------------------------
    def _on_model(self, payload: bytes) -> None:
        digest = hashlib.sha256(payload).hexdigest()
        try:
            msg = decode(payload, max_bytes=self.settings.max_decoded_bytes)
            body = ModelBody.from_body(msg.body) if msg.kind == "model" else None
        except ProtocolError as exc:
            log.warning("ignored a model broadcast: %s", exc)
            self._note_while_waiting(f"a broadcast that was refused ({exc})")
            return
        if body is None:
            return
        self._note_while_waiting(f"the broadcast of round {msg.round} ({digest[:16]}...)")
        self._broadcasts.add(digest, msg.tensors, body.codec)
        waiting = self._waiting
        if waiting is not None and waiting[0].body is not None and waiting[0].body.broadcast == digest:
            task, profiler, since = waiting
            self._stop_waiting()
            profiler.add("fetch_model", time.monotonic() - since)
            self._on_task(task, profiler)

    def _needs_broadcast(self, task: _Task, profiler: Profiler) -> bool:
        """Park a task whose broadcast is not here yet and fetch it (the retained model topic)."""
        digest = task.body.broadcast if task.body is not None else None
        if digest is None or digest in self._broadcasts:
            self._stop_waiting()
            return False
        if self._waiting is None:
            self._seen_while_waiting, self._disconnects_before_wait = [], self._disconnects()
            self.transport.subscribe(self.topics.model, parts=True)
        self._waiting = (task, profiler, time.monotonic())
        return True

    def _note_while_waiting(self, seen: str) -> None:
        """Keep what came on the model topic for a task's error, only while one waits (a device lives long)."""
        if self._waiting is not None:
            self._seen_while_waiting = [*self._seen_while_waiting[-2:], seen]

    def _disconnects(self) -> int:
        return self.transport.disconnects

    def _missing_broadcast(self, digest: str, patience: float) -> str:
        """Why a task's broadcast is not here, from what this device observed while it waited."""
        said = f"the model broadcast {digest[:16]}... did not arrive within {patience:.0f} s (half the task's timeout)"
        dropped = self._disconnects() - self._disconnects_before_wait
        if dropped:
            return (f"{said}; the connection to the broker dropped {dropped} time(s) meanwhile (a broker that "
                    "restarts without persistence forgets the broadcast; the coordinator publishes it again on "
                    "its retry)")
        if self._seen_while_waiting:
            return f"{said}; the model topic brought only {'; '.join(self._seen_while_waiting[-3:])}"
        return (f"{said}, and nothing came on {self.topics.model}: check that this device may read that topic "
                "(the broker's ACL)")

    def _stop_waiting(self) -> None:
        if self._waiting is not None:
            self._waiting = None
            self.transport.unsubscribe(self.topics.model, parts=True)

    def _give_up_waiting(self) -> None:
        """A task whose broadcast never came is answered with an error at half its timeout.

        The coordinator's attempt ends at the full timeout: an error sent then would count
        as late, while one sent halfway counts as failed and lets the coordinator retry,
        which publishes the broadcast again.
        """
        if self._waiting is None:
            return
        task, profiler, since = self._waiting
        if time.monotonic() - since > BROADCAST_PATIENCE * task.timeout:
            self._stop_waiting()
            self._on_task(task, profiler, wait=False)

    # -- tasks ----------------------------------------------------------------
    def _on_task(self, task: _Task, profiler: Profiler | None = None, *, wait: bool = True) -> None:
        msg = task.msg
        self._runs_seen.add(msg.run_id)
        self._runs_trained.add(msg.run_id)
        if msg.task_id in self._done:  # the task came again: re-send the result unless it was acknowledged
            payload = self._done[msg.task_id]
            if payload is not None:
                self._send(task, payload)
            return
        if msg.round < self._latest_round.get(msg.run_id, 0):
            log.info("skipped stale task %s for round %d", msg.task_id, msg.round)
            return
        self._latest_round[msg.run_id] = msg.round
        profiler = Profiler() if profiler is None else profiler
        if wait and self._needs_broadcast(task, profiler):
            return
        self._gpu.start()
        try:
            if task.body is None:
                raise ProtocolError(task.problem)
            tensors, answer = self._execute(msg, task.body, profiler)
        except (ObjectiveError, ModelSpecError, ProtocolError) as exc:
            log.warning("task %s failed: %s", msg.task_id, exc)
            tensors, answer = {}, ResultBody(error=str(exc))
        except Exception as exc:  # a task must never take the device's client down
            log.exception("task %s failed unexpectedly", msg.task_id)
            tensors, answer = {}, ResultBody(error=f"{type(exc).__name__}: {exc}")
        # Encoding and publishing come after the profile is sealed into the result, so
        # their times travel with the next result, as `previous_send`.
        answer = replace(answer, profile={**profiler.summary(), **self._gpu.summary(), **self._previous_send})
        with profiler.phase("encode"):
            payload = self._result_payload(msg, answer, tensors)
        self._done = {msg.task_id: payload}
        with profiler.phase("publish"):
            self._send(task, payload)
        sent = {"task_id": msg.task_id, **{k: profiler.phases[k] for k in ("encode", "publish")}}
        self._previous_send = {"previous_send": sent}
        self.tasks_run += 1
        activity.info(_task_line(msg, task.body, answer, len(payload)))
        self._write_profile(task, {**answer.profile, "phases": profiler.phases})

    def _result_payload(self, msg: Message, answer: ResultBody, tensors: dict[str, torch.Tensor]) -> bytes:
        """The result message, compressed in its codec; an error result when it cannot be encoded or sent."""
        try:
            payload = encode("result", run_id=msg.run_id, round=msg.round, task_id=msg.task_id,
                             sender=self.settings.client_id, body=answer.to_body(), tensors=tensors,
                             compression=answer.codec)
            self.transport.check_size(payload)
            return payload
        except (ProtocolError, MessageTooLarge) as exc:   # tell the coordinator now rather than let it time out
            log.warning("task %s: %s", msg.task_id, exc)
            failure = ResultBody(error=str(exc), profile=answer.profile)
            return encode("result", run_id=msg.run_id, round=msg.round, task_id=msg.task_id,
                          sender=self.settings.client_id, body=failure.to_body())

    def _execute(self, msg: Message, task: TaskBody, profiler: Profiler) -> tuple[dict[str, torch.Tensor], ResultBody]:
        """Run the task; return the wire tensors and the result's body (without its profile)."""
        known = {**OBJECTIVES, **self.settings.objectives}
        objective = known.get(task.objective)
        if objective is None:
            raise ObjectiveError(f"unknown objective {task.objective!r}; this client knows {sorted(known)}")
        up = list(task.up)
        with profiler.phase("decode"):
            model = self._models.get(task.model)
            self._check_data_fits(task.model)
            self.data = for_model(self.data, task.model)   # the spec's normalization, whatever --data is
            known = set(federated_names(model))
            received = self._received(msg, task, state_shapes(model))
            model.load_state_dict(received, strict=False)
        ctx = TaskContext(seed=shuffle_seed(task.seed, msg.round, self.settings.client_id),
                          round=msg.round, client_id=self.settings.client_id, state_dir=self.settings.state_dir,
                          profiler=profiler, device=self.device)
        with profiler.phase("train"):
            output = objective(model, self.data, task.hyper, ctx)
        if output.tensors is not None:
            if sorted(output.tensors) != sorted(up):
                raise ProtocolError(f"objective produced {sorted(output.tensors)[:5]}, the task asked for {up[:5]}")
            tensors, raw_only = {name: _on_cpu(t) for name, t in output.tensors.items()}, True
        elif not set(up) <= known:
            raise ProtocolError(f"the task asks for parameters this model does not have: {sorted(set(up) - known)[:5]}")
        else:
            state = model.state_dict()
            tensors, raw_only = {name: _on_cpu(state[name]) for name in up}, False
        with profiler.phase("codec"):
            wire, delta = encode_upload(tensors, received, task.upload, self._residuals, msg.run_id,
                                        raw_only=raw_only, generator=torch.Generator().manual_seed(ctx.seed))
        return wire, ResultBody(num_samples=output.num_samples, metrics=dict(output.metrics),
                                codec=task.upload.codec, delta=tuple(delta))

    def _received(self, msg: Message, task: TaskBody, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """The task's tensors plus its broadcast's, decoded to float32 and checked against the model."""
        tensors = {}
        if task.broadcast is not None:
            shared = self._broadcasts.get(task.broadcast)
            if shared is None:
                raise ProtocolError(self._missing_broadcast(task.broadcast, BROADCAST_PATIENCE * task.timeout))
            wire, codec = shared
            tensors.update(decode_download(wire, codec, shapes))
        tensors.update(decode_download(msg.tensors, task.codec, shapes))
        return tensors

    def _check_data_fits(self, spec: dict[str, Any]) -> None:
        c, h = int(self.data.x.shape[1]), int(self.data.x.shape[2])
        if (c, h) != (spec["in_channels"], spec["image_size"]):
            raise ObjectiveError(f"model expects {spec['in_channels']}x{spec['image_size']}x{spec['image_size']} "
                                 f"inputs but this device's data is {c}x{h}x{self.data.x.shape[3]}")
        if len(self.data) and int(self.data.y.max()) >= spec["num_classes"]:
            raise ObjectiveError(f"this device has label {int(self.data.y.max())} but the model has "
                                 f"{spec['num_classes']} classes")

    def _send(self, task: _Task, payload: bytes) -> None:
        msg, now = task.msg, time.monotonic()
        self._pending = _Pending(msg.run_id, msg.round, msg.task_id, payload, give_up_at=now + task.timeout,
                                 resend_every=max(0.5, task.resend_every))
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
            except MessageTooLarge as exc:   # the broker's limit, learned too late: say so instead of the result
                log.error("could not send result of %s: %s", p.task_id, exc)
                p.payload = encode("result", run_id=p.run_id, round=p.round, task_id=p.task_id,
                                   sender=self.settings.client_id, body=ResultBody(error=str(exc)).to_body())
                return
            except TransportError as exc:
                log.warning("could not send result of %s: %s", p.task_id, exc)
                self._pending = None
                return
            p.next_send_at = now + p.resend_every

    def _write_profile(self, task: _Task, profile: dict[str, Any]) -> None:
        if self.settings.state_dir is None:
            return
        msg = task.msg
        record = {"client_id": self.settings.client_id, "run_id": msg.run_id, "round": msg.round,
                  "task_id": msg.task_id, "objective": task.body.objective if task.body is not None else None, **profile}
        record.pop("previous_send", None)   # this line already has its own encode and publish times
        append_history(self.settings.state_dir, "task", record)
