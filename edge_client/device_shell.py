"""The device's shell: :class:`~edge_client.device_protocol.DeviceProtocol` wired to a transport and a trainer.

The protocol decides and does no I/O; this module carries out what it decides (subscribe,
publish, announce, report a failed send, log) and turns a task's trained tensors into the
result message: the task's upload codec (:func:`~edge_client.wire.updates.encode_clipped_upload`,
with local differential privacy and the device's privacy budget), a secure round's stages
(:mod:`edge_client.secure_device`), the envelope and its size check. Every task that can fail
is answered with its error instead of taking the device down.

Two things differ between the places a device runs, and are passed in:

* the **trainer** (:class:`Trainer`): what turns a task and its received tensors into trained
  tensors. The product's is torch training (:class:`edge_client.client.EdgeClient`); the fleet
  benchmark's stand-in answers after a think time with a fixed perturbation of what it received.
  A trainer may answer later (on the same thread as the shell, e.g. from an event loop's timer):
  it calls the ``finish`` it was given once, whenever the work is done.
* the **transport** under a :class:`~edge_client.wire.chunking.ChunkingTransport`: MQTT with
  paho's own network thread, MQTT driven by a shared selector loop
  (:mod:`edge_client.wire.shared_loop`), or the in-process hub of simulations.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from edge_client.app import AppError, AppMismatch
from edge_client.device_actions import Actions, Publish, Task
from edge_client.device_protocol import DeviceProtocol
from edge_client.models import ModelSpecError
from edge_client.objectives import ObjectiveError
from edge_client.privacy_budget import PrivacyBudget, PrivacyBudgetError
from edge_client.wire.chunking import ChunkingTransport
from edge_client.wire.protocol import REFUSAL_APP, Message, ProtocolError, ResultBody, encode
from edge_client.wire.transport import Incoming, MessageTooLarge, TransportError
from edge_client.wire.updates import ResidualStore, encode_clipped_upload
from profiling.memory_trace import mark

__all__ = ["Clock", "DeviceShell", "Finish", "PhaseClock", "TASK_ERRORS", "Trained", "Trainer", "Watch"]

log = logging.getLogger("fedge.client")
# One line per task, on connecting and at a run's end: what a person at the device sees without -v.
activity = logging.getLogger("fedge.client.activity")

# A task's own failures: answered with the error (logged as a warning), never a crash of the device.
TASK_ERRORS = (ObjectiveError, ModelSpecError, AppError, ProtocolError, PrivacyBudgetError)


@dataclass(frozen=True)
class Trained:
    """What a trainer hands back for a task: the tensors the task asked for (``up``) after training,
    on the CPU, and what the shell needs to encode them."""

    tensors: dict[str, torch.Tensor]
    received: dict[str, torch.Tensor]    # what the task sent down: the reference of each difference
    num_samples: int
    metrics: dict[str, float] = field(default_factory=dict)
    raw_only: bool = False     # an objective's statistics, not model parameters: sent as they are
    seed: int = 0              # seeds the codec's stochastic rounding
    key: str = ""              # names the task in the error-feedback residuals (objectives.task_key)


class Clock(Protocol):
    """A task's timings (``edge_client``'s is :class:`profiling.profiler.Profiler`)."""

    phases: dict[str, float]

    def add(self, name: str, seconds: float) -> None: ...

    def phase(self, name: str) -> AbstractContextManager[None]: ...

    def summary(self) -> dict[str, Any]: ...


class PhaseClock:
    """A :class:`Clock` of phase durations only: for stand-in devices, which must stay cheap."""

    def __init__(self, started: float | None = None) -> None:
        self.started = time.perf_counter() if started is None else started
        self.phases: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    def phase(self, name: str) -> AbstractContextManager[None]:
        return _Timed(self, name)

    def summary(self) -> dict[str, Any]:
        return {"seconds": time.perf_counter() - self.started, "phases": dict(self.phases)}


class _Timed:
    def __init__(self, clock: PhaseClock, name: str) -> None:
        self.clock, self.name, self.start = clock, name, 0.0

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.clock.add(self.name, time.perf_counter() - self.start)


Finish = Callable[[Callable[[], Trained]], None]


class Trainer(Protocol):
    """The device's work, which the shell asks for."""

    def clock(self, started: float) -> Clock:
        """A new task's clock, started at ``started`` (a ``time.perf_counter()`` value)."""
        ...

    def train(self, task: Task, finish: Finish) -> None:
        """Train for ``task`` and call ``finish(work)`` once, now or later on the shell's thread: the shell
        runs ``work()`` for the :class:`Trained` tensors, answering any error it raises as the task's."""
        ...

    def sent(self, task: Task, answer: ResultBody, payload: bytes) -> None:
        """The task's result went to the protocol (``answer`` with its profile; ``payload`` on the wire)."""
        ...


