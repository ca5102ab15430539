"""What the coordinator sends down each round, and how compactly.

Tensors that every task of an exchange carries with the same values (the global
model, for FedAvg) go once, as a retained ``model`` message on
``PREFIX/coordinator/model``; each task references it by the SHA-256 of its bytes
and carries only what is specific to its client. Everything goes in the
``codec.down`` format (never top-k: the download is values, not differences), and
each task tells its client how to answer (``upload``: ``codec.up``, differences or
raw values, error feedback).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from coordinator.config import RunConfig
from coordinator.strategies.base import TaskPlan
from edge_client.wire.codec import CodecSpec, parse_codec
from edge_client.wire.protocol import encode
from edge_client.wire.updates import UploadSettings, encode_download

__all__ = ["shared_tensors", "Downlink"]


def shared_tensors(plans: Sequence[TaskPlan]) -> dict[str, torch.Tensor]:
    """The tensors every plan sends with identical values: the exchange's broadcast."""
    if not plans:
        return {}
    first, rest = plans[0].down, plans[1:]
    return {name: t for name, t in first.items()
            if all(name in p.down and (p.down[name] is t or torch.equal(p.down[name], t)) for p in rest)}


class Downlink:
    """Encodes the broadcast and the tasks of a run with its download codec."""

    def __init__(self, config: RunConfig, run_id: str) -> None:
        self.config = config
        self.run_id = run_id
        self.spec = parse_codec(config.codec.down).dense()
        self.up = parse_codec(config.codec.up)

    def _encode(self, kind: str, round: int, task_id: str, body: dict[str, Any],
                tensors: dict[str, torch.Tensor]) -> bytes:
        # Seeded, so a retried attempt re-encodes the same bytes (same broadcast hash).
        generator = torch.Generator().manual_seed(self.config.run.seed * 1_000_003 + round)
        wire, fields = encode_download(tensors, self.spec, generator=generator)
        return self.spec.compress(encode(kind, run_id=self.run_id, round=round, task_id=task_id,
                                         sender="coordinator", body={**body, **fields}, tensors=wire))

    def broadcast(self, round: int, tensors: dict[str, torch.Tensor]) -> tuple[bytes, str]:
        """The ``model`` message for ``tensors`` and the SHA-256 (hex) tasks reference it by."""
        payload = self._encode("model", round, "", {}, tensors)
        return payload, hashlib.sha256(payload).hexdigest()

    def task(self, round: int, task_id: str, body: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bytes:
        return self._encode("task", round, task_id, body, tensors)

    def upload_codec(self, plan: TaskPlan) -> CodecSpec:
        """The codec a plan's result comes in: its own (``plan.codec``) or the run's ``codec.up``."""
        return parse_codec(plan.codec) if plan.codec is not None else self.up

    def upload(self, plan: TaskPlan) -> dict[str, Any]:
        """The task's ``upload`` field: statistics (``plan.expect``) always go back raw."""
        update = "raw" if plan.expect is not None else plan.update
        return UploadSettings(self.upload_codec(plan), update, self.config.codec.error_feedback).to_body()
