"""The bodies of the messages a device exchanges: presence, task, result, status and the model broadcast.

Each kind's body is a frozen dataclass whose fields are declared once, with
:func:`~edge_client.wire.body_fields.wire`: type, range or values, default, when the key
is left out, and (in the comment beside it) what it means. ``to_body()`` gives the JSON
object a message carries and ``from_body()`` parses one, raising ProtocolError that names
the field; both, and docs/protocol.schema.json, come from the declarations. Codec specs
in a body are parsed here, once per message. ``docs/protocol.md`` describes the same
thing for people; keep both true.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edge_client.wire.body_fields import (REQUIRED, SESSION, SHA256, Body, an_object, boolean, codec_spec, integer,
                                         matching, names, nested, number, one_of, optional, text, wire)
from edge_client.wire.codec_spec import FP32, CodecSpec
from edge_client.wire.errors import ProtocolError

__all__ = ["DEFAULT_TASK_TIMEOUT", "DEFAULT_RESEND_EVERY", "UPDATES", "PRESENCE_STATES", "STATUS_STATES",
           "REFUSAL_APP", "MODEL_FROM", "UploadSettings", "PresenceBody", "TaskBody", "ResultBody", "StatusBody",
           "ModelBody", "DeltaBody"]

DEFAULT_TASK_TIMEOUT = 600.0     # a task's ``timeout`` when it has none
DEFAULT_RESEND_EVERY = 10.0      # a task's ``resend_every`` when it has none
UPDATES = ("delta", "raw")
PRESENCE_STATES = ("online", "offline")
STATUS_STATES = ("ack", "rejected", "closed", "running", "finished", "stopped")
# A failed result's ``refusal`` when the device's installed app is not the task's: it refuses every task of the run
# until the run's app is installed (edge_client.app.AppMismatch). Other kinds may come: a reader that does not know
# one takes the result as a plain failure.
REFUSAL_APP = "app"
# A result's ``model_from``: how the device came by the task's model broadcast. held: it had it already; full: it
# fetched the full broadcast (no delta offered); delta: it rebuilt it from the delta broadcast; no_base: a delta was
# offered but the device held no model it was made from (new, restarted, missed rounds), so it fetched the full one;
# bad_delta: the delta failed its checks (the rebuilt model's digest among them), so it fetched the full one.
MODEL_FROM = ("held", "full", "delta", "no_base", "bad_delta")
_COUNT = integer(minimum=0)
_SECONDS = number(above=0, want="a positive number of seconds")


@dataclass(frozen=True)
class UploadSettings(Body):
    """How a client answers a task: the task body's ``upload`` object.

    A task without one gets raw float32 values; in one, ``update`` defaults to
    ``delta``, ``codec`` to ``fp32`` and ``error_feedback`` to true. ``clip_norm``
    (differential privacy, docs/privacy.md): the L2 norm the whole update
    (every difference together) is clipped to before it is encoded; None: no clipping.
    ``noise_multiplier`` (local differential privacy): the device adds N(0, (z x clip_norm)^2)
    to every coordinate of the clipped update before it is encoded, and reports nothing about
    its data besides; None: no noise on the device (it needs ``clip_norm``).
    """

    KIND = "task"

    codec: CodecSpec = wire(codec_spec(), FP32)                    # the codec of the result's tensors
    # delta: the tensors the client received go back as differences; raw: as values
    update: str = wire(one_of(UPDATES), "raw", absent="delta")
    error_feedback: bool = wire(boolean(), False, absent=True)     # keep what a lossy codec dropped for next time
    clip_norm: float | None = optional(number(above=0))            # the L2 norm the whole update is clipped to
    # the device's noise, a multiple of clip_norm (local differential privacy); needs clip_norm
    noise_multiplier: float | None = optional(number(at_least=0))

    def __post_init__(self) -> None:
        if self.noise_multiplier is not None and self.clip_norm is None:
            raise ProtocolError("task field upload.noise_multiplier needs upload.clip_norm: the noise is a multiple "
                                "of the bound the update is clipped to")

    @classmethod
    def from_body(cls, body: Any) -> UploadSettings:
        """A task's ``upload`` object, its errors naming ``upload.FIELD``."""
        return cls.read(body, "task", "upload.")


@dataclass(frozen=True)
class PresenceBody(Body):
    """A ``presence`` body: a client is online (with facts about its data and device) or offline."""

    KIND = "presence"
    TENSORS = "none"

    state: str = wire(one_of(PRESENCE_STATES))                       # online | offline
    num_samples: int | None = optional(_COUNT)                       # size of its training data
    input_shape: tuple[int, ...] | None = optional(                  # [C, H, W] of its images
        names("a list of non-negative integers", items=_COUNT))
    num_classes: int | None = optional(_COUNT)                       # its largest label + 1
    device: dict[str, Any] | None = optional(an_object())            # profiling.device facts