class Watch(Protocol):
    """What a caller that keeps records sees of the shell's work (the fleet benchmark's bookkeeping)."""

    def taking(self, actions: Actions) -> None:
        """The protocol's actions, before the shell carries them out."""
        ...

    def published(self, message: Publish, sent: int) -> None:
        """A message left through the transport: ``sent`` bytes, chunk headers included."""
        ...


class DeviceShell:
    """Carries out a :class:`DeviceProtocol`'s actions over ``transport``, with ``trainer`` doing the tasks.

    ``budget``: the device's own local-DP budget (refuses what it does not cover, records what it sends);
    ``gpu``: a meter whose readings join each task's profile (``edge_client.device.GpuMeter``);
    ``secure``: the secure rounds' state (``edge_client.secure_device.SecureRounds``), made at the first
    secure task when not given, so a device that never sees one never loads the cryptography.
    """

    def __init__(self, protocol: DeviceProtocol, transport: ChunkingTransport, trainer: Trainer, *,
                 residuals: ResidualStore | None = None, budget: PrivacyBudget | None = None, gpu: Any = None,
                 secure: Any = None, watch: Watch | None = None) -> None:
        self.protocol = protocol
        self.transport = transport
        self.trainer = trainer
        self.client_id = protocol.client_id
        self.residuals = residuals if residuals is not None else ResidualStore(None)
        self.budget = budget
        self.gpu = gpu
        self.secure = secure
        self.watch = watch
        self._previous_send: dict[str, Any] = {}   # encode/publish times of the last result, for the next

    # -- events -----------------------------------------------------------------
    def take(self, incoming: Incoming) -> None:
        """Hand one incoming message (or the loss of one) to the protocol and carry out what it says; a task
        gets its clock here (how long it waited on this device before it was taken up, its decoding)."""
        if incoming.error:
            self.apply(self.protocol.lost(incoming.topic, incoming.error))
            return
        if not incoming.payload:
            return
        taken_up, started = time.monotonic(), time.perf_counter()
        actions = self.protocol.handle(incoming.topic, incoming.payload, taken_up)
        mark("received")
        for task in actions.arrived:
            clock = self.trainer.clock(started)
            if incoming.received_at is not None:
                clock.add("receive", max(0.0, taken_up - incoming.received_at))
            clock.add("decode", time.perf_counter() - started)
            task.context = clock
        self.apply(actions)

    def tick(self, now: float) -> None:
        """Tell the protocol the connections lost so far and the time; do what is due."""
        self.protocol.note_disconnects(self.transport.disconnects)
        self.apply(self.protocol.tick(now))

    def apply(self, actions: Actions) -> None:
        """Log, subscribe, publish, then run tasks, in the order :class:`Actions` gives."""
        if self.watch is not None:
            self.watch.taking(actions)
        for note in actions.notes:
            (activity if note.kind == "activity" else log).log(note.level, "%s", note.text)
        for topic, parts in actions.subscribe:
            self.transport.subscribe(topic, parts=parts)
        for topic, parts in actions.unsubscribe:
            self.transport.unsubscribe(topic, parts=parts)
        for message in actions.publish:
            self.publish(message)
        for task in actions.run:
            self.run(task)

    def publish(self, message: Publish) -> None:
        """Publish; a result's failed send goes back to the protocol, any other ends the device's loop."""
        if message.announce:
            self.transport.announce(message.topic, message.payload)
            return
        try:
            sent = self.transport.publish(message.topic, message.payload, retain=message.retain)
        except TransportError as exc:
            if not message.result_of:
                raise
            self.apply(self.protocol.send_failed(message.result_of, str(exc),
                                                 too_large=isinstance(exc, MessageTooLarge)))
            return
        if self.watch is not None:
            self.watch.published(message, sent)

    # -- tasks ----------------------------------------------------------------
    def run(self, task: Task) -> None:
        """Execute a task the protocol let through and hand its result back (now, or when the trainer
        finishes); nothing raised here takes the device down: a failure is the result."""
        if task.context is None:
            task.context = self.trainer.clock(time.perf_counter())
        if task.fetch_seconds is not None:
            task.context.add("fetch_model", task.fetch_seconds)
        if self.gpu is not None:
            self.gpu.start()
        try:
            if task.body is None:
                raise ProtocolError(task.problem)
            if self.budget is not None:
                refused = self.budget.refusal(task.msg.task_id, task.body.objective,
                                              task.body.upload.noise_multiplier)
                if refused:
                    raise PrivacyBudgetError(refused, final=True)
        except Exception as exc:   # a task must never take the device down
            self._send(task, {}, self._failure(task, exc))
            return
        if task.body.secagg is None:
            self.trainer.train(task, lambda work: self._finish(task, None, work))
        else:
            self._secure_task(task)

    def _finish(self, task: Task, stage: Any, work: Callable[[], Trained]) -> None:
        """Encode what the trainer's ``work`` produced, or its error, and send it."""
        try:
            tensors, answer = self._encoded(task, stage, work())
        except Exception as exc:
            if stage is not None and _secagg_error(exc):
                _dropped(task, exc)   # answering a refused or malformed stage could only reveal something
                return
            tensors, answer = {}, self._failure(task, exc)
        self._send(task, tensors, answer)

    def _failure(self, task: Task, exc: Exception) -> ResultBody:
        if isinstance(exc, TASK_ERRORS):
            log.warning("task %s failed: %s", task.msg.task_id, exc)
            return ResultBody(error=str(exc), withdrawn=getattr(exc, "final", False),
                              refusal=REFUSAL_APP if isinstance(exc, AppMismatch) else "")
        log.error("task %s failed unexpectedly", task.msg.task_id, exc_info=exc)
        return ResultBody(error=f"{type(exc).__name__}: {exc}")

    def _secure_task(self, task: Task) -> None:
        """A secure round's task: training (advertise) or one step of the round in progress; a refused or
        malformed stage is logged and not answered. Secure aggregation's modules (and the cryptography library)
        load only here: a device that never sees a secure round never imports them."""
        from edge_client.secagg.errors import SecAggError
        from edge_client.secagg.stages import StageTask

        msg = task.msg
        if self.secure is None:
            from edge_client.secure_device import SecureRounds

            self.secure = SecureRounds()
        try:
            stage = StageTask.from_body(task.body.secagg)
        except SecAggError as exc:
            _dropped(task, exc)
            return
        if stage.stage == "advertise":
            self.trainer.train(task, lambda work: self._finish(task, stage, work))
            return
        try:
            tensors, answer = self._secure_step(msg, stage)
        except SecAggError as exc:
            _dropped(task, exc)
            return
        except Exception as exc:
            tensors, answer = {}, self._failure(task, exc)
        self._send(task, tensors, answer)

    def _secure_step(self, msg: Message, stage: Any) -> tuple[dict[str, torch.Tensor], ResultBody]:
        """A secure round's share, mask or unmask task: no training, one step of the round in progress."""
        reply = self.secure.answer((msg.run_id, msg.round), stage)
        body, tensors = reply.wire(stage.params.bits)
        return tensors, ResultBody(num_samples=max(1, self.secure.num_samples), secagg=body)

    def _encoded(self, task: Task, stage: Any, trained: Trained) -> tuple[dict[str, torch.Tensor], ResultBody]:
        """The wire tensors and the result's body (without its profile) for what was trained. With a secure
        round's ``stage`` (advertise), the update is kept here and only the public keys go up."""
        msg, body, clock = task.msg, task.body, task.context
        assert body is not None
        up = sorted(body.up)
        if stage is not None:
            if trained.raw_only:
                raise ProtocolError(f"objective {body.objective!r} sends statistics, not an update: it cannot "
                                    "run in a secure round")
            with clock.phase("codec"):
                from edge_client import secure_device   # loaded by _secure_task already

                vector = secure_device.secure_vector(stage, trained.tensors, trained.received, up,
                                                     trained.num_samples,
                                                     float(trained.metrics.get("train_loss", 0.0)),
                                                     body.upload.clip_norm)
                reply = self.secure.advertise((msg.run_id, msg.round), stage, vector, trained.num_samples)
            # no metrics: the round's loss is in the sum; one device's would say something of its data
            return {}, ResultBody(num_samples=trained.num_samples, secagg=reply.wire(stage.params.bits)[0])
        with clock.phase("codec"):
            wire, delta, clipped = encode_clipped_upload(trained.tensors, trained.received, body.upload,
                                                         self.residuals, msg.run_id, raw_only=trained.raw_only,
                                                         task=trained.key,
                                                         generator=torch.Generator().manual_seed(trained.seed))
        mark("codec")
        if body.upload.noise_multiplier is not None:
            # Local differential privacy: the noisy update is the only thing about the data that leaves the
            # device; a training loss or the clipped bit would be releases the noise does not cover.
            if self.budget is not None:   # on disk before it is sent
                self.budget.record(msg.task_id, msg.run_id, msg.round, body.upload.noise_multiplier)
            metrics = {}
        else:
            metrics = dict(trained.metrics)
            if body.upload.clip_norm is not None:   # the one bit adaptive clipping needs, never the norm itself
                metrics["clipped"] = float(clipped)
        return wire, ResultBody(num_samples=trained.num_samples, metrics=metrics, codec=body.upload.codec,
                                delta=tuple(delta))

    def _send(self, task: Task, tensors: dict[str, torch.Tensor], answer: ResultBody) -> None:
        """Seal the profile into the result, encode it and hand it to the protocol. Encoding and publishing
        come after the profile is sealed, so their times travel with the next result, as ``previous_send``."""
        msg, clock = task.msg, task.context
        gpu = self.gpu.summary() if self.gpu is not None else {}
        answer = replace(answer, profile={**clock.summary(), **gpu, **self._previous_send},
                         model_from=task.model_from)
        with clock.phase("encode"):
            payload = self.result_payload(msg, answer, tensors)
        mark("message")
        with clock.phase("publish"):
            self.apply(self.protocol.answered(task, payload, time.monotonic()))
        mark("published")
        sent = {"task_id": msg.task_id, **{k: clock.phases[k] for k in ("encode", "publish")}}
        self._previous_send = {"previous_send": sent}
        self.trainer.sent(task, answer, payload)

    def result_payload(self, msg: Message, answer: ResultBody, tensors: dict[str, torch.Tensor]) -> bytes:
        """The result message, compressed in its codec; an error result when it cannot be encoded or sent."""
        try:
            payload = encode("result", run_id=msg.run_id, round=msg.round, task_id=msg.task_id,
                             sender=self.client_id, body=answer.to_body(), tensors=tensors,
                             compression=answer.codec)
            self.transport.check_size(payload)
            return payload
        except (ProtocolError, MessageTooLarge) as exc:   # tell the coordinator now rather than let it time out
            log.warning("task %s: %s", msg.task_id, exc)
            failure = ResultBody(error=str(exc), profile=answer.profile)
            return encode("result", run_id=msg.run_id, round=msg.round, task_id=msg.task_id,
                          sender=self.client_id, body=failure.to_body())


def _secagg_error(exc: Exception) -> bool:
    from edge_client.secagg.errors import SecAggError

    return isinstance(exc, SecAggError)


def _dropped(task: Task, exc: Exception) -> None:
    log.warning("dropped secure-aggregation task %s of round %d: %s", task.msg.task_id, task.msg.round, exc)
