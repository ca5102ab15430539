"""The fedge wire protocol: topic layout, message kinds, the envelope and the typed bodies.

Every message is one safetensors buffer. Its ``__metadata__["fedge"]`` entry holds
a JSON header (protocol version, kind, run id, round, task id, sender, body);
its tensors are the weights the message carries, in the codec its body names
(:mod:`edge_client.wire.codec`). A message may travel compressed
(:mod:`edge_client.wire.compression`) and in chunks (:mod:`edge_client.wire.chunking`).
Decoding parses and checks the header *before* any tensor is materialized, and
nothing is ever unpickled.

The body of each kind is a frozen dataclass here (:class:`PresenceBody`,
:class:`TaskBody`, :class:`ResultBody`, :class:`StatusBody`, :class:`ModelBody`, and the aggregation
workers' :class:`ManifestBody` and :class:`PartialBody`):
``to_body()`` gives the JSON object a message carries and ``from_body()`` parses one,
checking every field's type and raising ProtocolError that names the field. Codec
specs in a body are parsed there, once per message.
``docs/protocol.md`` describes the same thing for people; keep both true.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from edge_client.wire.codec import FP32, CodecError, CodecSpec, all_finite, parse_codec
from edge_client.wire.compression import CompressionError, decompress
from edge_client.wire.errors import ProtocolError

__all__ = [
    "PROTOCOL_VERSION",
    "KINDS",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_TASK_TIMEOUT",
    "DEFAULT_RESEND_EVERY",
    "UPDATES",
    "ProtocolError",
    "Message",
    "Topics",
    "UploadSettings",
    "PresenceBody",
    "TaskBody",
    "ResultBody",
    "StatusBody",
    "ModelBody",
    "ManifestBody",
    "PartialBody",
    "encode",
    "decode",
    "check_tensors",
    "valid_client_id",
]

# 2: codecs and deltas in task/result bodies, the model broadcast, compression and chunks.
PROTOCOL_VERSION = 2
# manifest and partial pass between the coordinator and its aggregation workers, never a device.
KINDS = ("presence", "task", "result", "status", "model", "manifest", "partial")
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024   # the largest (decompressed, reassembled) message decoded
_MAX_HEADER_BYTES = 4 * 1024 * 1024
_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# safetensors dtype tag -> bytes per element; anything else is refused.
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8}
_FLOAT_TAGS = {"F32", "F16", "BF16", "F64"}
DEFAULT_TASK_TIMEOUT = 600.0     # a task's ``timeout`` when it has none
DEFAULT_RESEND_EVERY = 10.0      # a task's ``resend_every`` when it has none
UPDATES = ("delta", "raw")
PRESENCE_STATES = ("online", "offline")
STATUS_STATES = ("ack", "rejected", "running", "finished", "stopped")
_SESSION_RE = re.compile(r"^[0-9a-f]{1,32}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def valid_client_id(client_id: str) -> bool:
    """Client ids become topic levels, so they may not contain ``/``, ``+`` or ``#``."""
    return isinstance(client_id, str) and bool(_ID_RE.fullmatch(client_id))


@dataclass(frozen=True)
class Topics:
    """Topic layout under a configurable prefix.

    Each device only writes ``PREFIX/clients/ID/{presence,result}`` and reads
    ``PREFIX/clients/ID/{task,status}`` plus the coordinator's status, so a broker
    ACL of ``pattern readwrite PREFIX/clients/%u/#`` confines it to its own topics.
    """

    prefix: str = "fedge"

    def __post_init__(self) -> None:
        if not self.prefix or any(c in self.prefix for c in "+#") or self.prefix.endswith("/"):
            raise ProtocolError(f"bad topic prefix {self.prefix!r}: no '+', '#' or trailing '/'")

    def client(self, client_id: str, kind: str) -> str:
        return f"{self.prefix}/clients/{client_id}/{kind}"

    def all_clients(self, kind: str) -> str:
        return f"{self.prefix}/clients/+/{kind}"

    @property
    def coordinator_status(self) -> str:
        return f"{self.prefix}/coordinator/status"

    @property
    def model(self) -> str:
        """The round's model broadcast (retained), which tasks reference by its SHA-256."""
        return f"{self.prefix}/coordinator/model"

    @property
    def manifest(self) -> str:
        """The current exchange's tasks for the aggregation workers (retained)."""
        return f"{self.prefix}/coordinator/manifest"

    def worker(self, worker_id: str, kind: str) -> str:
        return f"{self.prefix}/workers/{worker_id}/{kind}"

    def all_workers(self, kind: str) -> str:
        return f"{self.prefix}/workers/+/{kind}"

    def shared_results(self, group: str) -> str:
        """Every device's results, shared among a group of subscribers (MQTT 5 shared subscription):
        the broker hands each message to one member."""
        return f"$share/{group}/{self.all_clients('result')}"

    def client_of(self, topic: str) -> str | None:
        """The client id a per-client topic belongs to, or None for any other topic."""
        return self._owner(topic, "clients")

    def worker_of(self, topic: str) -> str | None:
        """The worker id a per-worker topic belongs to, or None for any other topic."""
        return self._owner(topic, "workers")

    def _owner(self, topic: str, level: str) -> str | None:
        parts = topic[len(self.prefix) + 1:].split("/") if topic.startswith(self.prefix + "/") else []
        return parts[1] if len(parts) == 3 and parts[0] == level else None


