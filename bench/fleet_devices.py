"""The fleet benchmark's device processes: hundreds of stand-in devices, each the device's own code.

Each device is the product's :class:`~edge_client.device_shell.DeviceShell` over its own
:class:`~edge_client.wire.mqtt_transport.MqttTransport` (MQTT 5, persistent session, last will,
QoS 1, chunks through ``ChunkingTransport``): the device protocol, the result encoding (the task's
upload codec, differences from what was sent down, the envelope) and a secure round's stages are
the device's. Only the trainer is replaced: a think time drawn from ``--think`` in place of
training, then the tensors that were sent down plus a fixed perturbation.

Why devices are cheap enough to run 250 or more per process:

* **One selector per process** (:class:`~edge_client.wire.shared_loop.SharedLoop`, its module says
  what a paho thread per connection costs): every connection, decoding, timer and encoding of a
  device process runs on that one thread.
* **Shared tensors.** A device's update is the tensors the task sent down plus a fixed
  perturbation: a direction drawn once per process times a factor drawn once per device, so a
  device holds a float, not a model. A model broadcast that one device of the process has decoded
  is not decoded again by the others (the SHA-256 the task names proves the bytes are the same);
  each device still receives and reassembles it.
* **No error feedback** (``codec.error_feedback = false`` in the coordinator's configuration,
  which the tasks pass on): its residuals are model-sized state per device, and they do not
  change what goes on the wire.

Here is only the fleet's bookkeeping: per task a :class:`TaskRecord`, per process the counts
of connections, lost messages and traffic by the coordinator's round.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from edge_client.device_actions import Actions, Publish, Task
from edge_client.device_protocol import BroadcastCache, DeviceProtocol, presence_payload
from edge_client.device_shell import DeviceShell, Finish, PhaseClock, Trained
from edge_client.models import state_shapes
from edge_client.registry import build_model
from edge_client.secure_device import SecureRounds
from edge_client.wire.chunking import DEFAULT_PACKET_BYTES, HEADER_BYTES, ChunkingTransport
from edge_client.wire.protocol import DEFAULT_MAX_MESSAGE_BYTES, PresenceBody, ProtocolError, ResultBody, Topics
from edge_client.wire.shared_loop import SharedLoop
from edge_client.wire.transport import BrokerSettings, MqttTransport, Will
from edge_client.wire.updates import decode_download
from profiling.device import device_facts


class ThinkTime(Protocol):
    def draw(self, rng: random.Random) -> float: ...


@dataclass
class TaskRecord:
    """What one device saw of one task (wall-clock times, time.time())."""

    device: str
    round: int
    task_id: str
    received: float                 # the task reached the device's loop
    ready: float | None = None      # the model broadcast is there: thinking starts
    think: float | None = None
    answered: float | None = None   # the result was first published
    encode_s: float | None = None   # the result's encoding: its upload codec and its envelope
    result_bytes: int = 0           # one send of the result, chunk headers included
    chunks: int = 0
    resends: int = 0
    acked: float | None = None
    ack: str | None = None          # ack | rejected
    error: str | None = None


class Fleet:
    """The devices of one process and what they share: the network loop, caches and counters."""

    def __init__(self, brokers: list[str], ids: list[str], think: ThinkTime, seed: int, samples: int, *,
                 prefix: str, connect_window: int, max_message_bytes: int = DEFAULT_PACKET_BYTES,
                 drop: float = 0.0) -> None:
        """``brokers[i]``: the broker device ``ids[i]`` logs in to (the central one, or its site's); ``prefix``:
        the run's topic prefix; ``connect_window``: devices waiting for their CONNACK at once."""
        torch.set_num_threads(1)
        if len(brokers) != len(ids):
            raise ValueError(f"{len(ids)} devices need as many broker URLs, got {len(brokers)}")
        self.think = think
        self.seed = seed
        self.prefix = prefix
        self.connect_window = connect_window
        self.drop = drop   # secure rounds: chance that a device fails its mask task (a dropout after sharing)
        self.loop = SharedLoop()
        self.facts = device_facts()
        self.broadcasts = BroadcastCache()                               # digest -> wire tensors, codec: newest 2
        self.decoded: dict[tuple[str, str], dict[str, Any]] = {}         # (digest, spec) -> float32 tensors
        self.shapes: dict[str, dict[str, tuple[int, ...]]] = {}          # model spec (JSON) -> shapes
        self.directions: dict[str, dict[str, Any]] = {}                  # model spec (JSON) -> perturbation
        self.round = 0                                                   # the coordinator's round, for counting
        self.traffic: dict[int, list[int]] = {}                          # round -> [msgs in, bytes in, out, out]
        self.counts = {"lost_messages": 0, "undecodable": 0, "dropped_tasks": 0}
        self.dirty: set[Device] = set()
        self.max_message_bytes = max_message_bytes   # above a result's size with aggregation workers: unchunked
        self.devices = [Device(self, cid, samples, url) for cid, url in zip(ids, brokers)]
        self.connecting_at: float | None = None  # wall time when the first device started to connect
        self.connected_at: float | None = None   # wall time when every device had connected once

    def schedule(self, delay: float, action: Callable[[], None]) -> None:
        self.loop.call_later(delay, action)

    def count(self, direction: int, size: int) -> None:
        slot = self.traffic.setdefault(self.round, [0, 0, 0, 0])
        slot[2 * direction] += 1
        slot[2 * direction + 1] += size

    def totals(self) -> dict[str, int]:
        """The process's counts, with the connections its devices made and lost."""
        return {"connects": sum(d.link.connects for d in self.devices),
                "disconnects": sum(d.link.disconnects for d in self.devices), **self.counts}

    def model_shapes(self, spec: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        key = json.dumps(spec, sort_keys=True)
        if key not in self.shapes:
            self.shapes[key] = state_shapes(build_model(spec))
        return self.shapes[key]

    def direction(self, spec: dict[str, Any]) -> dict[str, Any]:
        """The process's perturbation direction for a model: small, seeded, computed once."""
        key = json.dumps(spec, sort_keys=True)
        if key not in self.directions:
            generator = torch.Generator().manual_seed(self.seed)
            self.directions[key] = {name: 1e-3 * torch.randn(shape, generator=generator)
                                    for name, shape in sorted(self.model_shapes(spec).items())}
        return self.directions[key]

    def received(self, digest: str | None, spec: dict[str, Any]) -> dict[str, Any]:
        """The float32 tensors of a broadcast, decoded once per process (while it is among the newest two)."""
        if digest is None:
            return {}
        key = (digest, json.dumps(spec, sort_keys=True))
        if key not in self.decoded:
            shared = self.broadcasts.get(digest)
            if shared is None:
                raise ProtocolError(f"the model broadcast {digest[:16]}... is no longer held")
            self.decoded = {k: v for k, v in self.decoded.items() if k[0] in self.broadcasts}
            self.decoded[key] = decode_download(*shared, self.model_shapes(spec))
        return self.decoded[key]

    def run(self, stop: Callable[[], bool]) -> None:
        """Connect every device, at most ``connect_window`` waiting for their CONNACK at a time, and
        serve until all have seen their run finish (or ``stop()``)."""
        waiting, opening = deque(self.devices), []
        self.connecting_at = time.time()
        while not stop() and not all(d.finished for d in self.devices):
            if waiting or opening:
                opening = [d for d in opening if not d.link.connected]
                while waiting and len(opening) < self.connect_window:
                    opening.append(waiting.popleft())
                    opening[-1].connect()
                if not waiting and not opening:
                    self.connected_at = time.time()
            self.loop.run_once(0.5)
            while self.dirty:
                self.dirty.pop().drain()

    def leave(self) -> None:
        """Every device says it is offline and disconnects once that is written (at most 10 s)."""
        for device in self.devices:
            device.leave()
        self.loop.flush(10.0)
        for device in self.devices:
            device.link.close()
        self.loop.wait_closed(2.0)


class _Held:
    """The model broadcasts one stand-in device received itself, over its process's shared cache: each
    device fetches a broadcast over MQTT as a device does, but the process decodes it only once."""

    def __init__(self, shared: Any) -> None:
        self.shared = shared
        self.digests: deque[str] = deque(maxlen=2)

    def __contains__(self, digest: object) -> bool:
        return digest in self.digests

    def get(self, digest: str) -> Any:
        return self.shared.get(digest) if digest in self.digests else None

    def receive(self, digest: str, read: Callable[[], Any]) -> int | None:
        round = self.shared.receive(digest, read)
        if round is not None:
            self.digests.append(digest)
        return round


class DroppingRounds(SecureRounds):
    """A device's secure rounds, failing its mask task when drawn to drop (``--secagg-drop``): a device
    whose masking failed after it shared its keys."""

    def __init__(self, seed: int, client_id: str, drop: float) -> None:
        super().__init__()
        self.seed, self.client_id, self.drop = seed, client_id, drop

    def answer(self, key: tuple[str, int], stage: Any) -> Any:
        if stage.stage == "mask" and random.Random(f"{self.seed}/{self.client_id}/{key[1]}").random() < self.drop:
            self.discard()
            raise ProtocolError("dropped out at the mask stage (--secagg-drop)")
        return super().answer(key, stage)


class Device:
    """One stand-in device: the device's shell over one connection of the process's loop, with this class as
    its trainer (a think time, then a fixed perturbation of what was sent down) and its watch (the records)."""

    COUNTED = {"ignored": "undecodable", "lost": "lost_messages", "dropped": "dropped_tasks"}   # note -> counter

    def __init__(self, fleet: Fleet, client_id: str, samples: int, url: str) -> None:
        self.fleet = fleet
        self.id = client_id
        self.topics = Topics(fleet.prefix)
        self.samples = samples
        rng = random.Random(f"{fleet.seed}/{client_id}")
        self.scale = rng.uniform(0.5, 1.5)        # this device's fixed perturbation: scale x the process's direction
        self.loss = rng.uniform(0.3, 0.9)
        self.rng = random.Random(f"{fleet.seed}/{client_id}/think")
        self.protocol = DeviceProtocol(client_id, self.topics, _Held(fleet.broadcasts),
                                       max_decoded_bytes=DEFAULT_MAX_MESSAGE_BYTES, exit_after_run=True)
        will = Will(self.topics.client(client_id, "presence"), presence_payload(client_id, PresenceBody("offline")))
        self.link = MqttTransport(BrokerSettings(url=url, protocol="5"), client_id, will=will, loop=fleet.loop,
                                  on_message=lambda: fleet.dirty.add(self), counter=fleet.count)
        self.transport = ChunkingTransport(self.link, max_message_bytes=fleet.max_message_bytes,
                                           max_decoded_bytes=DEFAULT_MAX_MESSAGE_BYTES)
        self.shell = DeviceShell(self.protocol, self.transport, self, watch=self,
                                 secure=DroppingRounds(fleet.seed, client_id, fleet.drop))
        self.records: list[TaskRecord] = []
        self.by_task: dict[str, TaskRecord] = {}
        self.tick_at: float | None = None   # when the protocol is next due, as scheduled

    @property
    def finished(self) -> bool:
        return self.protocol.finished

    def connect(self) -> None:
        self.shell.apply(self.protocol.start())
        online = PresenceBody("online", num_samples=self.samples, input_shape=(1, 28, 28), num_classes=10,
                              device=self.fleet.facts)
        self.shell.apply(self.protocol.announce(online, time.monotonic()))
        self.link.connect()

    def leave(self) -> None:
        if self.link.connected:
            self.shell.apply(self.protocol.leave())

    # -- events -----------------------------------------------------------------
    def drain(self) -> None:
        self.protocol.note_disconnects(self.transport.disconnects)
        while (item := self.transport.get(0.0)) is not None:
            self.shell.take(item)

    def _tick(self, at: float) -> None:
        if self.tick_at != at:   # an earlier tick took its place
            return
        self.tick_at = None
        self.shell.tick(time.monotonic())

    # -- the shell's watch: records and counts ----------------------------------------
    def taking(self, actions: Actions) -> None:
        """Keep this device's records of what the protocol decided, and wake it when it is next due."""
        for note in actions.notes:
            if note.kind in self.COUNTED:
                self.fleet.counts[self.COUNTED[note.kind]] += 1
        if actions.run_status is not None:
            _, round, state = actions.run_status
            if state == "running" and self.fleet.round >= 0:
                self.fleet.round = max(self.fleet.round, round)
            elif state == "finished" and self.protocol.finished:
                self.fleet.round = -1   # what follows (leaving) is counted apart from the rounds
        for task in actions.accepted:
            self.by_task[task.msg.task_id] = TaskRecord(self.id, task.msg.round, task.msg.task_id,
                                                        received=time.time())
            self.records.append(self.by_task[task.msg.task_id])
        for status in actions.acks:
            if (record := self.by_task.get(status.task_id or "")) is not None:
                record.acked, record.ack = time.time(), status.state
        due = self.protocol.due()
        if due is not None and (self.tick_at is None or due < self.tick_at):
            self.tick_at = due
            self.fleet.loop.call_at(due, lambda: self._tick(due))

    def published(self, message: Publish, sent: int) -> None:
        record = self.by_task.get(message.result_of) if message.result_of else None
        if record is not None:
            if record.answered is None:
                record.answered = time.time()
            else:
                record.resends += 1
            size, limit = len(message.payload), self.transport.max_message_bytes
            record.result_bytes = sent
            record.chunks = 1 if size <= limit else -(-size // (limit - HEADER_BYTES))

    # -- the shell's trainer: think, then perturb what was sent down ---------------------
    def clock(self, started: float) -> PhaseClock:
        return PhaseClock(started)

    def train(self, task: Task, finish: Finish) -> None:
        """Think in place of training; a task without its broadcast is answered at once."""
        if task.no_broadcast:
            finish(lambda: _fail(task.no_broadcast))
            return
        record = self.by_task[task.msg.task_id]
        record.ready = time.time()
        record.think = self.fleet.think.draw(self.rng)
        task.context.add("train", record.think)
        self.fleet.schedule(record.think, lambda: finish(lambda: self._trained(task)))

    def _trained(self, task: Task) -> Trained:
        """What training would have left: the tensors sent down plus this device's fixed perturbation."""
        msg, body = task.msg, task.body
        received = dict(self.fleet.received(body.broadcast, body.model))
        if msg.tensors:
            received.update(decode_download(msg.tensors, body.codec, self.fleet.model_shapes(body.model)))
        missing = sorted(set(body.up) - set(received))
        if missing:
            raise ProtocolError(f"this stand-in only answers with tensors it was sent; missing {missing[:3]}")
        direction = self.fleet.direction(body.model)
        update = {name: received[name] + self.scale * direction[name] for name in body.up}
        return Trained(update, received, self.samples, {"train_loss": self.loss}, seed=body.seed)

    def sent(self, task: Task, answer: ResultBody, payload: bytes) -> None:
        record = self.by_task.get(task.msg.task_id)
        if record is not None:
            record.error = record.error or answer.error
            phases = task.context.phases
            record.encode_s = phases.get("codec", 0.0) + phases.get("encode", 0.0)


def _fail(reason: str) -> Trained:
    raise ProtocolError(reason)


def quiet() -> None:
    """A device process logs only errors: what the devices' notes say is counted (``Fleet.counts``)."""
    logging.getLogger("fedge").setLevel(logging.ERROR)
