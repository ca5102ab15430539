"""PANs' export hook: fold position-aware neurons into the layers before them.

A PAN applies a fixed per-neuron constant ``e`` to the pre-activation just before
the ReLU: ``relu(z * e)`` or ``relu(z + e)``. ``z`` is an affine function of the
layer's parameters, so the constant can live in those parameters instead of in
an extra operator (docs/export.md, "Folded PANs"):

- after a Linear or Conv2d (grouped or not), or any layer that says its output neuron ``j`` is
  row ``j`` of its weight plus bias ``j`` (``row_outputs = True``): multiplicative
  ``W <- diag(e) W, b <- e * b``; additive ``b <- b + e`` (a bias is created when the layer has none);
- after an affine normalization (BatchNorm in eval mode, GroupNorm; both have a
  per-channel scale ``gamma`` and shift ``beta`` as their last step):
  multiplicative ``gamma <- e * gamma, beta <- e * beta``; additive ``beta <- beta + e``.

Where neither applies (a normalization without affine parameters, or a PAN that
does not follow its layer inside an ``nn.Sequential``), the constant stays as an
explicit per-channel multiply or add before a plain ReLU, and the fold report says
so. Folding works on a copy in eval mode; the model it was given is untouched. The card's
``pans`` entry lists every PAN and where its constant went.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from export.hooks import ExportHook
from methods.pans.model import PositionAwareReLU

__all__ = ["FoldedPan", "ChannelConstant", "fold_pans", "HOOK"]

log = logging.getLogger("fedge.export")

_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.GroupNorm)


@dataclass(frozen=True)
class FoldedPan:
    """What happened to one PAN: the module it sat in, its mode, and where its constant went."""

    name: str      # the PositionAwareReLU's module name, e.g. "features.2"
    mode: str      # add | mul
    into: str      # "layer" (weights and bias), "norm" (affine parameters) or "kept" (an explicit constant)
    target: str    # name of the module that absorbed the constant ("" when kept)


class ChannelConstant(nn.Module):
    """The unfoldable case: ``z * e`` or ``z + e`` with ``e`` broadcast over channels (dimension 1)."""

    encoding: torch.Tensor

    def __init__(self, mode: str, encoding: torch.Tensor) -> None:
        super().__init__()
        self.mode = mode
        self.register_buffer("encoding", encoding.detach().clone())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        e = self.encoding.view(1, -1, *([1] * (z.dim() - 2)))
        return z * e if self.mode == "mul" else z + e


def _per_output(e: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``e`` shaped to scale the output rows of a weight (``[J, 1]`` or ``[J, 1, 1, 1]``)."""
    return e.view(-1, *([1] * (like.dim() - 1))).to(like.dtype)


@torch.no_grad()
def _fold_into_layer(layer: nn.Module, mode: str, e: torch.Tensor) -> None:
    if mode == "mul":
        layer.weight.mul_(_per_output(e, layer.weight))
        if layer.bias is not None:
            layer.bias.mul_(e.to(layer.bias.dtype))
        return
    if layer.bias is None:
        layer.bias = nn.Parameter(torch.zeros(layer.weight.shape[0], dtype=layer.weight.dtype))
    layer.bias.add_(e.to(layer.bias.dtype))


@torch.no_grad()
def _fold_into_norm(norm: nn.Module, mode: str, e: torch.Tensor) -> None:
    if mode == "mul":
        norm.weight.mul_(e.to(norm.weight.dtype))
        norm.bias.mul_(e.to(norm.bias.dtype))
    else:
        norm.bias.add_(e.to(norm.bias.dtype))


def _foldable(module: nn.Module, neurons: int) -> str | None:
    """``"layer"`` or ``"norm"`` when ``module`` can absorb a PAN over ``neurons`` channels, else None."""
    rows = isinstance(module, (nn.Linear, nn.Conv2d)) or getattr(module, "row_outputs", False)
    if rows and module.weight.shape[0] == neurons:
        return "layer"
    if isinstance(module, _NORMS) and getattr(module, "affine", False) and module.weight.shape[0] == neurons:
        return "norm"
    return None


def fold_pans(model: nn.Module) -> tuple[nn.Module, list[FoldedPan]]:
    """An eval-mode copy of ``model`` whose PANs are plain ReLUs, and what was folded where.

    The copy computes the same function as ``model.eval()`` (up to float rounding).
    A model without PANs comes back as an eval-mode copy with an empty report.
    """
    folded = copy.deepcopy(model).eval()
    report: list[FoldedPan] = []
    names = {id(m): n for n, m in folded.named_modules()}
    for parent_name, parent in list(folded.named_modules()):
        for key, child in list(parent.named_children()):
            if not isinstance(child, PositionAwareReLU):
                continue
            name = f"{parent_name}.{key}" if parent_name else key
            e = child.encoding.detach()
            previous = _previous_sibling(parent, key)
            into = _foldable(previous, e.numel()) if previous is not None else None
            if into == "layer":
                _fold_into_layer(previous, child.mode, e)  # type: ignore[arg-type]
                replacement: nn.Module = nn.ReLU()
            elif into == "norm":
                _fold_into_norm(previous, child.mode, e)  # type: ignore[arg-type]
                replacement = nn.ReLU()
            else:
                replacement = nn.Sequential(ChannelConstant(child.mode, e), nn.ReLU())
            setattr(parent, key, replacement)
            report.append(FoldedPan(name, child.mode, into or "kept", names.get(id(previous), "") if into else ""))
    return folded, report


def _previous_sibling(parent: nn.Module, key: str) -> nn.Module | None:
    """The module that feeds ``parent.key``: its predecessor in a Sequential, else unknown."""
    if not isinstance(parent, nn.Sequential):
        return None
    keys = [k for k, _ in parent.named_children()]
    i = keys.index(key)
    return parent[i - 1] if i > 0 else None


def _prepare(model: nn.Module, spec: Mapping[str, Any]) -> tuple[nn.Module, dict[str, Any]]:
    folded, report = fold_pans(model)
    kept = [f.name for f in report if f.into == "kept"]
    if kept:
        log.warning("PANs of %s could not be folded (no affine parameters to absorb them); they stay as a "
                    "per-channel constant in the graph", ", ".join(kept))
    return folded, {"pans": [{"module": f.name, "mode": f.mode, "folded_into": f.into, "target": f.target}
                             for f in report]}


def _describe(card: Mapping[str, Any]) -> list[str]:
    pans = card.get("pans") or []
    if not pans:
        return []
    places = sorted({p["folded_into"] for p in pans})
    return [f"  PANs: {len(pans)} ({pans[0]['mode']}) folded into: {', '.join(places)}"]


HOOK = ExportHook(prepare=_prepare, describe=_describe)
