"""Clipping a device's update, and the device's own noise: the device's half of differential privacy.

The coordinator's noise hides one device's contribution only if that contribution is bounded,
so a task under ``privacy.mode = "central"`` carries a clip norm and the device scales its whole
update (every tensor it sends as a difference, together) down to that L2 norm before anything
lossy happens to it. The coordinator clips what it decodes again (:mod:`coordinator.privacy`),
so the bound holds whatever a codec or a device did. Under ``privacy.mode = "local"`` the task
carries a noise multiplier too, and the device adds the Gaussian noise to its clipped update
itself (:func:`add_noise`), so that nothing it sends needs a trusted coordinator. Pure functions,
shared by both sides.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping

import torch

__all__ = ["update_norm", "clip_update", "add_noise", "fresh_generator"]

_BELOW = 1.0 - 2.0 ** -22   # a float32 rounding moves a norm by at most 2^-24 of it


def update_norm(update: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm of all of ``update``'s tensors taken as one vector (accumulated in float64)."""
    return math.sqrt(sum(float(t.detach().to(torch.float64).square().sum()) for t in update.values()))


def clip_update(update: Mapping[str, torch.Tensor], clip_norm: float) -> tuple[dict[str, torch.Tensor], bool]:
    """``update`` scaled by min(1, clip_norm / norm), and whether it was scaled.

    One factor for every tensor keeps the update's direction: clipping per tensor would bound the
    norm too but change what the update says. Dtypes are kept; an update already within the bound
    is returned as it is (same values), so clipping twice is clipping once.
    """
    if not (clip_norm > 0 and math.isfinite(clip_norm)):
        raise ValueError(f"the clip norm must be a positive finite number, got {clip_norm}")
    norm = update_norm(update)
    if not math.isfinite(norm):
        raise ValueError("the update is not finite; it cannot be clipped (check the local training's learning rate)")
    if norm <= clip_norm:
        return dict(update), False
    scale = clip_norm / norm * _BELOW   # rounding to the update's dtype must not push it over the bound
    return {k: (t.to(torch.float64) * scale).to(t.dtype) for k, t in update.items()}, True


def fresh_generator() -> torch.Generator:
    """A generator seeded from the operating system's entropy: noise that anyone knowing ``run.seed``
    (it is in config.toml, and in every task as ``seed``) could regenerate would protect nothing."""
    return torch.Generator().manual_seed(secrets.randbits(63))


def add_noise(update: Mapping[str, torch.Tensor], std: float,
              generator: torch.Generator) -> dict[str, torch.Tensor]:
    """``update`` plus N(0, std^2) on every coordinate (drawn in float64, dtypes kept).

    Local differential privacy's release: on a clipped update, the noise is what hides the device's
    data from whoever reads the result, the coordinator and the broker included.
    """
    if not (std >= 0 and math.isfinite(std)):
        raise ValueError(f"the noise std must be a finite number >= 0, got {std}")
    return {k: (t.to(torch.float64) + torch.randn(t.shape, dtype=torch.float64, generator=generator) * std
                ).to(t.dtype) for k, t in update.items()}
