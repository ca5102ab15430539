"""The edge client loop: announce, take tasks, train, send results until acknowledged.

The loop is transport-agnostic (MQTT on a device, in-process in simulations) and
never trusts what it receives: every task is decoded and checked before use, and
a bad one is answered with a rejection instead of an exception. Which tasks run,
when, and how results go until acknowledged is the device protocol's to say
(:mod:`edge_client.device_protocol`, which the fleet benchmark's stand-in devices
share); this module moves its messages and does the work: training, encoding,
the profile.
"""

from __future__ import annotations

import json
import logging
import platform
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

from edge_client.device import GpuMeter
from edge_client.device_protocol import Actions, BroadcastCache, DeviceProtocol, Publish, Task, presence_payload
from edge_client.inputs import for_model
from edge_client.memory_guard import MemoryGuard
from edge_client.app import APP_KEY, AppError, AppMismatch, spec_app
from edge_client.models import ModelSpecError, federated_names, state_shapes
from edge_client.objectives import (LocalData, Objective, ObjectiveError, TaskContext, check_finite_metrics,
                                    shuffle_seed, task_key, warm_up)
from edge_client.privacy_budget import BudgetSettings, PrivacyBudget, PrivacyBudgetError
from edge_client.registry import OBJECTIVES, build_model, example_sample
from edge_client.wire.chunking import DEFAULT_PACKET_BYTES, ChunkingTransport
from edge_client.wire.protocol import (DEFAULT_MAX_MESSAGE_BYTES, REFUSAL_APP, Message, PresenceBody, ProtocolError,
                                       ResultBody, TaskBody, Topics, encode)
from edge_client.wire.transport import Incoming, MessageTooLarge, Transport, TransportError, Will
from edge_client.wire.updates import ResidualStore, decode_download, encode_clipped_upload
from profiling.device import device_facts
from profiling.history import append_history
from profiling.profiler import Profiler
from profiling.units import human_bytes

__all__ = ["BroadcastCache", "ClientSettings", "EdgeClient", "ModelCache", "presence_payload"]

