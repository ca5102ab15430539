"""The model devices hold after the last broadcast, kept by the coordinator so that the next broadcast can be a
delta from it (``codec.down_delta``).

The reference is not the global model: it is what devices rebuilt, the previous reference plus the quantized
delta, computed here with the device's own function (:func:`~edge_client.wire.model_delta.apply_delta`) on the
same wire tensors, so both sides hold the same bits. Each delta is the new global model minus the reference, so
what quantization dropped in one round is sent in the next: the reference stays within one quantization step of
the global model instead of drifting from it.

The reference lives in memory only: a resumed run starts without one, and its first broadcast is full only
(devices fetch the full model once, then deltas again).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from edge_client.wire.codec import CodecSpec
from edge_client.wire.model_delta import apply_delta, encode_delta, model_digest

__all__ = ["ReferenceStep", "ModelReference"]


@dataclass(frozen=True)
class ReferenceStep:
    """One broadcast's model as devices hold it, and the delta that gives it from the model before (if any)."""

    model: dict[str, torch.Tensor]         # float32: what the full broadcast carries and a delta rebuilds
    digest: str                            # model_digest(model)
    delta: dict[str, torch.Tensor] | None  # wire tensors of the delta; None: full only (first, or shapes changed)
    base: str | None                       # the digest of the model the delta applies to


class ModelReference:
    """The reference model, advanced once per new global model (a retried attempt gets the same step back)."""

    def __init__(self, spec: CodecSpec) -> None:
        self.spec = spec
        self._target = ""                       # digest of the global model the current step was made for
        self._step: ReferenceStep | None = None

    @property
    def current(self) -> ReferenceStep | None:
        return self._step

    def step(self, target: Mapping[str, torch.Tensor], generator: torch.Generator | None = None) -> ReferenceStep:
        """The step for the global model ``target``: a delta from the current reference when it has the same
        tensors and shapes, else ``target`` itself in float32 (full only)."""
        exact = {name: t.detach().to("cpu", torch.float32).clone() for name, t in target.items()}
        key = model_digest(exact)
        if self._step is not None and key == self._target:
            return self._step
        before = self._step
        if before is None or not _same_layout(before.model, exact):
            step = ReferenceStep(exact, key, None, None)
        else:
            wire = encode_delta(exact, before.model, self.spec, generator=generator)
            model = apply_delta(before.model, wire, self.spec)   # as every device will
            step = ReferenceStep(model, model_digest(model), wire, before.digest)
        self._target, self._step = key, step
        return step


def _same_layout(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[n].shape == b[n].shape for n in a)