@dataclass(frozen=True)
class Message:
    kind: str
    run_id: str
    round: int
    task_id: str
    sender: str
    body: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    size: int = 0


def encode(kind: str, *, run_id: str, round: int, task_id: str, sender: str,
           body: Mapping[str, Any] | None = None,
           tensors: Mapping[str, torch.Tensor] | None = None,
           compression: CodecSpec | None = None) -> bytes:
    """Serialize one message; tensors are made contiguous CPU copies first.

    ``body``: a body dataclass's ``to_body()``. ``compression``: the message's codec
    (its body's ``codec``); when that names a compressor, the whole envelope is
    compressed with it if that makes it smaller, which :func:`decode` undoes.
    """
    if kind not in KINDS:
        raise ProtocolError(f"unknown message kind {kind!r}; expected one of {KINDS}")
    header = {"v": PROTOCOL_VERSION, "kind": kind, "run_id": run_id, "round": int(round),
              "task_id": task_id, "sender": sender, "body": dict(body or {})}
    plain = {k: t.detach().to("cpu").contiguous().clone() for k, t in (tensors or {}).items()}
    try:
        text = json.dumps(header, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"message body is not plain finite JSON: {exc}") from None
    payload = st_save(plain, metadata={"fedge": text})
    return compression.compress(payload) if compression is not None else payload


def _refuse_constant(name: str) -> None:
    raise ValueError(f"non-standard JSON constant {name}")


