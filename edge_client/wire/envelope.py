"""The envelope: one message as one safetensors buffer, and the checks it passes before anyone reads it.

The buffer's ``__metadata__["fedge"]`` entry holds a JSON header (protocol version,
kind, run id, round, task id, sender, body); its tensors are the weights the message
carries, in the codec its body names (:mod:`edge_client.wire.codec`). A message may
travel compressed (:mod:`edge_client.wire.compression`). Decoding parses and checks the
header *before* any tensor is materialized, and nothing is ever unpickled: a message
comes from the network, and anyone who can publish on a topic can send one.
"""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from edge_client.wire.body_fields import CLIENT_ID, Check, an_object, integer, text
from edge_client.wire.codec import CodecSpec, all_finite
from edge_client.wire.compression import CompressionError, decompress
from edge_client.wire.errors import ProtocolError

__all__ = ["PROTOCOL_VERSION", "KINDS", "HEADER", "MAX_HEADER_BYTES", "TENSOR_DTYPES", "DEFAULT_MAX_MESSAGE_BYTES",
           "Message", "ContentError", "encode", "decode", "check_tensors"]

# 2: codecs and deltas in task/result bodies, the model broadcast, compression and chunks.
PROTOCOL_VERSION = 2
# manifest and partial pass between the coordinator and its aggregation workers, never a device.
KINDS = ("presence", "task", "result", "status", "model", "manifest", "partial", "delta")
# The header's fields beside ``v`` and ``kind``, as decode checks them and docs/protocol.schema.json publishes them.
HEADER: dict[str, Check] = {
    "run_id": text(),
    "round": integer(),      # any integer: a receiver compares it with the rounds it knows
    "task_id": text(),
    "sender": CLIENT_ID,
    "body": an_object(),
}
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024   # the largest (decompressed, reassembled) message decoded
MAX_HEADER_BYTES = 4 * 1024 * 1024
# safetensors dtype tag -> bytes per element; anything else is refused.
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8}
TENSOR_DTYPES = tuple(_DTYPE_BYTES)
_FLOAT_TAGS = {"F32", "F16", "BF16", "F64"}


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


class ContentError(ProtocolError):
    """An envelope whose header is sound (version, kind, ids, sender) but whose content is not: a
    non-finite number in its header, or tensors that are corrupt or not finite.

    ``head`` is the header without body or tensors: who sent the message and what it answers, so
    the receiver can tell a sender it knows (the topic names it) why its message was refused.
    """

    def __init__(self, reason: str, head: Message) -> None:
        super().__init__(reason)
        self.head = head


def encode(kind: str, *, run_id: str, round: int, task_id: str, sender: str,
           body: Mapping[str, Any] | None = None,
           tensors: Mapping[str, torch.Tensor] | None = None,
           compression: CodecSpec | None = None) -> bytes:
    """Serialize one message; tensors are made contiguous on the CPU first (copied only where two of
    them share memory, which safetensors refuses: an update is not held twice while it is written).

    ``body``: a body dataclass's ``to_body()``. ``compression``: the message's codec
    (its body's ``codec``); when that names a compressor, the whole envelope is
    compressed with it if that makes it smaller, which :func:`decode` undoes.
    """
    if kind not in KINDS:
        raise ProtocolError(f"unknown message kind {kind!r}; expected one of {KINDS}")
    header = {"v": PROTOCOL_VERSION, "kind": kind, "run_id": run_id, "round": int(round),
              "task_id": task_id, "sender": sender, "body": dict(body or {})}
    plain = _unshared({k: t.detach().to("cpu").contiguous() for k, t in (tensors or {}).items()})
    try:
        text = json.dumps(header, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        where = _non_finite(header["body"], "body")
        raise ProtocolError(f"message body is not plain finite JSON: {where or exc}") from None
    payload = st_save(plain, metadata={"fedge": text})
    return compression.compress(payload) if compression is not None else payload


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors``, with a copy of each one whose memory another one shares."""
    owners = Counter(t.untyped_storage().data_ptr() for t in tensors.values())
    return {k: t.clone() if owners[t.untyped_storage().data_ptr()] > 1 else t for k, t in tensors.items()}


def _non_finite(value: Any, path: str) -> str:
    """Where in ``value`` the first infinite or NaN number is ("body.metrics.train_loss is nan"), "" if nowhere:
    a number gone non-finite is usually a diverged model, and its name says which."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{path} is {value}"
    if isinstance(value, Mapping):
        items: Any = value.items()
    else:
        items = enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        if found := _non_finite(item, f"{path}.{key}"):
            return found
    return ""


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


def _loads_meta(text: str) -> tuple[Any, str]:
    """The fedge header, and why it is unusable ('' if it is not): a non-finite number leaves the rest
    readable, so the sender can still be told what was wrong with its message."""
    problems: list[str] = []

    def constant(name: str) -> None:
        problems.append(f"the header holds the non-standard JSON constant {name}")

    def number(text: str) -> float | None:
        value = float(text)
        if math.isfinite(value):
            return value
        problems.append(f"the header's number {text[:40]} is not finite")
        return None

    return json.loads(text, parse_constant=constant, parse_float=number), (problems[0] if problems else "")


def _parse_header(payload: bytes, max_bytes: int) -> tuple[dict[str, Any], dict[str, Any], str]:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ProtocolError("payload is not bytes")
    if len(payload) > max_bytes:
        raise ProtocolError(f"message of {len(payload)} bytes exceeds the limit of {max_bytes}")
    if len(payload) < 8:
        raise ProtocolError(f"message of {len(payload)} bytes is too short to be an envelope")
    (n,) = struct.unpack("<Q", bytes(payload[:8]))
    if n > MAX_HEADER_BYTES or 8 + n > len(payload):
        raise ProtocolError(f"envelope header length {n} does not fit a {len(payload)}-byte message")
    try:
        # Decoded straight from the payload: one copy of a header that may be megabytes long, not two.
        st_header = _loads(str(memoryview(payload)[8:8 + n], "utf-8"))
        meta, problem = _loads_meta(st_header.pop("__metadata__")["fedge"])
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
    return meta, st_header, problem


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
    meta, st_header, problem = _parse_header(payload, max_bytes)
    version = meta.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} is not supported (this side speaks {PROTOCOL_VERSION})")
    kind = meta.get("kind")
    if kind not in KINDS:
        raise ProtocolError(f"unknown message kind {kind!r}")
    for key, check in HEADER.items():
        value = meta.get(key)
        if not check.ok(value):
            if key == "sender" and isinstance(value, str):   # the right type, but no id
                raise ProtocolError(f"sender {value!r} is not a valid id")
            raise ProtocolError(f"field {key!r} missing or not {check.want}")
    # From here on the header says who sent the message and what it answers: a refusal carries that.
    head = Message(kind=kind, run_id=meta["run_id"], round=meta["round"], task_id=meta["task_id"],
                   sender=meta["sender"], size=size)
    if problem:
        raise ContentError(problem, head)
    try:
        tensors = st_load(bytes(payload)) if st_header else {}
    except Exception as exc:  # safetensors raises its own error type for corrupt buffers
        raise ContentError(f"tensor data is corrupt: {exc}", head) from None
    for name, tag_info in st_header.items():
        if tag_info["dtype"] in _FLOAT_TAGS and not all_finite(tensors[name]):
            raise ContentError(f"tensor {name!r} holds NaN or infinite values", head)
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
