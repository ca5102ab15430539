"""The bodies secure aggregation exchanges, and its round parameters, as typed values.

Each is a frozen dataclass: ``to_body()`` gives a JSON object of strings, integers and
base64 bytes; ``from_body()`` parses one, checking every field's type and every byte
string's size, and raises :class:`MessageError` naming the field
(:mod:`edge_client.wire.body_fields`). What needs the round's parameters (ids below the
number of clients, the round id, a vector's length) is checked by the step that takes
the message (:mod:`edge_client.secagg.protocol`).

Per-client values travel as lists of ``{"id": ..., ...}`` objects, not as objects keyed
by id, because JSON keys are strings and ids are integers.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from edge_client.secagg import graph, masking
from edge_client.secagg.errors import MessageError, ParamsError
from edge_client.secagg.keys import KEY_BYTES, NONCE_BYTES, TAG_BYTES
from edge_client.secagg.shamir import SHARE_BYTES, share_from_bytes, share_to_bytes
from edge_client.wire.body_fields import Fields, is_int, is_number
from edge_client.wire.errors import ProtocolError

__all__ = ["MAX_CLIENTS", "MAX_LENGTH", "SEED_BYTES", "SEALED_BYTES", "SecAggParams", "Advertise", "PublicKeys",
           "ShareBundle", "ForwardedShares", "MaskedInput", "UnmaskRequest", "UnmaskResponse"]

MAX_CLIENTS = 1 << 20
MAX_LENGTH = 1 << 28
MAX_ROUND = (1 << 63) - 1
SEED_BYTES = 32
SEALED_BYTES = NONCE_BYTES + 2 * SHARE_BYTES + TAG_BYTES   # a sealed pair of shares: of b_i and of s_i


def _is_id(value: Any) -> bool:
    return is_int(value) and 0 <= value < MAX_CLIENTS


def _is_round(value: Any) -> bool:
    return is_int(value) and 0 <= value <= MAX_ROUND


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _raw(f: Fields, name: str, size: int | None) -> bytes:
    want = "base64" + (f" of {size} bytes" if size is not None else "")
    text = f.get(name, want, lambda v: isinstance(v, str))
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MessageError(f"{f.kind} field {f.prefix + name!r} must be {want}, and is not valid base64") from None
    if size is not None and len(raw) != size:
        raise MessageError(f"{f.kind} field {f.prefix + name!r} must be {want}, got {len(raw)} bytes")
    return raw


def _ids(f: Fields, name: str) -> tuple[int, ...]:
    """A list of distinct client ids, returned ascending."""
    ids = f.get(name, "a list of distinct client ids", lambda v: isinstance(v, list) and all(_is_id(i) for i in v)
                and len(set(v)) == len(v))
    return tuple(sorted(ids))


def _entries(f: Fields, name: str, sizes: Mapping[str, int]) -> dict[int, tuple[bytes, ...]]:
    """``[{"id": i, key: base64, ...}, ...]`` as ``{i: (bytes, ...)}`` in the order of ``sizes``."""
    items = f.get(name, "a list of objects", lambda v: isinstance(v, list))
    out: dict[int, tuple[bytes, ...]] = {}
    for k, item in enumerate(items):
        entry = Fields(f.kind, item, f"{f.prefix}{name}[{k}].")
        ident = entry.get("id", "a client id (an integer in 0..2^20-1)", _is_id)
        if ident in out:
            raise MessageError(f"{f.kind} field {name!r} lists client {ident} twice")
        out[ident] = tuple(_raw(entry, key, size) for key, size in sizes.items())
    return out


def _put(values: Mapping[int, tuple[bytes, ...]], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    return [{"id": i, **{k: _b64(v) for k, v in zip(keys, values[i])}} for i in sorted(values)]


class _Body:
    """Turns the wire layer's ProtocolError into MessageError, so one type covers every secagg refusal."""

    @classmethod
    def from_body(cls, body: Any):  # type: ignore[no-untyped-def]
        try:
            return cls._read(body)  # type: ignore[attr-defined]
        except MessageError:
            raise
        except (ProtocolError, ParamsError) as exc:
            raise MessageError(str(exc)) from None