def _finite_float(text: str) -> float:
    """JSON numbers such as 1e999 parse to infinity; a message may carry only finite ones."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is not finite")
    return value


def _loads(text: bytes | str) -> Any:
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)


def _parse_header(payload: bytes, max_bytes: int) -> tuple[dict[str, Any], dict[str, Any]]:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ProtocolError("payload is not bytes")
    if len(payload) > max_bytes:
        raise ProtocolError(f"message of {len(payload)} bytes exceeds the limit of {max_bytes}")
    if len(payload) < 8:
        raise ProtocolError(f"message of {len(payload)} bytes is too short to be an envelope")
    (n,) = struct.unpack("<Q", bytes(payload[:8]))
    if n > _MAX_HEADER_BYTES or 8 + n > len(payload):
        raise ProtocolError(f"envelope header length {n} does not fit a {len(payload)}-byte message")
    try:
        # Decoded straight from the payload: one copy of a header that may be megabytes long, not two.
        st_header = _loads(str(memoryview(payload)[8:8 + n], "utf-8"))
        meta = _loads(st_header.pop("__metadata__")["fedge"])
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:   # deep nesting: recursion
        raise ProtocolError(f"not a fedge envelope ({type(exc).__name__}: {exc})") from None
    if not isinstance(meta, dict):
        raise ProtocolError("envelope header is not a JSON object")
    data_len = len(payload) - 8 - n
    for name, info in st_header.items():
        try:
            tag, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            ok = (tag in _DTYPE_BYTES and isinstance(shape, list)
                  and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
                  and isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= data_len
                  and end - start == math.prod(shape) * _DTYPE_BYTES[tag])
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:   # the sender's entry is shortened: it may be megabytes long
            raise ProtocolError(f"tensor {str(name)[:80]!r} has an invalid entry {repr(info)[:200]}")
    return meta, st_header


def decode(payload: bytes, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Parse and check an envelope; raise ProtocolError with the reason on any problem.

    A compressed message is decompressed first, within the same limit. Checks size,
    header layout, version, kind and field types, tensor dtypes and byte ranges, and
    that every floating-point tensor is finite. Names and shapes against what was
    asked are checked by the receiver (:func:`check_tensors`, :mod:`edge_client.wire.codec`).
    """
    size = len(payload) if isinstance(payload, (bytes, bytearray, memoryview)) else 0
    if size > max_bytes:
        raise ProtocolError(f"message of {size} bytes exceeds the limit of {max_bytes}")
    try:
        payload = decompress(payload, max_bytes) if size else payload
    except CompressionError as exc:
        raise ProtocolError(str(exc)) from None
    meta, st_header = _parse_header(payload, max_bytes)
    version = meta.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} is not supported (this side speaks {PROTOCOL_VERSION})")
    kind = meta.get("kind")
    if kind not in KINDS:
        raise ProtocolError(f"unknown message kind {kind!r}")
    for key, typ in (("run_id", str), ("task_id", str), ("sender", str), ("round", int), ("body", dict)):
        if not isinstance(meta.get(key), typ) or isinstance(meta.get(key), bool):
            raise ProtocolError(f"field {key!r} missing or not a {typ.__name__}")
    if not valid_client_id(meta["sender"]):
        raise ProtocolError(f"sender {meta['sender']!r} is not a valid id")
    try:
        tensors = st_load(bytes(payload)) if st_header else {}
    except Exception as exc:  # safetensors raises its own error type for corrupt buffers
        raise ProtocolError(f"tensor data is corrupt: {exc}") from None
    for name, tag_info in st_header.items():
        if tag_info["dtype"] in _FLOAT_TAGS and not all_finite(tensors[name]):
            raise ProtocolError(f"tensor {name!r} holds NaN or infinite values")
    return Message(kind=kind, run_id=meta["run_id"], round=meta["round"], task_id=meta["task_id"],
                   sender=meta["sender"], body=meta["body"], tensors=tensors, size=size)


def check_tensors(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]],
                  dtype: torch.dtype = torch.float32) -> None:
    """Require exactly the expected names, each with the expected shape and dtype."""
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ProtocolError(f"tensor names differ from what was asked: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, shape in expected.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(shape):
            raise ProtocolError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if t.dtype != dtype:
            raise ProtocolError(f"tensor {name!r} has dtype {t.dtype}, expected {dtype}")


# ----------------------------------------------------------------------------- bodies

_MISSING: Any = object()


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite JSON number (booleans excluded; an integer too large for a float is not finite)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_session(value: Any) -> bool:
    return isinstance(value, str) and bool(_SESSION_RE.fullmatch(value))


def _is_object(value: Any) -> bool:
    return isinstance(value, dict)


def _is_names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(n, str) for n in value)


class _Fields:
    """Reads the fields of one JSON object of a body, naming the field in every error."""

    def __init__(self, kind: str, body: Any, prefix: str = "") -> None:
        if not isinstance(body, Mapping):
            raise ProtocolError(f"{kind} {'field ' + repr(prefix.rstrip('.')) if prefix else 'body'} "
                                f"must be an object, got {_show(body)}")
        self.kind, self.body, self.prefix = kind, body, prefix

    def __contains__(self, name: str) -> bool:
        return name in self.body

    def get(self, name: str, want: str, ok: Callable[[Any], bool], default: Any = _MISSING) -> Any:
        """``body[name]`` when ``ok`` accepts it; ``default`` when absent (without one, it is required)."""
        if name not in self.body:
            if default is _MISSING:
                raise ProtocolError(f"{self.kind} field {self.prefix + name!r} is missing; it must be {want}")
            return default
        value = self.body[name]
        if not ok(value):
            raise ProtocolError(f"{self.kind} field {self.prefix + name!r} must be {want}, got {_show(value)}")
        return value

    def codec(self, name: str) -> CodecSpec:
        """A codec spec string, parsed; float32 when absent."""
        text = self.get(name, "a codec spec string such as 'topk:0.1+int8+zstd'", _is_str, None)
        if text is None:
            return FP32
        try:
            return parse_codec(text)
        except CodecError as exc:
            raise CodecError(f"{self.kind} field {self.prefix + name!r}: {exc}") from None