log = logging.getLogger("fedge.client")
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
    # The device's own local-DP budget (edge_client/privacy_budget.py): None, it takes the task's noise on trust.
    privacy_budget: BudgetSettings | None = None


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
        self._broadcasts = broadcasts if broadcasts is not None else BroadcastCache()
        self.protocol = DeviceProtocol(settings.client_id, settings.topics, self._broadcasts,
                                       max_decoded_bytes=settings.max_decoded_bytes,
                                       exit_after_run=settings.exit_after_run,
                                       presence_echo_timeout=settings.presence_echo_timeout)
        self._gpu = GpuMeter(self.device)
        self._previous_send: dict[str, Any] = {}   # encode/publish times of the last result, for the next
        self._residuals = ResidualStore(settings.state_dir)
        self.memory = MemoryGuard()   # refuses a task that would run this device out of memory
        self._secure: Any = None      # the secure round in progress (docs/privacy.md), made by the first stage
        self._budget = None if settings.privacy_budget is None else PrivacyBudget(settings.privacy_budget,
                                                                                   settings.state_dir)
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
        return self.protocol.finished

    @property
    def _done(self) -> dict[str, bytes | None]:
        """Task id -> the result kept for re-sends (None once acknowledged)."""
        return self.protocol.done

    def start(self) -> None:
        """Subscribe to this client's topics and announce it online."""
        self._apply(self.protocol.start())
        warm_up()   # before announcing: the first task's time should be the task's own
        sample = self.data.x[:1]
        presence = PresenceBody("online", num_samples=len(self.data), input_shape=tuple(sample.shape[1:]),
                                num_classes=int(self.data.y.max()) + 1 if len(self.data) else 0,
                                device=device_facts())
        self._apply(self.protocol.announce(presence, time.monotonic()))
        activity.info("client %s online with %d samples, training on %s", self.settings.client_id, len(self.data),
                      self.device)

    def step(self, timeout: float) -> bool:
        """Handle the next incoming message (waiting up to ``timeout`` s for one), then what is due
        (re-sends, give-ups, warnings); return whether a message came."""
        incoming = self.transport.get(timeout)
        self.protocol.note_disconnects(self.transport.disconnects)
        if incoming is not None and incoming.error:
            self._apply(self.protocol.lost(incoming.topic, incoming.error))
        elif incoming is not None and incoming.payload:
            self._receive(incoming)
        self._apply(self.protocol.tick(time.monotonic()))
        return incoming is not None

    def leave(self) -> None:
        """Say this client is offline."""
        self._apply(self.protocol.leave())

    def _receive(self, incoming: Incoming) -> None:
        """Hand a message to the protocol; a task gets its profile from here on (how long it waited on this
        device before we took it up, its decoding)."""
        taken_up, started = time.monotonic(), time.perf_counter()
        actions = self.protocol.handle(incoming.topic, incoming.payload, taken_up)
        for task in actions.arrived:
            profiler = Profiler(started=started)
            if incoming.received_at is not None:
                profiler.add("receive", max(0.0, taken_up - incoming.received_at))
            profiler.add("decode", time.perf_counter() - started)
            task.context = profiler
        self._apply(actions)

    def _apply(self, actions: Actions) -> None:
        for note in actions.notes:
            (activity if note.kind == "activity" else log).log(note.level, "%s", note.text)
        for topic, parts in actions.subscribe:
            self.transport.subscribe(topic, parts=parts)
        for topic, parts in actions.unsubscribe:
            self.transport.unsubscribe(topic, parts=parts)
        for message in actions.publish:
            self._publish(message)
        for task in actions.run:
            self._run(task)

    def _publish(self, message: Publish) -> None:
        if message.announce:
            self.transport.announce(message.topic, message.payload)
            return
        try:
            self.transport.publish(message.topic, message.payload, retain=message.retain)
        except TransportError as exc:   # a result's failure is the protocol's to handle; others end the client
            if not message.result_of:
                raise
            self._apply(self.protocol.send_failed(message.result_of, str(exc),
                                                  too_large=isinstance(exc, MessageTooLarge)))

    # -- tasks ----------------------------------------------------------------
    def _run(self, task: Task) -> None:
        """Execute a task the protocol let through and hand its result back; nothing raised here takes
        the client down: a failure is the result."""
        msg = task.msg
        profiler = task.context if isinstance(task.context, Profiler) else Profiler()
        if task.fetch_seconds is not None:
            profiler.add("fetch_model", task.fetch_seconds)
        self._gpu.start()
        try:
            if task.body is None:
                raise ProtocolError(task.problem)
            if self._budget is not None:
                refused = self._budget.refusal(msg.task_id, task.body.objective, task.body.upload.noise_multiplier)
                if refused:
                    raise PrivacyBudgetError(refused, final=True)
            if task.body.secagg is None:
                tensors, answer = self._execute(task, profiler)
            else:
                outcome = self._secure_task(task, profiler)
                if outcome is None:   # a refused or malformed stage: answering could only reveal something
                    return
                tensors, answer = outcome
        except (ObjectiveError, ModelSpecError, AppError, ProtocolError, PrivacyBudgetError) as exc:
            log.warning("task %s failed: %s", msg.task_id, exc)
            tensors, answer = {}, ResultBody(error=str(exc), withdrawn=getattr(exc, "final", False),
                                             refusal=REFUSAL_APP if isinstance(exc, AppMismatch) else "")
        except Exception as exc:  # a task must never take the device's client down
            log.exception("task %s failed unexpectedly", msg.task_id)
            tensors, answer = {}, ResultBody(error=f"{type(exc).__name__}: {exc}")
        # Encoding and publishing come after the profile is sealed into the result, so
        # their times travel with the next result, as `previous_send`.
        answer = replace(answer, profile={**profiler.summary(), **self._gpu.summary(), **self._previous_send})
        if task.body is not None and answer.error is None:
            self.memory.measured(task.body.model, task.body.hyper, answer.profile.get("peak_rss_bytes"))
        with profiler.phase("encode"):
            payload = self._result_payload(msg, answer, tensors)
        with profiler.phase("publish"):
            self._apply(self.protocol.answered(task, payload, time.monotonic()))
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

    def _secure_task(self, task: Task, profiler: Profiler) -> tuple[dict[str, torch.Tensor], ResultBody] | None:
        """A secure round's task: training (advertise) or one step of the round in progress; None when the
        stage is refused (logged). Secure aggregation's modules (and the cryptography library) load only here:
        a device that never sees a secure round never imports them."""
        from edge_client.secagg.errors import SecAggError
        from edge_client.secagg.stages import StageTask
        from edge_client.secure_device import SecureRounds

        msg = task.msg
        if self._secure is None:
            self._secure = SecureRounds()
        try:
            stage = StageTask.from_body(task.body.secagg)
            if stage.stage == "advertise":
                return self._execute(task, profiler, stage)
            return self._secure_step(msg, stage)
        except SecAggError as exc:
            log.warning("dropped secure-aggregation task %s of round %d: %s", msg.task_id, msg.round, exc)
            return None

    def _secure_step(self, msg: Message, stage: Any) -> tuple[dict[str, torch.Tensor], ResultBody]:
        """A secure round's share, mask or unmask task: no training, one step of the round in progress."""
        reply = self._secure.answer((msg.run_id, msg.round), stage)
        body, tensors = reply.wire(stage.params.bits)
        return tensors, ResultBody(num_samples=max(1, self._secure.num_samples), secagg=body)

    def _execute(self, wrapped: Task, profiler: Profiler,
                 stage: Any = None) -> tuple[dict[str, torch.Tensor], ResultBody]:
        """Run the task; return the wire tensors and the result's body (without its profile). With a secure
        round's ``stage`` (advertise), the update is kept here and only the public keys go up."""
        msg, task = wrapped.msg, wrapped.body
        assert task is not None   # a task whose body does not parse is answered before this
        known = {**OBJECTIVES, **self.settings.objectives}
        objective = known.get(task.objective)
        if objective is None:
            raise ObjectiveError(f"unknown objective {task.objective!r}; this client knows {sorted(known)}")
        up = list(task.up)
        with profiler.phase("decode"):
            self.memory.before_build(task.model, task.hyper)   # building takes memory too
            model = self._models.get(task.model)
            self.memory.before_training(model, task.model, task.hyper)
            self._check_data_fits(task.model)
            self.data = for_model(self.data, task.model)   # the spec's normalization, whatever --data is
            known = set(federated_names(model))
            received = self._received(wrapped, state_shapes(model))
            model.load_state_dict(received, strict=False)
        ctx = TaskContext(seed=shuffle_seed(task.seed, msg.round, self.settings.client_id),
                          round=msg.round, client_id=self.settings.client_id, state_dir=self.settings.state_dir,
                          profiler=profiler, device=self.device, app=spec_app(task.model))
        with profiler.phase("train"):
            output = objective(model, self.data, task.hyper, ctx)
        check_finite_metrics(output, msg.round)
        if output.tensors is not None:
            if sorted(output.tensors) != sorted(up):
                raise ProtocolError(f"objective produced {sorted(output.tensors)[:5]}, the task asked for {up[:5]}")
            tensors, raw_only = {name: _on_cpu(t) for name, t in output.tensors.items()}, True
        elif not set(up) <= known:
            raise ProtocolError(f"the task asks for parameters this model does not have: {sorted(set(up) - known)[:5]}")
        else:
            state = model.state_dict()
            tensors, raw_only = {name: _on_cpu(state[name]) for name in up}, False
        if stage is not None:
            if raw_only:
                raise ProtocolError(f"objective {task.objective!r} sends statistics, not an update: it cannot "
                                    "run in a secure round")
            with profiler.phase("codec"):
                from edge_client import secure_device   # loaded by _secure_task already

                vector = secure_device.secure_vector(stage, tensors, received, sorted(up), output.num_samples,
                                       float(output.metrics.get("train_loss", 0.0)), task.upload.clip_norm)
                reply = self._secure.advertise((msg.run_id, msg.round), stage, vector, output.num_samples)
            # no metrics: the round's loss is in the sum; one device's would say something of its data
            return {}, ResultBody(num_samples=output.num_samples, secagg=reply.wire(stage.params.bits)[0])
        with profiler.phase("codec"):
            wire, delta, clipped = encode_clipped_upload(tensors, received, task.upload, self._residuals, msg.run_id,
                                                         raw_only=raw_only, task=task_key(ctx),
                                                         generator=torch.Generator().manual_seed(ctx.seed))
        if task.upload.noise_multiplier is not None:
            # Local differential privacy: the noisy update is the only thing about the data that leaves the
            # device; a training loss or the clipped bit would be releases the noise does not cover.
            if self._budget is not None:   # on disk before it is sent
                self._budget.record(msg.task_id, msg.run_id, msg.round, task.upload.noise_multiplier)
            metrics = {}
        else:
            metrics = dict(output.metrics)
            if task.upload.clip_norm is not None:   # the one bit adaptive clipping needs, never the norm itself
                metrics["clipped"] = float(clipped)
        return wire, ResultBody(num_samples=output.num_samples, metrics=metrics,
                                codec=task.upload.codec, delta=tuple(delta))

    def _received(self, wrapped: Task, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """The task's tensors plus its broadcast's, decoded to float32 and checked against the model."""
        msg, task = wrapped.msg, wrapped.body
        assert task is not None
        tensors = {}
        if task.broadcast is not None:
            shared = self._broadcasts.get(task.broadcast)
            if shared is None:
                raise ProtocolError(wrapped.no_broadcast or self.protocol.missing_broadcast(wrapped))
            wire, codec = shared
            tensors.update(decode_download(wire, codec, shapes))
        tensors.update(decode_download(msg.tensors, task.codec, shapes))
        return tensors

    def _check_data_fits(self, spec: dict[str, Any]) -> None:
        if APP_KEY in spec:   # an app's samples: the shape of its example input, its targets whatever its loss takes
            wanted = tuple(example_sample(spec).shape[1:])
            if tuple(self.data.x.shape[1:]) != wanted:
                raise ObjectiveError(f"the app's model takes samples of shape {list(wanted)} but this device's data "
                                     f"has {list(self.data.x.shape[1:])}")
            return
        c, h = int(self.data.x.shape[1]), int(self.data.x.shape[2])
        if (c, h) != (spec["in_channels"], spec["image_size"]):
            raise ObjectiveError(f"model expects {spec['in_channels']}x{spec['image_size']}x{spec['image_size']} "
                                 f"inputs but this device's data is {c}x{h}x{self.data.x.shape[3]}")
        if len(self.data) and int(self.data.y.max()) >= spec["num_classes"]:
            raise ObjectiveError(f"this device has label {int(self.data.y.max())} but the model has "
                                 f"{spec['num_classes']} classes")

    def _write_profile(self, task: Task, profile: dict[str, Any]) -> None:
        if self.settings.state_dir is None:
            return
        msg = task.msg
        # the machine on each line: a history copied off a device says what it was measured on
        record = {"client_id": self.settings.client_id, "run_id": msg.run_id, "round": msg.round,
                  "task_id": msg.task_id, "objective": task.body.objective if task.body is not None else None,
                  "arch": platform.machine(), **profile}
        record.pop("previous_send", None)   # this line already has its own encode and publish times
        append_history(self.settings.state_dir, "task", record)
