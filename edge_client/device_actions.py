"""What passes between the device's protocol and its caller: the tasks it reads and the actions it hands back.

The protocol does no I/O, so everything it decides must come back as data the caller carries out
(publish, subscribe, execute, log); these types are that contract, shared by the device's client
and the fleet benchmark's stand-in devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edge_client.wire.protocol import (DEFAULT_RESEND_EVERY, DEFAULT_TASK_TIMEOUT, Message, ProtocolError, StatusBody,
                                       TaskBody)

__all__ = ["Actions", "Note", "Publish", "Task"]


@dataclass(eq=False)
class Task:
    """A task message with its body parsed once; ``body`` is None when it does not parse (``problem``: why).

    ``context`` is the caller's own record of the task (a profiler, a benchmark's timings), carried
    along while the task waits for a run status or its broadcast.
    """

    msg: Message
    body: TaskBody | None
    problem: str = ""
    context: Any = None
    fetch_seconds: float | None = None   # how long it waited for its broadcast, once the broadcast came
    no_broadcast: str = ""               # why it runs without its broadcast: the wait was given up
    model_from: str | None = None        # how it came by its broadcast (MODEL_FROM), with delta broadcasts

    @classmethod
    def read(cls, msg: Message) -> Task:
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


@dataclass(frozen=True)
class Publish:
    """A message to publish; the flags tell the transport what the protocol cannot do itself."""

    topic: str
    payload: bytes
    retain: bool = False
    announce: bool = False   # the online presence: the transport repeats it after every reconnect
    result_of: str = ""      # a result's task id: report a failed send with DeviceProtocol.send_failed


@dataclass(frozen=True)
class Note:
    """Something to log, and what it was for a caller that counts: ``ignored`` (a message refused,
    with the reason), ``lost`` (chunks that did not reassemble), ``dropped`` (a task not of the
    current run or session), ``stale``, ``rejected`` (our result), ``unsent``, ``unseen`` (our
    presence never came back), ``parked`` (no run status), ``activity`` (a line for the person at
    the device)."""

    kind: str
    level: int
    text: str


@dataclass
class Actions:
    """What the caller does after an event, in this order: log, subscribe, publish, execute tasks."""

    notes: list[Note] = field(default_factory=list)
    subscribe: list[tuple[str, bool]] = field(default_factory=list)     # (topic filter, with chunk parts)
    unsubscribe: list[tuple[str, bool]] = field(default_factory=list)
    publish: list[Publish] = field(default_factory=list)
    run: list[Task] = field(default_factory=list)        # execute each, then call answered()
    arrived: list[Task] = field(default_factory=list)    # read from this message, before anything is decided
    accepted: list[Task] = field(default_factory=list)   # new tasks of the current run: they will run
    acks: list[StatusBody] = field(default_factory=list)  # the coordinator's answer to our pending result
    run_status: tuple[str, int, str] | None = None       # (run id, round, state) of a run status taken in

    def note(self, kind: str, level: int, text: str) -> None:
        self.notes.append(Note(kind, level, text))