@dataclass(frozen=True)
class UploadSettings:
    """How a client answers a task: the task body's ``upload`` object.

    A task without one gets raw float32 values; in one, ``update`` defaults to
    ``delta``, ``codec`` to ``fp32`` and ``error_feedback`` to true.
    """

    codec: CodecSpec = FP32
    update: str = "raw"              # delta | raw
    error_feedback: bool = False

    @classmethod
    def from_body(cls, upload: Any) -> UploadSettings:
        f = _Fields("task", upload, "upload.")
        return cls(codec=f.codec("codec"),
                   update=f.get("update", f"one of {UPDATES}", lambda v: v in UPDATES, "delta"),
                   error_feedback=f.get("error_feedback", "true or false", lambda v: isinstance(v, bool), True))

    def to_body(self) -> dict[str, Any]:
        return {"codec": self.codec.text, "update": self.update, "error_feedback": self.error_feedback}


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
        f = _Fields("presence", body)
        count = "a non-negative integer"
        shape = f.get("input_shape", "a list of non-negative integers",
                      lambda v: isinstance(v, list) and all(_is_int(d) and d >= 0 for d in v), None)
        return cls(state=f.get("state", f"one of {PRESENCE_STATES}", lambda v: v in PRESENCE_STATES),
                   num_samples=f.get("num_samples", count, lambda v: _is_int(v) and v >= 0, None),
                   input_shape=None if shape is None else tuple(shape),
                   num_classes=f.get("num_classes", count, lambda v: _is_int(v) and v >= 0, None),
                   device=f.get("device", "an object", _is_object, None))

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

    @classmethod
    def from_body(cls, body: Any) -> TaskBody:
        f = _Fields("task", body)
        seconds = "a positive number of seconds"
        upload = f.get("upload", "an object", _is_object, None)
        return cls(objective=f.get("objective", "an objective name", _is_str),
                   model=f.get("model", "a model spec object", _is_object),
                   up=tuple(f.get("up", "a list of tensor names", _is_names)),
                   hyper=f.get("hyper", "an object", _is_object, {}),
                   upload=UploadSettings() if upload is None else UploadSettings.from_body(upload),
                   codec=f.codec("codec"),
                   broadcast=f.get("broadcast", "a SHA-256 in lowercase hex (64 characters)",
                                   lambda v: isinstance(v, str) and bool(_SHA256_RE.fullmatch(v)), None),
                   seed=f.get("seed", "an integer", _is_int, 0),
                   timeout=float(f.get("timeout", seconds, lambda v: _is_number(v) and v > 0, DEFAULT_TASK_TIMEOUT)),
                   resend_every=float(f.get("resend_every", seconds, lambda v: _is_number(v) and v > 0,
                                            DEFAULT_RESEND_EVERY)),
                   deadline=f.get("deadline", "a Unix time", _is_number, None),
                   session=f.get("session", "1 to 32 lowercase hex digits", _is_session, ""))

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

    @classmethod
    def from_body(cls, body: Any) -> ResultBody:
        f = _Fields("result", body)
        profile = f.get("profile", "an object", _is_object, {})
        if "error" in f:
            return cls(error=f.get("error", "a string", _is_str), profile=profile)
        metrics = f.get("metrics", "an object of finite numbers",
                        lambda v: isinstance(v, dict) and all(_is_number(x) for x in v.values()), {})
        return cls(num_samples=f.get("num_samples", "a positive integer", lambda v: _is_int(v) and v >= 1),
                   metrics={k: float(v) for k, v in metrics.items()},
                   codec=f.codec("codec"),
                   delta=tuple(f.get("delta", "a list of tensor names", _is_names, [])),
                   profile=profile)

    def to_body(self) -> dict[str, Any]:
        if self.error is not None:
            return {"error": self.error, "profile": self.profile}
        return {"num_samples": self.num_samples, "metrics": self.metrics, "codec": self.codec.text,
                "delta": list(self.delta), "profile": self.profile}