@dataclass(frozen=True)
class SecAggParams(_Body):
    """One round's parameters, which every party must hold alike (the coordinator sends them with the task).

    Clients have ids 0..num_clients-1. ``threshold`` shares reconstruct a client's
    secrets; it must be more than half the degree, so that no two disjoint groups of
    honest neighbours can hand the server both secrets of one client, and at least 2,
    so that no single neighbour holds a secret outright.
    """

    round_id: int
    num_clients: int
    degree: int        # neighbours per client; >= num_clients - 1 means the complete graph
    threshold: int
    length: int        # entries of the summed vector
    clip: float        # each entry is clipped to [-clip, clip] before quantization
    scale: float       # quantization steps per unit
    bits: int          # the sum is computed mod 2^bits
    graph_seed: bytes  # 32 bytes, fresh each round

    def __post_init__(self) -> None:
        if not _is_round(self.round_id):
            raise ParamsError(f"round id {self.round_id!r} must be an integer in 0..2^63-1")
        if not (is_int(self.num_clients) and 3 <= self.num_clients <= MAX_CLIENTS):
            raise ParamsError(f"num_clients {self.num_clients!r} must be an integer in 3..{MAX_CLIENTS}")
        if not (is_int(self.degree) and (self.degree >= self.num_clients - 1
                                         or (self.degree >= 2 and self.degree % 2 == 0))):
            raise ParamsError(f"degree {self.degree!r} must be even and at least 2, or at least num_clients - 1 "
                              "(the complete graph)")
        k = self.effective_degree
        if not (is_int(self.threshold) and 2 <= self.threshold <= k and 2 * self.threshold > k):
            raise ParamsError(f"threshold {self.threshold!r} must be an integer more than half the degree {k} and "
                              f"at most {k}, and at least 2; e.g. {max(2, k // 2 + 1)}")
        if not (is_int(self.length) and 1 <= self.length <= MAX_LENGTH):
            raise ParamsError(f"length {self.length!r} must be an integer in 1..{MAX_LENGTH}")
        if not (is_int(self.bits) and masking.MIN_BITS <= self.bits <= masking.MAX_BITS):
            raise ParamsError(f"bits {self.bits!r} must be an integer in {masking.MIN_BITS}..{masking.MAX_BITS}")
        if not all(is_number(v) and v > 0 for v in (self.clip, self.scale)) or round(self.clip * self.scale) < 1:
            raise ParamsError(f"clip {self.clip!r} and scale {self.scale!r} must be positive numbers with "
                              "clip * scale >= 1 (else every entry quantizes to 0)")
        if not masking.capacity_ok(self.num_clients, self.clip, self.scale, self.bits):
            raise ParamsError(f"{self.num_clients} clients at clip {self.clip:g} and scale {self.scale:g} can sum "
                              f"past 2^{self.bits - 1}; use more bits or a scale of at most "
                              f"{masking.largest_scale(self.num_clients, self.clip, self.bits):g}")
        if not isinstance(self.graph_seed, bytes) or len(self.graph_seed) != SEED_BYTES:
            raise ParamsError(f"graph_seed must be {SEED_BYTES} bytes (e.g. os.urandom({SEED_BYTES}))")

    @property
    def effective_degree(self) -> int:
        return min(self.degree, self.num_clients - 1)

    @cached_property
    def neighbours(self) -> tuple[tuple[int, ...], ...]:
        return graph.neighbours(self.num_clients, self.degree, self.graph_seed)

    @classmethod
    def _read(cls, body: Any) -> SecAggParams:
        f = Fields("secagg params", body)
        number = "a positive number"
        return cls(round_id=f.get("round_id", "an integer in 0..2^63-1", _is_round),
                   num_clients=f.get("num_clients", "an integer", is_int),
                   degree=f.get("degree", "an integer", is_int),
                   threshold=f.get("threshold", "an integer", is_int),
                   length=f.get("length", "an integer", is_int),
                   clip=float(f.get("clip", number, lambda v: is_number(v) and v > 0)),
                   scale=float(f.get("scale", number, lambda v: is_number(v) and v > 0)),
                   bits=f.get("bits", "an integer", is_int),
                   graph_seed=_raw(f, "graph_seed", SEED_BYTES))

    def to_body(self) -> dict[str, Any]:
        return {"round_id": self.round_id, "num_clients": self.num_clients, "degree": self.degree,
                "threshold": self.threshold, "length": self.length, "clip": self.clip, "scale": self.scale,
                "bits": self.bits, "graph_seed": _b64(self.graph_seed)}


