"""What the coordinator sends down each round, and how compactly.

Tensors that every task of an exchange carries with the same values (the global
model, for FedAvg) go once, as a retained ``model`` message on
``PREFIX/coordinator/model``; each task references it by the SHA-256 of its bytes
and carries only what is specific to its client. Everything goes in the
``codec.down`` format (never top-k: the download is values, not differences), and
each task tells its client how to answer (``upload``: ``codec.up``, differences or
raw values, error feedback).

With ``codec.down_delta`` the broadcast carries the coordinator's reference model
(:mod:`coordinator.runtime.model_reference`), and beside it goes a retained ``delta``
message on ``PREFIX/coordinator/delta``: the reference's change since the previous
broadcast in that codec, which a device holding the previous one fetches instead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from coordinator.config import RunConfig
from coordinator.runtime.model_reference import ModelReference
from coordinator.strategies.base import TaskPlan
from edge_client.wire.codec import CodecSpec, parse_codec
from edge_client.wire.protocol import DeltaBody, ModelBody, TaskBody, UploadSettings, encode
from edge_client.wire.updates import encode_download

__all__ = ["shared_tensors", "BroadcastMessages", "Downlink"]


def shared_tensors(plans: Sequence[TaskPlan]) -> dict[str, torch.Tensor]:
    """The tensors every plan sends with identical values: the exchange's broadcast."""
    if not plans:
        return {}
    first, rest = plans[0].down, plans[1:]
    return {name: t for name, t in first.items()
            if all(name in p.down and (p.down[name] is t or torch.equal(p.down[name], t)) for p in rest)}


def download_generator(run_seed: int, round: int) -> torch.Generator:
    """The generator a round's download is encoded with: seeded, so a retried attempt re-encodes the
    same bytes (the same broadcast hash), and a benchmark can rebuild what a client received."""
    return torch.Generator().manual_seed(run_seed * 1_000_003 + round)


@dataclass(frozen=True)
class BroadcastMessages:
    """An exchange's broadcast: the full model message and its SHA-256; with delta broadcasts, the digest of the
    model it carries and (unless this broadcast is full only) the delta message, its SHA-256 and its base."""

    payload: bytes
    digest: str
    model_digest: str | None = None
    delta_payload: bytes = b""
    delta_digest: str | None = None
    base: str | None = None


class Downlink:
    """Encodes the broadcast and the tasks of a run with its download codec."""

    def __init__(self, config: RunConfig, run_id: str) -> None:
        self.config = config
        self.run_id = run_id
        self.spec = parse_codec(config.codec.down).dense()   # the codec of every task and broadcast
        # Upload codecs by a plan's own spec (None: the run's codec.up), each parsed once.
        self._upload_codecs: dict[str | None, CodecSpec] = {None: parse_codec(config.codec.up)}
        # The model devices hold, when broadcasts go as deltas too (codec.down_delta); in memory only.
        self.reference = ModelReference(parse_codec(config.codec.down_delta)) if config.codec.down_delta else None

    def _encode(self, kind: str, round: int, task_id: str, body: ModelBody | TaskBody,
                tensors: dict[str, torch.Tensor]) -> bytes:
        wire = encode_download(tensors, body.codec, generator=download_generator(self.config.run.seed, round))
        return encode(kind, run_id=self.run_id, round=round, task_id=task_id, sender="coordinator",
                      body=body.to_body(), tensors=wire, compression=body.codec)

    def broadcast(self, round: int, tensors: dict[str, torch.Tensor]) -> BroadcastMessages:
        """The ``model`` message for ``tensors`` and the SHA-256 (hex) tasks reference it by; with delta
        broadcasts, the reference model in its place and the ``delta`` message that rebuilds it."""
        if self.reference is None:
            payload = self._encode("model", round, "", ModelBody(self.spec), tensors)
            return BroadcastMessages(payload, hashlib.sha256(payload).hexdigest())
        step = self.reference.step(tensors, download_generator(self.config.run.seed, round))
        payload = self._encode("model", round, "", ModelBody(self.spec), step.model)
        digest = hashlib.sha256(payload).hexdigest()
        if step.delta is None or step.base is None:
            return BroadcastMessages(payload, digest, step.digest)
        body = DeltaBody(self.reference.spec, step.base, step.digest)
        delta = encode("delta", run_id=self.run_id, round=round, task_id="", sender="coordinator",
                       body=body.to_body(), tensors=step.delta, compression=body.codec)
        return BroadcastMessages(payload, digest, step.digest, delta, hashlib.sha256(delta).hexdigest(), step.base)

    def task(self, round: int, task_id: str, body: TaskBody, tensors: dict[str, torch.Tensor]) -> bytes:
        """The ``task`` message: ``tensors`` in the body's codec (normally :attr:`spec`)."""
        return self._encode("task", round, task_id, body, tensors)

    def upload_codec(self, plan: TaskPlan) -> CodecSpec:
        """The codec a plan's result comes in: its own (``plan.codec``) or the run's ``codec.up``."""
        if plan.codec not in self._upload_codecs:
            self._upload_codecs[plan.codec] = parse_codec(plan.codec)
        return self._upload_codecs[plan.codec]

    def upload(self, plan: TaskPlan) -> UploadSettings:
        """The task's ``upload`` field: statistics (``plan.expect``) always go back raw; the plan's clip norm
        and device noise multiplier go with it (differential privacy)."""
        update = "raw" if plan.expect is not None else plan.update
        return UploadSettings(self.upload_codec(plan), update, self.config.codec.error_feedback, plan.clip_norm,
                              plan.noise_multiplier)
