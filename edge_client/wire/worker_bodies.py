"""The bodies the coordinator and its aggregation workers exchange (never a device): the manifest of an
exchange's tasks, a worker's claim on a result, and a worker's partial sum.

Declared field by field like the devices' bodies (:mod:`edge_client.wire.body_fields`), and
checked from the declarations: a worker's message crosses the broker like any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edge_client.wire.body_fields import (CLIENT_ID, SHA256, Body, an_object, boolean, codec_spec, integer, names,
                                         number, optional, text, wire)
from edge_client.wire.codec_spec import FP32, CodecSpec

__all__ = ["ManifestBody", "ClaimBody", "PartialBody"]


@dataclass(frozen=True)
class ManifestBody(Body):
    """A ``manifest`` body: what aggregation workers need to check and fold one exchange's results.

    ``tasks`` maps each task id to its client; every task of the exchange sends back the
    tensors ``up`` of the network ``model`` in ``codec``, as differences from the model
    broadcast ``broadcast`` (its SHA-256). ``flush``: publish what you folded now.
    """

    KIND = "manifest"
    TENSORS = "none"
    WIRE_ORDER = ("exchange", "phase", "model", "up", "codec", "tasks", "flush", "broadcast", "clip_norm",
                  "noise_multiplier")

    exchange: str = wire(text())       # the exchange the tasks belong to; a new one for each
    phase: str = wire(text())          # the round's phase the tasks serve: train, evaluate, a method's own
    model: dict[str, Any] = wire(an_object())                  # the model spec of the tasks
    up: tuple[str, ...] = wire(names())                         # the tensors each result sends back
    codec: CodecSpec = wire(codec_spec(), absent=FP32)         # the codec of the results' tensors
    # each task id of the exchange -> the client it went to
    tasks: dict[str, str] = wire(an_object("an object of task id -> client id", values=CLIENT_ID))
    # SHA-256 of the model broadcast the results are differences from
    broadcast: str | None = optional(SHA256.wanting("a SHA-256 in hex"))
    flush: bool = wire(boolean(), False)    # publish what you folded now
    # the tasks' clip norm (central differential privacy): results are held to it
    clip_norm: float | None = optional(number(above=0))
    # The tasks' device noise (local differential privacy): results are noisy and are not held to the clip norm.
    noise_multiplier: float | None = optional(number(at_least=0))


@dataclass(frozen=True)
class ClaimBody(Body):
    """What an aggregation worker adds to a device's result body when it claims the result (the claim
    carries the device's header and body, without the tensors): ``problem`` why the worker could not use
    the tensors (``""``: none), ``held`` whether it holds them checked, ``wire_bytes`` the result's size
    as it came, counted in the round's ``bytes_up``."""

    KIND = "claim"

    problem: str = wire(text(), "")                  # why the worker could not use the tensors; "": none
    held: bool = wire(boolean(), False)              # the worker holds the checked tensors
    wire_bytes: int = wire(integer(minimum=0), 0)    # the result's size as it came, counted in bytes_up


@dataclass(frozen=True)
class PartialBody(Body):
    """A ``partial`` body: an aggregation worker's fold of some of an exchange's results.

    The message's tensors are the weighted sums (float64); ``weight`` their total weight;
    ``tasks`` the receipts: every task whose result is inside, each exactly once.
    """

    KIND = "partial"
    TENSORS = "the weighted sums, float64, named as the manifest's up"

    exchange: str = wire(text())               # the manifest's exchange
    weight: float = wire(number(above=0))      # the total weight of the results folded in
    # the receipts: every task whose result is inside, each once
    tasks: tuple[str, ...] = wire(names("a non-empty list of task ids", non_empty=True))