@dataclass(frozen=True)
class Advertise(_Body):
    """Client to server: its two public keys for the round (``c_pk`` seals shares, ``s_pk`` seeds masks)."""

    round_id: int
    sender: int
    c_pk: bytes
    s_pk: bytes

    @classmethod
    def _read(cls, body: Any) -> Advertise:
        f = Fields("secagg advertise", body)
        return cls(f.get("round_id", "an integer in 0..2^63-1", _is_round), f.get("sender", "a client id", _is_id),
                   _raw(f, "c_pk", KEY_BYTES), _raw(f, "s_pk", KEY_BYTES))

    def to_body(self) -> dict[str, Any]:
        return {"round_id": self.round_id, "sender": self.sender, "c_pk": _b64(self.c_pk), "s_pk": _b64(self.s_pk)}


@dataclass(frozen=True)
class PublicKeys(_Body):
    """Server to clients: the public keys of every client that advertised, by id."""

    round_id: int
    keys: Mapping[int, tuple[bytes, bytes]]   # id -> (c_pk, s_pk)

    @classmethod
    def _read(cls, body: Any) -> PublicKeys:
        f = Fields("secagg public keys", body)
        keys = _entries(f, "keys", {"c_pk": KEY_BYTES, "s_pk": KEY_BYTES})
        return cls(f.get("round_id", "an integer in 0..2^63-1", _is_round),
                   {i: (c, s) for i, (c, s) in keys.items()})

    def to_body(self) -> dict[str, Any]:
        return {"round_id": self.round_id, "keys": _put(self.keys, ("c_pk", "s_pk"))}


@dataclass(frozen=True)
class ShareBundle(_Body):
    """Client to server: its shares sealed for each neighbour, which the server cannot open."""

    round_id: int
    sender: int
    sealed: Mapping[int, bytes]   # receiver -> ciphertext of (share of b_sender, share of s_sender)

    @classmethod
    def _read(cls, body: Any) -> ShareBundle:
        f = Fields("secagg shares", body)
        sealed = _entries(f, "shares", {"sealed": SEALED_BYTES})
        return cls(f.get("round_id", "an integer in 0..2^63-1", _is_round), f.get("sender", "a client id", _is_id),
                   {i: v for i, (v,) in sealed.items()})

    def to_body(self) -> dict[str, Any]:
        return {"round_id": self.round_id, "sender": self.sender,
                "shares": _put({i: (v,) for i, v in self.sealed.items()}, ("sealed",))}


@dataclass(frozen=True)
class ForwardedShares(_Body):
    """Server to one client: the sealed shares its neighbours sent it; their senders are the ones it masks with."""

    round_id: int
    receiver: int
    sealed: Mapping[int, bytes]   # sender -> ciphertext

    @classmethod
    def _read(cls, body: Any) -> ForwardedShares:
        f = Fields("secagg forwarded shares", body)
        sealed = _entries(f, "shares", {"sealed": SEALED_BYTES})
        return cls(f.get("round_id", "an integer in 0..2^63-1", _is_round),
                   f.get("receiver", "a client id", _is_id), {i: v for i, (v,) in sealed.items()})

    def to_body(self) -> dict[str, Any]:
        return {"round_id": self.round_id, "receiver": self.receiver,
                "shares": _put({i: (v,) for i, v in self.sealed.items()}, ("sealed",))}


