"""A device's side of the fedge protocol, with no I/O: what to do when a message comes, time passes
or a task's answer is ready.

The device's client (:mod:`edge_client.client`) and the fleet benchmark's stand-in devices
(``bench/fleet.py``) must play the protocol the same way, or the benchmark measures a device that
does not exist. So the rules live here once: presence and its echo, the coordinator's run status
(sessions, ``stopped`` and ``finished``, tasks that came before any status), which tasks run, the
wait for a task's model broadcast (or its delta, rebuilt on the model this device holds), and sending a
result until it is acknowledged. Each caller keeps
only its I/O and its work: it feeds :class:`DeviceProtocol` events (:meth:`~DeviceProtocol.handle`,
:meth:`~DeviceProtocol.tick`, :meth:`~DeviceProtocol.answered`) with the time, and carries out the
:class:`Actions` it gets back (publish, subscribe, execute a task, log), both through the one
:class:`~edge_client.device_shell.DeviceShell`. No clock is read here and
nothing blocks, so every rule is testable without a broker.

Nothing received is trusted: a message that does not decode or parse becomes a :class:`Note` with
the reason, never an exception.

The types passed to and fro live in :mod:`edge_client.device_actions`, the broadcasts a device holds
in :mod:`edge_client.broadcast_cache` and the wait for one in :mod:`edge_client.broadcast_wait`;
callers keep importing them from here.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from edge_client.broadcast_cache import Broadcast, BroadcastCache, Broadcasts
from edge_client.broadcast_wait import BROADCAST_PATIENCE, BroadcastWait  # noqa: F401  (re-exported)
from edge_client.device_actions import Actions, Note, Publish, Task
from edge_client.wire.codec import FP32
from edge_client.wire.model_delta import apply_delta, exact_model, model_digest
from edge_client.wire.protocol import (DEFAULT_MAX_MESSAGE_BYTES, DeltaBody, Message, ModelBody, PresenceBody,
                                       ProtocolError, ResultBody, StatusBody, TaskBody, Topics, decode, encode)

__all__ = ["Actions", "BroadcastCache", "Broadcasts", "DeviceProtocol", "Note", "Publish", "Task", "presence_payload",
           "ONLINE_LINE"]

# The line a device logs when the broker passed its presence back: it is announced, a coordinator sees it.
ONLINE_LINE = "online: the broker passed on this device's presence on"
PARKED_PATIENCE = 15.0     # seconds tasks may wait for a run status before the device says it sees none
KEEP_PARKED = 8            # tasks kept while no run status has come; the coordinator re-sends the others
KEEP_CLOSED = 64           # closed task ids remembered: a closed task arriving late is not run
KEEP_HELD = 2              # model broadcasts this device took itself, as many as a BroadcastCache keeps


def presence_payload(client_id: str, body: PresenceBody) -> bytes:
    """A presence in the envelope every device message has; the client and the fleet's devices send the same bytes."""
    return encode("presence", run_id="", round=0, task_id="", sender=client_id, body=body.to_body())


@dataclass
class _Pending:
    """A result sent but not yet acknowledged; re-sent until ack or give-up time, each wait twice the last.

    The re-send covers a message the broker lost (a restart without persistence); a result
    that is merely queued behind a busy coordinator is not lost, and re-sending it every
    ``resend_every`` seconds would add a copy of every queued result to the queue. Doubling
    the wait, as TCP does, keeps the first re-send prompt and stops that pile-up."""

    run_id: str
    round: int
    task_id: str
    payload: bytes
    give_up_at: float
    resend_every: float
    next_send_at: float = 0.0
    closed: bool = False   # its round closed without it: sent until acknowledged, even once a later round began


