"""The bodies the coordinator and its aggregation workers exchange (never a device): the manifest of an
exchange's tasks, a worker's claim on a result, and a worker's partial sum.

Checked field by field like the devices' bodies (:mod:`edge_client.wire.body_fields`):
a worker's message crosses the broker like any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edge_client.wire.body_fields import Fields, is_int, is_names, is_number, is_object, is_sha256, is_str
from edge_client.wire.codec import CodecSpec
from edge_client.wire.topics import valid_client_id

__all__ = ["ManifestBody", "ClaimBody", "PartialBody"]


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
    clip_norm: float | None = None   # the tasks' clip norm (central differential privacy): results are held to it
    # The tasks' device noise (local differential privacy): results are noisy and are not held to the clip norm.
    noise_multiplier: float | None = None

    @classmethod
    def from_body(cls, body: Any) -> ManifestBody:
        f = Fields("manifest", body)
        return cls(exchange=f.get("exchange", "a string", is_str), phase=f.get("phase", "a string", is_str),
                   model=f.get("model", "an object", is_object),
                   up=tuple(f.get("up", "a list of tensor names", is_names)), codec=f.codec("codec"),
                   tasks=f.get("tasks", "an object of task id -> client id",
                               lambda v: isinstance(v, dict) and all(valid_client_id(c) for c in v.values())),
                   broadcast=f.get("broadcast", "a SHA-256 in hex", is_sha256, None),
                   flush=f.get("flush", "true or false", lambda v: isinstance(v, bool), False),
                   clip_norm=f.get("clip_norm", "a positive number", lambda v: is_number(v) and v > 0, None),
                   noise_multiplier=f.get("noise_multiplier", "a number >= 0", lambda v: is_number(v) and v >= 0,
                                          None))

    def to_body(self) -> dict[str, Any]:
        out = {"exchange": self.exchange, "phase": self.phase, "model": self.model, "up": list(self.up),
               "codec": self.codec.text, "tasks": self.tasks, "flush": self.flush}
        if self.broadcast is not None:
            out["broadcast"] = self.broadcast
        if self.clip_norm is not None:
            out["clip_norm"] = self.clip_norm
        if self.noise_multiplier is not None:
            out["noise_multiplier"] = self.noise_multiplier
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
        f = Fields("claim", body)
        return cls(problem=f.get("problem", "a string", is_str, ""),
                   held=f.get("held", "true or false", lambda v: isinstance(v, bool), False),
                   wire_bytes=f.get("wire_bytes", "a non-negative integer", lambda v: is_int(v) and v >= 0, 0))

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
        f = Fields("partial", body)
        return cls(exchange=f.get("exchange", "a string", is_str),
                   weight=float(f.get("weight", "a positive number", lambda v: is_number(v) and v > 0)),
                   tasks=tuple(f.get("tasks", "a non-empty list of task ids", lambda v: is_names(v) and len(v) > 0)))

    def to_body(self) -> dict[str, Any]:
        return {"exchange": self.exchange, "weight": self.weight, "tasks": list(self.tasks)}