@dataclass(frozen=True)
class MaskedInput(_Body):
    """Client to server: its quantized vector plus masks, and the neighbours it masked with."""

    round_id: int
    sender: int
    masked_with: tuple[int, ...]   # ascending
    vector: bytes                  # little-endian words (masking.to_bytes)

    @classmethod
    def _read(cls, body: Any) -> MaskedInput:
        f = Fields("secagg masked input", body)
        return cls(f.get("round_id", "an integer in 0..2^63-1", _is_round), f.get("sender", "a client id", _is_id),
                   _ids(f, "masked_with"), _raw(f, "vector", None))

    @classmethod
    def from_header(cls, body: Any, vector: bytes) -> MaskedInput:
        """The fields of :meth:`header` with the words that came apart from them (over MQTT, as a tensor:
        base64 in JSON would cost a third more bytes and a header past the envelope's limit)."""
        if not isinstance(body, Mapping) or "vector" in body:
            raise MessageError("secagg masked input header must be an object without 'vector' (the words travel "
                               "as a tensor)")
        return cls.from_body({**body, "vector": _b64(b"")})._replace_vector(vector)

    def _replace_vector(self, vector: bytes) -> MaskedInput:
        return MaskedInput(self.round_id, self.sender, self.masked_with, vector)

    def header(self) -> dict[str, Any]:
        """The body without the words: what travels beside them."""
        return {"round_id": self.round_id, "sender": self.sender, "masked_with": list(self.masked_with)}

    def to_body(self) -> dict[str, Any]:
        return {"round_id": self.round_id, "sender": self.sender, "masked_with": list(self.masked_with),
                "vector": _b64(self.vector)}


@dataclass(frozen=True)
class UnmaskRequest(_Body):
    """Server to survivors: who sent a masked input (reveal their self-mask shares) and who did not (mask keys)."""

    round_id: int
    survivors: tuple[int, ...]   # ascending
    dropped: tuple[int, ...]     # ascending

    @classmethod
    def _read(cls, body: Any) -> UnmaskRequest:
        f = Fields("secagg unmask request", body)
        return cls(f.get("round_id", "an integer in 0..2^63-1", _is_round), _ids(f, "survivors"), _ids(f, "dropped"))

    def to_body(self) -> dict[str, Any]:
        return {"round_id": self.round_id, "survivors": list(self.survivors), "dropped": list(self.dropped)}


@dataclass(frozen=True)
class UnmaskResponse(_Body):
    """Client to server: its shares of survivors' self-mask seeds and of dropped clients' mask keys."""

    round_id: int
    sender: int
    self_shares: Mapping[int, int]   # survivor id -> share of its b
    key_shares: Mapping[int, int]    # dropped id -> share of its s_sk

    @classmethod
    def _read(cls, body: Any) -> UnmaskResponse:
        f = Fields("secagg unmask response", body)

        def shares(name: str) -> dict[int, int]:
            return {i: share_from_bytes(v) for i, (v,) in _entries(f, name, {"share": SHARE_BYTES}).items()}

        return cls(f.get("round_id", "an integer in 0..2^63-1", _is_round), f.get("sender", "a client id", _is_id),
                   shares("self_shares"), shares("key_shares"))

    def to_body(self) -> dict[str, Any]:
        def put(shares: Mapping[int, int]) -> list[dict[str, Any]]:
            return _put({i: (share_to_bytes(v),) for i, v in shares.items()}, ("share",))

        return {"round_id": self.round_id, "sender": self.sender, "self_shares": put(self.self_shares),
                "key_shares": put(self.key_shares)}
