"""Reading a body's JSON fields: each checked for its type, each refusal naming the field and what it must be.

A body comes from the network, so no field is trusted: a wrong one is a
ProtocolError that says which field of which kind was wrong, and how, which is
what a device's error reply or the coordinator's log needs to be useful.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from edge_client.wire.codec import FP32, CodecError, CodecSpec, parse_codec
from edge_client.wire.errors import ProtocolError

__all__ = ["Fields", "is_int", "is_number", "is_str", "is_session", "is_object", "is_names", "is_sha256"]

_SESSION_RE = re.compile(r"^[0-9a-f]{1,32}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")

_MISSING: Any = object()


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite JSON number (booleans excluded; an integer too large for a float is not finite)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def is_str(value: Any) -> bool:
    return isinstance(value, str)


def is_session(value: Any) -> bool:
    return isinstance(value, str) and bool(_SESSION_RE.fullmatch(value))


def is_object(value: Any) -> bool:
    return isinstance(value, dict)


def is_names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(n, str) for n in value)


def is_sha256(value: Any) -> bool:
    """A SHA-256 in lowercase hex, as the model broadcast is referenced by."""
    return isinstance(value, str) and bool(_SHA256_RE.fullmatch(value))


class Fields:
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
        text = self.get(name, "a codec spec string such as 'topk:0.1+int8+zstd'", is_str, None)
        if text is None:
            return FP32
        try:
            return parse_codec(text)
        except CodecError as exc:
            raise CodecError(f"{self.kind} field {self.prefix + name!r}: {exc}") from None
