"""The edge client loop: announce, take tasks, train, send results until acknowledged.

The loop is transport-agnostic (MQTT on a device, in-process in simulations) and
never trusts what it receives: every task is decoded and checked before use, and
a bad one is answered with a rejection instead of an exception.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

from edge_client.models import ModelSpecError, build_model, federated_names, state_shapes
from edge_client.objectives import OBJECTIVES, LocalData, ObjectiveError, shuffle_seed
from edge_client.protocol import DEFAULT_MAX_MESSAGE_BYTES, Message, ProtocolError, Topics, decode, encode
from edge_client.transport import Transport, TransportError, Will
from profiling.device import device_facts
from profiling.profiler import Profiler

__all__ = ["ClientSettings", "EdgeClient", "presence_payload"]

log = logging.getLogger("fedge.client")


@dataclass(frozen=True)
class ClientSettings:
    client_id: str
    topics: Topics = field(default_factory=Topics)
    state_dir: Path | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    exit_after_run: bool = False     # leave once a run we took part in finishes
    parent_pid: int | None = None    # leave when this process is gone (spawned simulations)


def presence_payload(client_id: str, state: str, **body: Any) -> bytes:
    return encode("presence", run_id="", round=0, task_id="", sender=client_id, body={"state": state, **body})


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
        self.transport = transport
        self.data = data
        self.topics = settings.topics
        self._models: dict[str, nn.Module] = {}
        self._pending: _Pending | None = None
        self._done: dict[str, bytes] = {}          # task id -> result payload, for re-sends
        self._latest_round: dict[str, int] = {}    # run id -> newest round the coordinator announced
        self._runs_seen: set[str] = set()
        self._finished = False
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
        sample = self.data.x[:1]
        self.transport.publish(self.topics.client(cid, "presence"), presence_payload(
            cid, "online", num_samples=len(self.data), input_shape=list(sample.shape[1:]),
            num_classes=int(self.data.y.max()) + 1 if len(self.data) else 0, device=device_facts()),
            retain=True)
        log.info("client %s online with %d samples", cid, len(self.data))
        while not self._finished and not (stop is not None and stop.is_set()):
            if self.settings.parent_pid and not psutil.pid_exists(self.settings.parent_pid):
                log.info("parent process %d is gone; leaving", self.settings.parent_pid)
                break
            incoming = self.transport.get(0.2)
            if incoming is not None:
                self._handle(incoming.topic, incoming.payload)
            self._resend_if_due()
        self.transport.publish(self.topics.client(cid, "presence"), presence_payload(cid, "offline"), retain=True)

    def _handle(self, topic: str, payload: bytes) -> None:
        try:
            msg = decode(payload, max_bytes=self.settings.max_message_bytes)
        except ProtocolError as exc:
            log.warning("ignored a message on %s: %s", topic, exc)
            return
        if topic == self.topics.coordinator_status:
            self._on_coordinator_status(msg)
        elif msg.kind == "task" and topic == self.topics.client(self.settings.client_id, "task"):
            self._on_task(msg)
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

    # -- tasks ----------------------------------------------------------------
    def _on_task(self, msg: Message) -> None:
        self._runs_seen.add(msg.run_id)
        if msg.task_id in self._done:  # the coordinator asked again: it missed our result
            self._send(msg, self._done[msg.task_id])
            return
        if msg.round < self._latest_round.get(msg.run_id, 0):
            log.info("skipped stale task %s for round %d", msg.task_id, msg.round)
            return
        self._latest_round[msg.run_id] = msg.round
        profiler = Profiler()
        try:
            tensors, output = self._execute(msg, profiler)
            body = {"num_samples": output.num_samples, "metrics": output.metrics}
        except (ObjectiveError, ModelSpecError, ProtocolError) as exc:
            log.warning("task %s failed: %s", msg.task_id, exc)
            tensors, body = {}, {"error": str(exc)}
        body["profile"] = profiler.summary()
        with profiler.phase("encode"):
            payload = encode("result", run_id=msg.run_id, round=msg.round, task_id=msg.task_id,
                             sender=self.settings.client_id, body=body, tensors=tensors)
        self._done = {msg.task_id: payload}
        self._send(msg, payload)
        self.tasks_run += 1
        self._write_profile(msg, body["profile"])

    def _execute(self, msg: Message, profiler: Profiler) -> tuple[dict[str, torch.Tensor], Any]:
        body = msg.body
        objective = OBJECTIVES.get(body.get("objective"))
        if objective is None:
            raise ObjectiveError(f"unknown objective {body.get('objective')!r}; this client knows {sorted(OBJECTIVES)}")
        with profiler.phase("decode"):
            model = self._model_for(body.get("model"))
            self._check_data_fits(body["model"])
            up = body.get("up")
            known = set(federated_names(model))
            if not isinstance(up, list) or not set(up) <= known:
                raise ProtocolError("the task's 'up' list names parameters this model does not have")
            shapes = state_shapes(model, names=[n for n in msg.tensors if n in known])
            if len(shapes) != len(msg.tensors):
                raise ProtocolError(f"task carries unknown tensors {sorted(set(msg.tensors) - known)[:5]}")
            for name, shape in shapes.items():
                t = msg.tensors[name]
                if tuple(t.shape) != shape or t.dtype != torch.float32:
                    raise ProtocolError(f"task tensor {name!r} is {t.dtype}{tuple(t.shape)}, expected float32{shape}")
            model.load_state_dict(msg.tensors, strict=False)
        seed = shuffle_seed(int(body.get("seed", 0)), msg.round, self.settings.client_id)
        with profiler.phase("train"):
            output = objective(model, self.data, body.get("hyper", {}), seed, profiler)
        state = model.state_dict()
        return {name: state[name].detach().clone() for name in up}, output

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
                                 give_up_at=now + float(body.get("timeout", 600)),
                                 resend_every=max(0.5, float(body.get("resend_every", 10))))
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
        self.settings.state_dir.mkdir(parents=True, exist_ok=True)
        line = {"time": time.time(), "run_id": task.run_id, "round": task.round, "task_id": task.task_id, **profile}
        with open(self.settings.state_dir / "profile.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\n")
