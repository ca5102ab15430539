"""The bodies of the messages a device exchanges: presence, task, result, status and the model broadcast.

Each kind's body is a frozen dataclass: ``to_body()`` gives the JSON object a message
carries and ``from_body()`` parses one, checking every field's type and raising
ProtocolError that names the field (:mod:`edge_client.wire.body_fields`). Codec specs
in a body are parsed here, once per message. ``docs/protocol.md`` describes the same
thing for people; keep both true.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from edge_client.wire.body_fields import Fields, is_int, is_names, is_number, is_object, is_session, is_sha256, is_str
from edge_client.wire.codec import FP32, CodecSpec
from edge_client.wire.errors import ProtocolError

__all__ = ["DEFAULT_TASK_TIMEOUT", "DEFAULT_RESEND_EVERY", "UPDATES", "PRESENCE_STATES", "STATUS_STATES",
           "REFUSAL_APP", "UploadSettings", "PresenceBody", "TaskBody", "ResultBody", "StatusBody", "ModelBody"]

DEFAULT_TASK_TIMEOUT = 600.0     # a task's ``timeout`` when it has none
DEFAULT_RESEND_EVERY = 10.0      # a task's ``resend_every`` when it has none
UPDATES = ("delta", "raw")
PRESENCE_STATES = ("online", "offline")
STATUS_STATES = ("ack", "rejected", "closed", "running", "finished", "stopped")
# A failed result's ``refusal`` when the device's installed app is not the task's: it refuses every task of the run
# until the run's app is installed (edge_client.app.AppMismatch). Other kinds may come: a reader that does not know
# one takes the result as a plain failure.
REFUSAL_APP = "app"
_REFUSAL_RE = re.compile(r"^[a-z_]{1,32}$")


@dataclass(frozen=True)
class UploadSettings:
    """How a client answers a task: the task body's ``upload`` object.

    A task without one gets raw float32 values; in one, ``update`` defaults to
    ``delta``, ``codec`` to ``fp32`` and ``error_feedback`` to true. ``clip_norm``
    (differential privacy, docs/privacy.md): the L2 norm the whole update
    (every difference together) is clipped to before it is encoded; None: no clipping.
    ``noise_multiplier`` (local differential privacy): the device adds N(0, (z x clip_norm)^2)
    to every coordinate of the clipped update before it is encoded, and reports nothing about
    its data besides; None: no noise on the device (it needs ``clip_norm``).
    """

    codec: CodecSpec = FP32
    update: str = "raw"              # delta | raw
    error_feedback: bool = False
    clip_norm: float | None = None
    noise_multiplier: float | None = None

    def __post_init__(self) -> None:
        if self.noise_multiplier is not None and self.clip_norm is None:
            raise ProtocolError("task field upload.noise_multiplier needs upload.clip_norm: the noise is a multiple "
                                "of the bound the update is clipped to")

    @classmethod
    def from_body(cls, upload: Any) -> UploadSettings:
        f = Fields("task", upload, "upload.")
        clip = f.get("clip_norm", "a positive number", lambda v: is_number(v) and v > 0, None)
        noise = f.get("noise_multiplier", "a number >= 0", lambda v: is_number(v) and v >= 0, None)
        return cls(codec=f.codec("codec"),
                   update=f.get("update", f"one of {UPDATES}", lambda v: v in UPDATES, "delta"),
                   error_feedback=f.get("error_feedback", "true or false", lambda v: isinstance(v, bool), True),
                   clip_norm=None if clip is None else float(clip),
                   noise_multiplier=None if noise is None else float(noise))

    def to_body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"codec": self.codec.text, "update": self.update, "error_feedback": self.error_feedback}
        if self.clip_norm is not None:
            out["clip_norm"] = self.clip_norm
        if self.noise_multiplier is not None:
            out["noise_multiplier"] = self.noise_multiplier
        return out


@dataclass(frozen=True)
class PresenceBody:
    """A ``presence`` body: a client is online (with facts about its data and device) or offline."""

    state: str                                  # online | offline
    num_samples: int | None = None              # size of its training data
    input_shape: tuple[int, ...] | None = None  # [C, H, W] of its images
    num_classes: int | None = None              # its largest label + 1
    device: dict[str, Any] | None = None        # profiling.device facts

    @classmethod
    def from_body(cls, body: Any) -> PresenceBody:
        f = Fields("presence", body)
        count = "a non-negative integer"
        shape = f.get("input_shape", "a list of non-negative integers",
                      lambda v: isinstance(v, list) and all(is_int(d) and d >= 0 for d in v), None)
        return cls(state=f.get("state", f"one of {PRESENCE_STATES}", lambda v: v in PRESENCE_STATES),
                   num_samples=f.get("num_samples", count, lambda v: is_int(v) and v >= 0, None),
                   input_shape=None if shape is None else tuple(shape),
                   num_classes=f.get("num_classes", count, lambda v: is_int(v) and v >= 0, None),
                   device=f.get("device", "an object", is_object, None))

    def to_body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state}
        for key in ("num_samples", "input_shape", "num_classes", "device"):
            value = getattr(self, key)
            if value is not None:
                out[key] = list(value) if key == "input_shape" else value
        return out


@dataclass(frozen=True)
class TaskBody:
    """A ``task`` body: what one client is asked to do and how to answer."""

    objective: str                     # a registered objective: train, evaluate, a method's own
    model: dict[str, Any]              # the model spec the client builds the network from
    up: tuple[str, ...]                # names of the tensors to send back
    hyper: dict[str, Any] = field(default_factory=dict)
    upload: UploadSettings = UploadSettings()
    codec: CodecSpec = FP32            # the codec of this message's tensors
    broadcast: str | None = None       # SHA-256 of the model message with the shared tensors
    seed: int = 0                      # the run's seed
    timeout: float = DEFAULT_TASK_TIMEOUT
    resend_every: float = DEFAULT_RESEND_EVERY
    deadline: float | None = None      # Unix time the coordinator stops waiting; informational
    session: str = ""                  # the coordinator session that gave the task (see StatusBody)
    # A stage of secure aggregation (edge_client/secagg/stages.py parses it); None: an ordinary task.
    secagg: dict[str, Any] | None = None

    @classmethod
    def from_body(cls, body: Any) -> TaskBody:
        f = Fields("task", body)
        seconds = "a positive number of seconds"
        upload = f.get("upload", "an object", is_object, None)
        return cls(objective=f.get("objective", "an objective name", is_str),
                   model=f.get("model", "a model spec object", is_object),
                   up=tuple(f.get("up", "a list of tensor names", is_names)),
                   hyper=f.get("hyper", "an object", is_object, {}),
                   upload=UploadSettings() if upload is None else UploadSettings.from_body(upload),
                   codec=f.codec("codec"),
                   broadcast=f.get("broadcast", "a SHA-256 in lowercase hex (64 characters)", is_sha256, None),
                   seed=f.get("seed", "an integer", is_int, 0),
                   timeout=float(f.get("timeout", seconds, lambda v: is_number(v) and v > 0, DEFAULT_TASK_TIMEOUT)),
                   resend_every=float(f.get("resend_every", seconds, lambda v: is_number(v) and v > 0,
                                            DEFAULT_RESEND_EVERY)),
                   deadline=f.get("deadline", "a Unix time", is_number, None),
                   session=f.get("session", "1 to 32 lowercase hex digits", is_session, ""),
                   secagg=f.get("secagg", "an object", is_object, None))

    def to_body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"objective": self.objective, "hyper": self.hyper, "model": self.model,
                               "up": list(self.up), "seed": self.seed, "timeout": self.timeout,
                               "resend_every": self.resend_every}
        if self.deadline is not None:
            out["deadline"] = self.deadline
        out["upload"] = self.upload.to_body()
        if self.broadcast is not None:
            out["broadcast"] = self.broadcast
        out["codec"] = self.codec.text
        if self.session:
            out["session"] = self.session
        if self.secagg is not None:
            out["secagg"] = self.secagg
        return out


@dataclass(frozen=True)
class ResultBody:
    """A ``result`` body: a client's answer to one task, or (``error``) why it could not run it.

    A failed result carries only ``error`` and ``profile``; the other fields are
    left at their defaults and are not read.
    """

    num_samples: int = 0                         # positive; the result's aggregation weight
    metrics: dict[str, float] = field(default_factory=dict)
    codec: CodecSpec = FP32                      # the codec of the result's tensors
    delta: tuple[str, ...] = ()                  # the tensors sent as differences
    profile: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    secagg: dict[str, Any] | None = None         # a secure-aggregation stage's answer (edge_client/secagg/stages.py)
    # With ``error``: the device will refuse every further task of the run (its own privacy budget is spent or
    # cannot cover the run's tasks), so drawing it again only wastes a place in a round.
    withdrawn: bool = False
    # With ``error``: what kind of refusal it is, for a coordinator to act on without reading the text
    # (REFUSAL_APP: the device's app differs from the task's); "" for any other failure.
    refusal: str = ""

    @classmethod
    def from_body(cls, body: Any) -> ResultBody:
        f = Fields("result", body)
        profile = f.get("profile", "an object", is_object, {})
        if "error" in f:
            return cls(error=f.get("error", "a string", is_str), profile=profile,
                       withdrawn=f.get("withdrawn", "true or false", lambda v: isinstance(v, bool), False),
                       refusal=f.get("refusal", "1 to 32 lowercase letters or '_'",
                                     lambda v: isinstance(v, str) and bool(_REFUSAL_RE.fullmatch(v)), ""))
        metrics = f.get("metrics", "an object of finite numbers",
                        lambda v: isinstance(v, dict) and all(is_number(x) for x in v.values()), {})
        return cls(num_samples=f.get("num_samples", "a positive integer", lambda v: is_int(v) and v >= 1),
                   metrics={k: float(v) for k, v in metrics.items()},
                   codec=f.codec("codec"),
                   delta=tuple(f.get("delta", "a list of tensor names", is_names, [])),
                   profile=profile, secagg=f.get("secagg", "an object", is_object, None))

    def to_body(self) -> dict[str, Any]:
        if self.error is not None:
            return {"error": self.error, "profile": self.profile, **({"withdrawn": True} if self.withdrawn else {}),
                    **({"refusal": self.refusal} if self.refusal else {})}
        out = {"num_samples": self.num_samples, "metrics": self.metrics, "codec": self.codec.text,
               "delta": list(self.delta), "profile": self.profile}
        if self.secagg is not None:
            out["secagg"] = self.secagg
        return out


@dataclass(frozen=True)
class StatusBody:
    """A ``status`` body: ``ack`` or ``rejected`` for one result (``task_id``), ``closed`` for one task whose round
    has the results it counts, or the run's state."""

    state: str                   # ack | rejected (one result), closed (one task: drop it unless started), running | finished | stopped (the run)
    task_id: str | None = None   # the result's or the closed task's; None in the run's status
    reason: str = ""             # why a result was rejected or a task closed
    # The run's status: the coordinator process that speaks for the run. A resumed run keeps its run id
    # but not its session, so devices learn that rounds they saw may come again.
    session: str = ""

    @classmethod
    def from_body(cls, body: Any) -> StatusBody:
        f = Fields("status", body)
        return cls(state=f.get("state", f"one of {STATUS_STATES}", lambda v: v in STATUS_STATES),
                   task_id=f.get("task_id", "a string", is_str, None),
                   reason=f.get("reason", "a string", is_str, ""),
                   session=f.get("session", "1 to 32 lowercase hex digits", is_session, ""))

    def to_body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state}
        if self.task_id is not None:
            out["task_id"] = self.task_id
        if self.reason:
            out["reason"] = self.reason
        if self.session:
            out["session"] = self.session
        return out


@dataclass(frozen=True)
class ModelBody:
    """A ``model`` body: the codec of the broadcast's tensors."""

    codec: CodecSpec = FP32

    @classmethod
    def from_body(cls, body: Any) -> ModelBody:
        return cls(codec=Fields("model", body).codec("codec"))

    def to_body(self) -> dict[str, Any]:
        return {"codec": self.codec.text}