@dataclass(frozen=True)
class StatusBody:
    """A ``status`` body: ``ack`` or ``rejected`` for one result (``task_id``), or the run's state."""

    state: str                   # ack | rejected (one result), running | finished | stopped (the run)
    task_id: str | None = None   # the result's task; None in the run's status
    reason: str = ""             # why a result was rejected
    # The run's status: the coordinator process that speaks for the run. A resumed run keeps its run id
    # but not its session, so devices learn that rounds they saw may come again.
    session: str = ""

    @classmethod
    def from_body(cls, body: Any) -> StatusBody:
        f = _Fields("status", body)
        return cls(state=f.get("state", f"one of {STATUS_STATES}", lambda v: v in STATUS_STATES),
                   task_id=f.get("task_id", "a string", _is_str, None),
                   reason=f.get("reason", "a string", _is_str, ""),
                   session=f.get("session", "1 to 32 lowercase hex digits", _is_session, ""))

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
        return cls(codec=_Fields("model", body).codec("codec"))

    def to_body(self) -> dict[str, Any]:
        return {"codec": self.codec.text}


@dataclass(frozen=True)
class ManifestBody:
    """A ``manifest`` body: what aggregation workers need to check and fold one exchange's results.

    ``tasks`` maps each task id to its client; every task of the exchange sends back the
    tensors ``up`` of the network ``model`` in ``codec``, as differences from the model
    broadcast ``broadcast`` (its SHA-256). ``flush``: publish what you folded now.
    """

    exchange: str
    phase: str
    model: dict[str, Any]
    up: tuple[str, ...]
    codec: CodecSpec
    tasks: dict[str, str]
    broadcast: str | None = None
    flush: bool = False

    @classmethod
    def from_body(cls, body: Any) -> ManifestBody:
        f = _Fields("manifest", body)
        return cls(exchange=f.get("exchange", "a string", _is_str), phase=f.get("phase", "a string", _is_str),
                   model=f.get("model", "an object", _is_object),
                   up=tuple(f.get("up", "a list of tensor names", _is_names)), codec=f.codec("codec"),
                   tasks=f.get("tasks", "an object of task id -> client id",
                               lambda v: isinstance(v, dict) and all(valid_client_id(c) for c in v.values())),
                   broadcast=f.get("broadcast", "a SHA-256 in hex", lambda v: isinstance(v, str)
                                   and bool(_SHA256_RE.fullmatch(v)), None),
                   flush=f.get("flush", "true or false", lambda v: isinstance(v, bool), False))

    def to_body(self) -> dict[str, Any]:
        out = {"exchange": self.exchange, "phase": self.phase, "model": self.model, "up": list(self.up),
               "codec": self.codec.text, "tasks": self.tasks, "flush": self.flush}
        if self.broadcast is not None:
            out["broadcast"] = self.broadcast
        return out


@dataclass(frozen=True)
class ClaimBody:
    """What an aggregation worker adds to a device's result body when it claims the result (the claim
    carries the device's header and body, without the tensors): ``problem`` why the worker could not use
    the tensors (``""``: none), ``held`` whether it holds them checked, ``wire_bytes`` the result's size
    as it came, counted in the round's ``bytes_up``."""

    problem: str = ""
    held: bool = False
    wire_bytes: int = 0

    @classmethod
    def from_body(cls, body: Any) -> ClaimBody:
        f = _Fields("claim", body)
        return cls(problem=f.get("problem", "a string", _is_str, ""),
                   held=f.get("held", "true or false", lambda v: isinstance(v, bool), False),
                   wire_bytes=f.get("wire_bytes", "a non-negative integer", lambda v: _is_int(v) and v >= 0, 0))

    def to_body(self) -> dict[str, Any]:
        return {"problem": self.problem, "held": self.held, "wire_bytes": self.wire_bytes}


@dataclass(frozen=True)
class PartialBody:
    """A ``partial`` body: an aggregation worker's fold of some of an exchange's results.

    The message's tensors are the weighted sums (float64); ``weight`` their total weight;
    ``tasks`` the receipts: every task whose result is inside, each exactly once.
    """

    exchange: str
    weight: float
    tasks: tuple[str, ...]

    @classmethod
    def from_body(cls, body: Any) -> PartialBody:
        f = _Fields("partial", body)
        return cls(exchange=f.get("exchange", "a string", _is_str),
                   weight=float(f.get("weight", "a positive number", lambda v: _is_number(v) and v > 0)),
                   tasks=tuple(f.get("tasks", "a non-empty list of task ids", lambda v: _is_names(v) and len(v) > 0)))

    def to_body(self) -> dict[str, Any]:
        return {"exchange": self.exchange, "weight": self.weight, "tasks": list(self.tasks)}
