"""SphereFed's head: a fixed orthonormal classifier on L2-normalized features.

Any backbone takes it through its spec (``head = "sphere"``, ``sphere_seed``): the model
hook :data:`HOOK` swaps the model's last linear layer for :class:`SphereHead`
(:func:`apply_head`). Building a model needs only this module, never the training code of
:mod:`methods.spherefed.device`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from edge_client.models import ModelHook, ModelSpecError
from storage.errors import FedgeError

__all__ = ["HEADS", "CLASSIFIER", "SphereError", "SphereHead", "fixed_classifier", "apply_head", "with_sphere_seed",
           "HOOK"]

HEADS = ("linear", "sphere")
CLASSIFIER = "classifier.weight"                       # the head's state: the classifier in use


class SphereError(FedgeError, ValueError):
    """A model cannot take the sphere head, or FFC statistics are malformed; the message says why."""


def fixed_classifier(num_classes: int, dim: int, seed: int) -> torch.Tensor:
    """The fixed classifier: the first C rows of Q from the QR decomposition of a seeded d x d Gaussian.

    Float64, ``[C, d]``, orthonormal rows. NumPy's seeded generator gives the same
    Gaussian on every platform, and the signs are fixed so that R has a positive
    diagonal (QR is then unique), so every party rebuilds the same matrix (to
    rounding). The factorization is torch's, which keeps to the process's torch
    threads (NumPy's BLAS threads took seconds for d = 512 on a busy 2-core machine).
    """
    if dim < num_classes:
        raise SphereError(f"the sphere head needs a feature dimension d >= the number of classes C, "
                          f"got d = {dim} < C = {num_classes}: {num_classes} orthonormal rows do not fit in "
                          f"{dim} dimensions; widen the model's last hidden layer or use head = linear")
    gaussian = torch.from_numpy(np.random.default_rng(seed).standard_normal((dim, dim)))
    q, r = torch.linalg.qr(gaussian)
    q = q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0)   # column j times sign(R_jj): the unique QR
    return q[:num_classes].contiguous()


class SphereHead(nn.Module):
    """Scores ``W z`` of the L2-normalized features ``z = h / ||h||``; ``W`` is never trained.

    ``fixed`` (the seeded orthonormal classifier) is a non-persistent buffer: rebuilt
    by every party, never in a state dict or a message. ``weight`` is the classifier
    in use: the fixed one during training, the calibrated one on the coordinator
    after FFC. It is a buffer (no gradient, never in an optimizer) in the state dict,
    so checkpoints keep the calibrated classifier; SphereFed never sends it.
    """

    fixed: torch.Tensor
    weight: torch.Tensor

    def __init__(self, in_features: int, num_classes: int, seed: int) -> None:
        super().__init__()
        w = fixed_classifier(num_classes, in_features, seed).to(torch.float32)
        self.register_buffer("fixed", w, persistent=False)
        self.register_buffer("weight", w.clone())

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.normalize(h.flatten(1), dim=1) @ self.weight.t()

    @torch.no_grad()
    def reset(self) -> None:
        """Go back to the fixed classifier (training always runs against it)."""
        self.weight.copy_(self.fixed)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fixed orthonormal rows"


def apply_head(model: nn.Module, head: Any = "linear", sphere_seed: Any = None) -> nn.Module:
    """Give a registry model the head its spec asks for (``head``, ``sphere_seed``)."""
    if head not in HEADS:
        raise SphereError(f"head must be one of {', '.join(HEADS)}, got {head!r}")
    if head == "linear":
        if sphere_seed is not None:
            raise SphereError("sphere_seed applies only to head = sphere; remove it or set head = sphere")
        return model
    seed = 0 if sphere_seed is None else sphere_seed
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise SphereError(f"sphere_seed must be an integer >= 0, got {sphere_seed!r}")
    linear = getattr(model, "classifier", None)
    if not isinstance(linear, nn.Linear):
        raise SphereError(f"head = sphere replaces a model's last linear layer `classifier`, which "
                          f"{type(model).__name__} does not have")
    if type(linear) is not nn.Linear:
        raise SphereError(f"head = sphere and the model option that made the last layer a {type(linear).__name__} "
                          "both replace the last layer; remove one of them")
    model.classifier = SphereHead(linear.in_features, linear.out_features, seed)
    return model


def with_sphere_seed(spec: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """The model spec with ``sphere_seed`` defaulting to the run's seed when ``head = sphere``."""
    out = dict(spec)
    if out.get("head") == "sphere":
        out.setdefault("sphere_seed", seed)
    return out


def _finish(model: nn.Module, options: Mapping[str, Any]) -> nn.Module:
    try:
        return apply_head(model, **options)
    except SphereError as exc:
        raise ModelSpecError(str(exc)) from None


HOOK = ModelHook(options=("head", "sphere_seed"), finish=_finish)