@dataclass(frozen=True)
class TaskBody(Body):
    """A ``task`` body: what one client is asked to do and how to answer."""

    KIND = "task"
    TENSORS = "what the client starts from that is not in the model broadcast, in the body's codec"
    WIRE_ORDER = ("objective", "hyper", "model", "up", "seed", "timeout", "resend_every", "deadline", "upload",
                  "broadcast", "codec", "session", "secagg", "model_digest", "delta_broadcast", "delta_base")

    # a registered objective: train, evaluate, a method's own
    objective: str = wire(text("an objective name"))
    # the model spec the client builds the network from
    model: dict[str, Any] = wire(an_object("a model spec object"))
    up: tuple[str, ...] = wire(names())    # names of the tensors to send back
    # the objective's hyperparameters (learning rate, epochs, a method's own)
    hyper: dict[str, Any] = wire(an_object(), factory=dict)
    # how to answer: the codec, differences or raw values, clipping and noise
    upload: UploadSettings = wire(nested(UploadSettings, "upload_settings"), UploadSettings())
    codec: CodecSpec = wire(codec_spec(), FP32)                        # the codec of this message's tensors
    # SHA-256 of the model message with the shared tensors
    broadcast: str | None = optional(SHA256)
    seed: int = wire(integer(), 0)                                     # the run's seed
    # seconds the client keeps re-sending its result, and waits for a missing broadcast
    timeout: float = wire(_SECONDS, DEFAULT_TASK_TIMEOUT)
    # seconds before the first re-send, each later wait twice the one before
    resend_every: float = wire(_SECONDS, DEFAULT_RESEND_EVERY)
    # Unix time the coordinator stops waiting; informational
    deadline: float | None = optional(number(want="a Unix time"))
    # the coordinator session that gave the task (see StatusBody)
    session: str = wire(SESSION, "", omit_when="")
    # A stage of secure aggregation (edge_client/secagg/stages.py parses it); None: an ordinary task.
    secagg: dict[str, Any] | None = optional(an_object())
    # delta broadcasts (docs/codecs.md): the SHA-256 of the float32 tensors of the model the broadcast carries
    model_digest: str | None = optional(SHA256)
    # the SHA-256 of the delta message that rebuilds that model from the one named by delta_base
    delta_broadcast: str | None = optional(SHA256)
    # the digest of the model the delta applies to; a device holding none of it takes the broadcast
    delta_base: str | None = optional(SHA256)

    @property
    def offers_delta(self) -> bool:
        """Whether the task's broadcast may be rebuilt from a delta: it names the delta and both digests."""
        return None not in (self.broadcast, self.delta_broadcast, self.delta_base, self.model_digest)


@dataclass(frozen=True)
class ResultBody(Body):
    """A ``result`` body: a client's answer to one task, or (``error``) why it could not run it.

    A failed result carries only ``error`` and ``profile`` (and ``withdrawn``, ``refusal``);
    the other fields are left at their defaults and are not read.
    """

    KIND = "result"
    TENSORS = "exactly the names in the task's up, in the body's codec; none with error"

    # positive; the result's aggregation weight
    num_samples: int = wire(integer(minimum=1), 0, absent=REQUIRED, unless="error")
    # the task's metrics by name (train_loss, accuracy, a method's own)
    metrics: dict[str, float] = wire(an_object("an object of finite numbers", values=number()), factory=dict,
                                     unless="error")
    codec: CodecSpec = wire(codec_spec(), FP32, unless="error")        # the codec of the result's tensors
    delta: tuple[str, ...] = wire(names(), (), unless="error")        # the tensors sent as differences
    error: str | None = optional(text())                               # why the task could not run
    profile: dict[str, Any] = wire(an_object(), factory=dict)          # how the task went on the device
    # a secure-aggregation stage's answer (edge_client/secagg/stages.py)
    secagg: dict[str, Any] | None = wire(an_object(), None, omit_when=None, unless="error")
    # With ``error``: the device will refuse every further task of the run (its own privacy budget is spent or
    # cannot cover the run's tasks), so drawing it again only wastes a place in a round.
    withdrawn: bool = wire(boolean(), False, omit_when=False, only_with="error")
    # With ``error``: what kind of refusal it is, for a coordinator to act on without reading the text
    # (REFUSAL_APP: the device's app differs from the task's); "" for any other failure.
    refusal: str = wire(matching(r"^[a-z_]{1,32}$", "1 to 32 lowercase letters or '_'"), "", omit_when="",
                        only_with="error")
    # How the device came by the task's model broadcast (MODEL_FROM); None: the task named none, or an older device.
    model_from: str | None = optional(one_of(MODEL_FROM))


@dataclass(frozen=True)
class StatusBody(Body):
    """A ``status`` body: ``ack`` or ``rejected`` for one result (``task_id``), ``closed`` for one task whose round
    has the results it counts, or the run's state."""

    KIND = "status"
    TENSORS = "none"

    # ack | rejected (one result), closed (one task: drop it unless started), running | finished | stopped (the run)
    state: str = wire(one_of(STATUS_STATES))
    task_id: str | None = optional(text())              # the result's or the closed task's; None in the run's status
    reason: str = wire(text(), "", omit_when="")         # why a result was rejected or a task closed
    # The run's status: the coordinator process that speaks for the run. A resumed run keeps its run id
    # but not its session, so devices learn that rounds they saw may come again.
    session: str = wire(SESSION, "", omit_when="")


@dataclass(frozen=True)
class ModelBody(Body):
    """A ``model`` body: the codec of the broadcast's tensors."""

    KIND = "model"
    TENSORS = "the tensors every task of an exchange shares, dense, in the body's codec"

    codec: CodecSpec = wire(codec_spec(), FP32)   # the codec of the broadcast's tensors


@dataclass(frozen=True)
class DeltaBody(Body):
    """A ``delta`` body: the codec of the difference, and the digests of the model it applies to and the model it
    gives (each the SHA-256 of float32 tensors, edge_client/wire/model_delta.py)."""

    KIND = "delta"
    TENSORS = "the difference from the base model, of every tensor of the model broadcast, in the body's codec"

    codec: CodecSpec = wire(codec_spec())    # the codec of the difference
    base: str = wire(SHA256)                 # the digest of the model the difference is added to
    result: str = wire(SHA256)               # the digest of the model that sum must give
