"""The edge client loop: announce, take tasks, train, send results until acknowledged.

The loop is transport-agnostic (MQTT on a device, in-process in simulations) and
never trusts what it receives: every task is decoded and checked before use, and
a bad one is answered with a rejection instead of an exception. Which tasks run,
when, and how results go until acknowledged is the device protocol's to say
(:mod:`edge_client.device_protocol`); carrying out what it says and encoding the
results is the device shell's (:mod:`edge_client.device_shell`), both shared with the
fleet benchmark's stand-in devices. This module is the device's trainer: it builds
the model, trains it on the local data and keeps the profile.
"""

from __future__ import annotations

import json
import logging
import platform
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

from edge_client.device import GpuMeter
from edge_client.device_protocol import BroadcastCache, DeviceProtocol, Task, presence_payload
from edge_client.device_shell import DeviceShell, Trained
from edge_client.heap import give_back_freed_memory
from edge_client.inputs import for_model
from edge_client.memory_guard import MemoryGuard
from edge_client.app import APP_KEY, spec_app
from edge_client.models import federated_names, state_shapes
from edge_client.objectives import (LocalData, Objective, ObjectiveError, TaskContext, check_finite_metrics,
                                    shuffle_seed, task_key, warm_up)
from edge_client.privacy_budget import BudgetSettings, PrivacyBudget
from edge_client.registry import OBJECTIVES, build_model, example_sample
from edge_client.wire.chunking import DEFAULT_PACKET_BYTES, ChunkingTransport
from edge_client.wire.protocol import (DEFAULT_MAX_MESSAGE_BYTES, Message, PresenceBody, ProtocolError, ResultBody,
                                       TaskBody, Topics)
from edge_client.wire.transport import Transport, Will
from edge_client.wire.updates import ResidualStore, decode_download
from profiling.device import device_facts
from profiling.history import append_history
from profiling.memory_trace import mark
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
        self._residuals = ResidualStore(settings.state_dir)
        self.memory = MemoryGuard()   # refuses a task that would run this device out of memory
        self._budget = None if settings.privacy_budget is None else PrivacyBudget(settings.privacy_budget,
                                                                                   settings.state_dir)
        self.shell = DeviceShell(self.protocol, self.transport, self, residuals=self._residuals,
                                 budget=self._budget, gpu=self._gpu)
        self.tasks_run = 0

    @staticmethod
    def will(settings: ClientSettings) -> Will:
        return Will(settings.topics.client(settings.client_id, "presence"),
                    presence_payload(settings.client_id, PresenceBody("offline")))

    # -- main loop ------------------------------------------------------------
    def run(self, stop: threading.Event | None = None) -> None:
        """A device's whole life: serve tasks until stopped or finished, giving the memory each task freed
        back to the system once it is sent (a simulation's clients, driven by :meth:`step`, share a process
        and leave that to it)."""
        self.start()
        while not self.finished and not (stop is not None and stop.is_set()):
            if self.settings.parent_pid and not psutil.pid_exists(self.settings.parent_pid):
                log.info("parent process %d is gone; leaving", self.settings.parent_pid)
                break
            done = self.tasks_run
            self.step(0.2)
            if self.tasks_run != done:
                give_back_freed_memory()
                mark("memory given back")
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
        self.shell.apply(self.protocol.start())
        warm_up()   # before announcing: the first task's time should be the task's own
        sample = self.data.x[:1]
        presence = PresenceBody("online", num_samples=len(self.data), input_shape=tuple(sample.shape[1:]),
                                num_classes=int(self.data.y.max()) + 1 if len(self.data) else 0,
                                device=device_facts())
        self.shell.apply(self.protocol.announce(presence, time.monotonic()))
        activity.info("client %s online with %d samples, training on %s", self.settings.client_id, len(self.data),
                      self.device)
        mark("online")

    def step(self, timeout: float) -> bool:
        """Handle the next incoming message (waiting up to ``timeout`` s for one), then what is due
        (re-sends, give-ups, warnings); return whether a message came."""
        incoming = self.transport.get(timeout)
        if incoming is not None:
            self.protocol.note_disconnects(self.transport.disconnects)
            self.shell.take(incoming)
        self.shell.tick(time.monotonic())
        return incoming is not None

    def leave(self) -> None:
        """Say this client is offline."""
        self.shell.apply(self.protocol.leave())

    # -- the trainer the shell asks for (edge_client.device_shell.Trainer) --------
    def clock(self, started: float) -> Profiler:
        """A task's profile, from when its message was taken up."""
        return Profiler(started=started)

    def train(self, task: Task, finish: Callable[[Callable[[], Trained]], None]) -> None:
        """Train now, on this thread: the client does one task at a time."""
        finish(lambda: self._execute(task, task.context))

    def sent(self, task: Task, answer: ResultBody, payload: bytes) -> None:
        """Learn the task's memory, log its line and keep its profile."""
        if task.body is not None and answer.error is None:
            self.memory.measured(task.body.model, task.body.hyper, answer.profile.get("peak_rss_bytes"))
        self.tasks_run += 1
        activity.info(_task_line(task.msg, task.body, answer, len(payload)))
        self._write_profile(task, {**answer.profile, "phases": task.context.phases})

    def _execute(self, wrapped: Task, profiler: Profiler) -> Trained:
        """Run the task; return the tensors it asks for after training, for the shell to encode."""
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
            mark("model")
            self.memory.before_training(model, task.model, task.hyper)
            self._check_data_fits(task.model)
            self.data = for_model(self.data, task.model)   # the spec's normalization, whatever --data is
            mark("inputs")
            known = set(federated_names(model))
            received = self._received(wrapped, state_shapes(model))
            model.load_state_dict(received, strict=False)
            mark("weights")
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
        return Trained(tensors, received, output.num_samples, dict(output.metrics), raw_only, seed=ctx.seed,
                       key=task_key(ctx))

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