class DeviceProtocol:
    """One device's protocol state; every method takes the time (``now``, a monotonic clock in seconds)
    from the caller and returns the :class:`Actions` to carry out."""

    def __init__(self, client_id: str, topics: Topics, broadcasts: Broadcasts | None = None, *,
                 max_decoded_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, exit_after_run: bool = False,
                 presence_echo_timeout: float = 10.0) -> None:
        self.client_id = client_id
        self.topics = topics
        self.broadcasts: Broadcasts = broadcasts if broadcasts is not None else BroadcastCache()
        self.max_decoded_bytes = max_decoded_bytes
        self.exit_after_run = exit_after_run     # finished once a run this device took part in finishes
        self.presence_echo_timeout = presence_echo_timeout
        self.done: dict[str, bytes | None] = {}  # task id -> result payload for re-sends; None once acknowledged
        self.finished = False
        self._pending: _Pending | None = None
        self._latest_round: dict[str, int] = {}  # run id -> newest round the coordinator announced
        self._runs_seen: set[str] = set()
        self._runs_trained: set[str] = set()     # runs this device got a task of
        self._runs_ended: set[str] = set()
        # The coordinator's current running run, from its retained status ("" once it finished). Only its
        # tasks run: a persistent session can hold tasks a dead run queued, and training them is waste.
        self._running_run: str | None = None     # None: no status seen yet
        self._sessions: dict[str, str] = {}      # run id -> the coordinator session last heard running it
        self._parked: list[Task] = []            # tasks that came before any run status
        self._parked_since: float | None = None
        self._presence = b""                     # the presence we announced, and when it must have come back
        self._echo_due: float | None = None
        self._wait = BroadcastWait(topics.model)   # a task waiting for its broadcast
        self._closed: dict[str, None] = {}       # tasks the coordinator closed (its round counted enough), oldest first
        # The broadcasts this device took itself (by SHA-256, oldest first), each with the digest of its model when
        # a task named it (delta broadcasts), "" otherwise. A store shared by clients in one process holds what
        # any of them took; a device holds only what it received, as a device on its own does.
        self._held: OrderedDict[str, str] = OrderedDict()

    # -- presence ---------------------------------------------------------------
    def start(self) -> Actions:
        """Subscribe to this device's topics, its own presence too: to see that the broker passes on what
        it publishes. Before :meth:`announce`, so that no task sent in answer is missed."""
        out = Actions()
        out.subscribe = [(self.topics.client(self.client_id, kind), False) for kind in ("task", "status", "presence")]
        out.subscribe.append((self.topics.coordinator_status, False))
        return out

    def announce(self, presence: PresenceBody, now: float) -> Actions:
        """Say this device is online; the presence must come back from the broker within the echo timeout."""
        out = Actions()
        self._presence = presence_payload(self.client_id, presence)
        self._echo_due = now + self.presence_echo_timeout
        out.publish.append(Publish(self._presence_topic, self._presence, retain=True, announce=True))
        return out

    def leave(self) -> Actions:
        """Say this device is offline, retained: else the retained online presence outlives the device."""
        out = Actions()
        out.publish.append(Publish(self._presence_topic, presence_payload(self.client_id, PresenceBody("offline")),
                                   retain=True))
        return out

    @property
    def _presence_topic(self) -> str:
        return self.topics.client(self.client_id, "presence")

    def note_disconnects(self, total: int) -> None:
        """The transport's count of lost connections so far: a broadcast missed meanwhile is explained by it."""
        self._wait.disconnects = total

    # -- events -------------------------------------------------------------------
    def handle(self, topic: str, payload: bytes, now: float) -> Actions:
        """A message arrived on ``topic``."""
        out = Actions()
        if topic == self._presence_topic:
            if payload == self._presence and self._echo_due is not None:
                self._echo_due = None   # the broker passes on what we publish
                # said once per announcement: the flash kit's install.sh waits for this line in the journal
                out.note("activity", logging.INFO, f"{ONLINE_LINE} {topic}")
            return out
        if topic == self.topics.model:
            self._on_model(payload, now, out)
            return out
        if topic == self.topics.model_delta:
            self._on_delta(payload, now, out)
            return out
        try:
            msg = decode(payload, max_bytes=self.max_decoded_bytes)
        except ProtocolError as exc:
            out.note("ignored", logging.WARNING, f"ignored a message on {topic}: {exc}")
            return out
        if msg.kind == "status" and topic == self.topics.coordinator_status:
            self._on_run_status(msg, now, out)
        elif msg.kind == "task" and topic == self.topics.client(self.client_id, "task"):
            task = Task.read(msg)
            out.arrived.append(task)
            self._take(task, now, out)
        elif msg.kind == "status":
            self._on_ack(msg, out)
        return out

    def lost(self, topic: str, reason: str) -> Actions:
        """A message on ``topic`` whose chunks did not make a whole one."""
        out = Actions()
        out.note("lost", logging.WARNING, f"lost a message on {topic}: {reason}")
        return out

    def tick(self, now: float) -> Actions:
        """Time passed: give up waiting for a broadcast, warn once about what is missing, re-send."""
        out = Actions()
        expired = self._wait.expired(now, out)
        if expired is not None and self._fresh(expired, now, out):
            out.run.append(expired)
        if self._echo_due is not None and now > self._echo_due:
            self._echo_due = None
            out.note("unseen", logging.ERROR,
                     f"this device's presence on {self._presence_topic} did not come back from the broker within "
                     f"{self.presence_echo_timeout:.0f} s, so no coordinator can see it: the broker drops what it "
                     "publishes. Check the broker's ACL; with fedge's ACL (deploy/mosquitto.acl) --client-id must "
                     "equal the MQTT --username")
        if self._parked and self._parked_since is not None and now - self._parked_since > PARKED_PATIENCE:
            out.note("parked", logging.WARNING,
                     f"tasks are waiting for the coordinator's run status on {self.topics.coordinator_status}, "
                     "which has not arrived; check that this device may read that topic (the broker's ACL)")
            self._parked_since = None
        self._resend_if_due(now, out)
        return out

    def due(self) -> float | None:
        """The earliest time :meth:`tick` has something to do, for a caller that sleeps between events."""
        times = [self._echo_due, self._wait.due()]
        if self._parked and self._parked_since is not None:
            times.append(self._parked_since + PARKED_PATIENCE)
        if self._pending is not None:
            times += [self._pending.next_send_at, self._pending.give_up_at]
        return min((t for t in times if t is not None), default=None)

    def answered(self, task: Task, payload: bytes, now: float) -> Actions:
        """The result of ``task`` is ready: send it, and again until acknowledged or given up."""
        out = Actions()
        self.done = {task.msg.task_id: payload}
        self._send(task, payload, now, out)
        return out

    def send_failed(self, task_id: str, reason: str, *, too_large: bool) -> Actions:
        """Publishing a result failed. Over the broker's limit (learned too late): say so instead of the
        result; any other failure: stop sending it."""
        out, p = Actions(), self._pending
        if p is None or p.task_id != task_id:
            return out
        if too_large:
            out.note("unsent", logging.ERROR, f"could not send result of {task_id}: {reason}")
            p.payload = encode("result", run_id=p.run_id, round=p.round, task_id=p.task_id, sender=self.client_id,
                               body=ResultBody(error=reason).to_body())
            p.next_send_at = 0.0
        else:
            out.note("unsent", logging.WARNING, f"could not send result of {task_id}: {reason}")
            self._pending = None
        return out

    # -- the run status -------------------------------------------------------------
    def _on_run_status(self, msg: Message, now: float, out: Actions) -> None:
        try:
            status = StatusBody.from_body(msg.body)
        except ProtocolError as exc:
            out.note("ignored", logging.WARNING, f"ignored the coordinator's status: {exc}")
            return
        out.run_status = (msg.run_id, msg.round, status.state)
        if status.state == "running":
            self._on_running(msg, status, out)
        elif status.state == "stopped":
            # Its coordinator stopped (Ctrl-C, SIGTERM, an error) and may resume it: its queued tasks are waste.
            if self._running_run in (None, msg.run_id):
                self._running_run = ""
                if msg.run_id in self._runs_trained:
                    out.note("activity", logging.INFO, f"run {msg.run_id} stopped by its coordinator; waiting for "
                                                       "it to resume or a new run")
            if self._pending is not None and self._pending.run_id == msg.run_id:
                self._pending = None
        elif status.state == "finished":
            self._running_run = "" if self._running_run in (None, msg.run_id) else self._running_run
            if msg.run_id in self._runs_trained and msg.run_id not in self._runs_ended:
                out.note("activity", logging.INFO, f"run {msg.run_id} finished")
            self._runs_ended.add(msg.run_id)
            if msg.run_id in self._runs_seen:
                self._pending = None
                self.finished = self.finished or self.exit_after_run
        parked, self._parked = self._parked, []
        for task in parked:
            self._take(task, now, out)

    def _on_running(self, msg: Message, status: StatusBody, out: Actions) -> None:
        self._running_run = msg.run_id
        self._runs_seen.add(msg.run_id)
        known = self._sessions.get(msg.run_id)
        if status.session and known is not None and status.session != known:
            # The run resumed from a checkpoint: the rounds since come again, so none of them is stale.
            out.note("activity", logging.INFO, f"run {msg.run_id} resumed by its coordinator at round {msg.round}")
            self._latest_round[msg.run_id] = msg.round
            self._pending = None   # counted as late by the resumed coordinator at best
        else:
            self._latest_round[msg.run_id] = max(self._latest_round.get(msg.run_id, 0), msg.round)
        if status.session:
            self._sessions[msg.run_id] = status.session

    # -- tasks --------------------------------------------------------------------
    def _take(self, task: Task, now: float, out: Actions) -> None:
        """Run a new task if it belongs to the coordinator's current running run; park it while no run
        status has arrived (the retained status may come after a persistent session's queued tasks)."""
        run, task_id = task.msg.run_id, task.msg.task_id
        if self._running_run is None:
            if not self._parked:
                self._parked_since = now
            self._parked = [*self._parked[1 - KEEP_PARKED:], task]
            return
        if run != self._running_run:
            out.note("dropped", logging.INFO, f"dropped task {task_id} of run {run}: it is not the coordinator's "
                                              f"current run ({self._running_run or 'none running'})")
            return
        session = task.body.session if task.body is not None else ""
        if session and session != self._sessions.get(run, session):
            out.note("dropped", logging.INFO, f"dropped task {task_id} of run {run}: a coordinator that has since "
                                              "stopped gave it")
            return
        if self._fresh(task, now, out):
            out.accepted.append(task)
            if not self._needs_broadcast(task, now, out):
                out.run.append(task)

    def _fresh(self, task: Task, now: float, out: Actions) -> bool:
        """Whether the task is to run: not answered already (the stored result goes again, unless
        acknowledged) and not of a round older than the newest announced."""
        msg = task.msg
        self._runs_seen.add(msg.run_id)
        self._runs_trained.add(msg.run_id)
        if msg.task_id in self.done:
            payload = self.done[msg.task_id]
            if payload is not None:
                self._send(task, payload, now, out)
            return False
        if msg.round < self._latest_round.get(msg.run_id, 0):
            out.note("stale", logging.INFO, f"skipped stale task {msg.task_id} for round {msg.round}")
            return False
        if msg.task_id in self._closed:
            out.note("stale", logging.INFO, f"skipped task {msg.task_id}: round {msg.round} closed without it")
            return False
        self._latest_round[msg.run_id] = msg.round
        return True

    def _on_ack(self, msg: Message, out: Actions) -> None:
        try:
            status = StatusBody.from_body(msg.body)
        except ProtocolError as exc:
            out.note("ignored", logging.WARNING, f"ignored a status: {exc}")
            return
        if status.state == "closed":
            self._on_closed(status, out)
            return
        if self._pending is not None and status.task_id == self._pending.task_id:
            if status.state == "rejected":
                out.note("rejected", logging.WARNING,
                         f"coordinator rejected result of {status.task_id}: {status.reason}")
            self._pending = None
            self.done[status.task_id] = None   # the coordinator has it: keep no copy (a model's size)
            out.acks.append(status)

    def _on_closed(self, status: StatusBody, out: Actions) -> None:
        """The coordinator closed a task's round with the results it counts (over-selection): the task is not run
        if it has not started. A result of it, sent or still to come, goes until acknowledged (counted as late,
        never aggregated), a later round notwithstanding: the coordinator measures this device's round time by it."""
        if status.task_id is None:
            return
        self._closed[status.task_id] = None
        while len(self._closed) > KEEP_CLOSED:
            del self._closed[next(iter(self._closed))]
        if self._pending is not None and self._pending.task_id == status.task_id:
            self._pending.closed = True
        out.note("closed", logging.INFO, f"task {status.task_id} closed by the coordinator: {status.reason}")

    # -- the model broadcast ----------------------------------------------------------
    def _on_model(self, payload: bytes, now: float, out: Actions) -> None:
        digest = hashlib.sha256(payload).hexdigest()

        def read() -> Broadcast | None:
            msg = decode(payload, max_bytes=self.max_decoded_bytes)
            return (msg.tensors, ModelBody.from_body(msg.body).codec, msg.round) if msg.kind == "model" else None

        try:
            round = self.broadcasts.receive(digest, read)
        except ProtocolError as exc:
            out.note("ignored", logging.WARNING, f"ignored a model broadcast: {exc}")
            self._wait.saw(f"a broadcast that was refused ({exc})")
            return
        if round is None:
            return
        self._wait.saw(f"the broadcast of round {round} ({digest[:16]}...)")
        waiting = self._wait.task.body if self._wait.task is not None else None
        # the model's digest, when the task waiting for this broadcast names it (delta broadcasts): a base for the next
        self._hold(digest, (waiting.model_digest or "") if waiting is not None and waiting.broadcast == digest else "")
        task = self._wait.came(digest, now, out)
        if task is not None and self._fresh(task, now, out):
            out.run.append(task)

    def _on_delta(self, payload: bytes, now: float, out: Actions) -> None:
        """A delta broadcast: rebuild the waiting task's model on the base this device holds and check it against
        the digest the task names; on any problem, fetch the full broadcast instead."""
        task = self._wait.task
        body = task.body if task is not None else None
        if task is None or body is None or not body.offers_delta or body.broadcast is None:
            return   # nothing waits for a delta (one retained from before this device's wait ended)
        digest = hashlib.sha256(payload).hexdigest()
        if digest != body.delta_broadcast:
            self._wait.saw(f"a delta broadcast of another model ({digest[:16]}...)")
            return
        try:
            round = self.broadcasts.receive(body.broadcast, lambda: self._rebuild(payload, body))
        except ProtocolError as exc:
            out.note("ignored", logging.WARNING, f"the delta broadcast {digest[:16]}... failed its checks ({exc}); "
                                                 "fetching the full model broadcast instead")
            task.model_from = "bad_delta"
            self._wait.saw(f"a delta broadcast that was refused ({exc})")
            self._wait.switch(self.topics.model, out)
            return
        self._wait.saw(f"the delta broadcast of round {round} ({digest[:16]}...)")
        self._hold(body.broadcast, body.model_digest or "")
        ready = self._wait.came(body.broadcast, now, out)
        if ready is not None and self._fresh(ready, now, out):
            out.run.append(ready)

    def _rebuild(self, payload: bytes, task: TaskBody) -> Broadcast:
        """The model a delta message gives on the base the task names, as the broadcast it stands for (float32,
        so that it is a base for the next delta); ProtocolError unless its digest is the task's ``model_digest``."""
        msg = decode(payload, max_bytes=self.max_decoded_bytes)
        if msg.kind != "delta":
            raise ProtocolError(f"a {msg.kind!r} message came on the delta topic")
        delta = DeltaBody.from_body(msg.body)
        if (delta.base, delta.result) != (task.delta_base, task.model_digest):
            raise ProtocolError("the delta's base and result digests are not the ones its task names")
        base = self._base(delta.base)
        if base is None:
            raise ProtocolError(f"the model {delta.base[:16]}... the delta applies to is no longer held")
        model = apply_delta(base, msg.tensors, delta.codec)
        if model_digest(model) != delta.result:
            raise ProtocolError(f"the rebuilt model's digest is not {delta.result[:16]}..., the one the task names")
        return model, FP32, msg.round

    def _hold(self, digest: str, model: str) -> None:
        """This device took the broadcast ``digest`` (carrying the model whose digest is ``model``, "" unknown)."""
        self._held[digest] = model or self._held.get(digest, "")
        self._held.move_to_end(digest)
        while len(self._held) > KEEP_HELD:
            self._held.popitem(last=False)

    def _holds(self, digest: str) -> bool:
        return digest in self._held and digest in self.broadcasts

    def _base(self, model: str | None) -> dict[str, torch.Tensor] | None:
        """The float32 tensors of the model whose digest is ``model``, if this device holds a broadcast of it."""
        for digest, held in reversed(self._held.items()):
            if model and held == model:
                got = self.broadcasts.get(digest)
                if got is not None:
                    return exact_model(*got)
        return None

    def _needs_broadcast(self, task: Task, now: float, out: Actions) -> bool:
        """Park a task whose broadcast is not here yet and fetch it: its delta (the retained delta topic) when this
        device holds the model the delta applies to, else the full broadcast (the retained model topic)."""
        body = task.body
        digest = body.broadcast if body is not None else None
        if body is None or digest is None or self._holds(digest):
            if body is not None and digest is not None and body.model_digest is not None:
                task.model_from = "held"
            self._wait.stop(out)
            return False
        if body.offers_delta and self._base(body.delta_base) is not None:
            task.model_from = "delta"
            self._wait.begin(task, now, out, self.topics.model_delta)
            return True
        if body.model_digest is not None:
            task.model_from = "no_base" if body.offers_delta else "full"
        self._wait.begin(task, now, out, self.topics.model)
        return True

    def missing_broadcast(self, task: Task) -> str:
        """Why a task's broadcast is not here, for the error a task run without it answers with."""
        return self._wait.explain(task)

    # -- results ---------------------------------------------------------------------
    def _send(self, task: Task, payload: bytes, now: float, out: Actions) -> None:
        msg = task.msg
        self._pending = _Pending(msg.run_id, msg.round, msg.task_id, payload, give_up_at=now + task.timeout,
                                 resend_every=max(0.5, task.resend_every), closed=msg.task_id in self._closed)
        self._resend_if_due(now, out)

    def _resend_if_due(self, now: float, out: Actions) -> None:
        p = self._pending
        if p is None:
            return
        if now > p.give_up_at or (p.round < self._latest_round.get(p.run_id, 0) and not p.closed):
            self._pending = None
            return
        if now >= p.next_send_at:
            out.publish.append(Publish(self.topics.client(self.client_id, "result"), p.payload, result_of=p.task_id))
            p.next_send_at = now + p.resend_every
            p.resend_every *= 2
