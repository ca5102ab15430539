"""The fedge wire protocol: topic layout, message kinds and the envelope.

Every message is one safetensors buffer. Its ``__metadata__["fedge"]`` entry holds
a JSON header (protocol version, kind, run id, round, task id, sender, body);
its tensors are the weights the message carries, in the codec its body names
(:mod:`edge_client.wire.codec`). A message may travel compressed
(:mod:`edge_client.wire.compression`) and in chunks (:mod:`edge_client.wire.chunking`).
Decoding parses and checks the header *before* any tensor is materialized, and
nothing is ever unpickled.
``docs/protocol.md`` describes the same thing for people; keep both true.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from edge_client.wire.compression import CompressionError, decompress

__all__ = [
    "PROTOCOL_VERSION",
    "KINDS",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "ProtocolError",
    "Message",
    "Topics",
    "encode",
    "decode",
    "check_tensors",
    "valid_client_id",
]

# 2: codecs and deltas in task/result bodies, the model broadcast, compression and chunks.
PROTOCOL_VERSION = 2
KINDS = ("presence", "task", "result", "status", "model")
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024   # the largest (decompressed, reassembled) message decoded
_MAX_HEADER_BYTES = 4 * 1024 * 1024
_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# safetensors dtype tag -> bytes per element; anything else is refused.
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8}
_FLOAT_TAGS = {"F32", "F16", "BF16", "F64"}


class ProtocolError(ValueError):
    """A message that cannot be accepted; ``str(err)`` is the logged reason."""


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

    def client_of(self, topic: str) -> str | None:
        """The client id a per-client topic belongs to, or None for any other topic."""
        parts = topic[len(self.prefix) + 1:].split("/") if topic.startswith(self.prefix + "/") else []
        return parts[1] if len(parts) == 3 and parts[0] == "clients" else None


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
           tensors: Mapping[str, torch.Tensor] | None = None) -> bytes:
    """Serialize one message; tensors are made contiguous CPU copies first."""
    if kind not in KINDS:
        raise ProtocolError(f"unknown message kind {kind!r}; expected one of {KINDS}")
    header = {"v": PROTOCOL_VERSION, "kind": kind, "run_id": run_id, "round": int(round),
              "task_id": task_id, "sender": sender, "body": dict(body or {})}
    plain = {k: t.detach().to("cpu").contiguous().clone() for k, t in (tensors or {}).items()}
    try:
        text = json.dumps(header, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"message body is not plain finite JSON: {exc}") from None
    return st_save(plain, metadata={"fedge": text})


def _refuse_constant(name: str) -> None:
    raise ValueError(f"non-standard JSON constant {name}")


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
        st_header = json.loads(bytes(payload[8:8 + n]), parse_constant=_refuse_constant)
        meta = json.loads(st_header.pop("__metadata__")["fedge"], parse_constant=_refuse_constant)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ProtocolError(f"not a fedge envelope ({type(exc).__name__}: {exc})") from None
    if not isinstance(meta, dict):
        raise ProtocolError("envelope header is not a JSON object")
    data_len = len(payload) - 8 - n
    for name, info in st_header.items():
        try:
            tag, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            numel = math.prod(int(s) for s in shape)
            ok = (tag in _DTYPE_BYTES and all(isinstance(s, int) and s >= 0 for s in shape)
                  and 0 <= start <= end <= data_len and end - start == numel * _DTYPE_BYTES[tag])
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ProtocolError(f"tensor {name!r} has an invalid entry {info!r}")
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
        if tag_info["dtype"] in _FLOAT_TAGS and not bool(torch.isfinite(tensors[name]).all()):
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
