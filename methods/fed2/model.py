"""Fed2's feature-aligned structure: the upper layers split into groups, each serving its own classes.

FedAvg averages neuron ``j`` of one client with neuron ``j`` of another even when
they learned different features. Fed2 (Yu et al., ICLR 2021) builds the alignment
into the network instead: from a chosen layer up, the hidden units are split into
``G`` groups that never mix (group convolutions, block-diagonal linear layers,
GroupNorm whose groups are the same), and the classifier is decoupled so that group
``g`` feeds only the logits of the classes allocated to it. Group ``g`` on every
client then learns features for the same classes, and the coordinator averages it
only among the clients that hold those classes (:mod:`methods.fed2.strategy`).

A model spec turns Fed2 on with ``fed2_groups = G`` (and optionally ``fed2_from``,
``fed2_allocation``): the model hook :data:`HOOK` reads those options into a
:class:`Fed2Plan`, and the backbones of :mod:`edge_client.models` ask it, layer by layer,
how to build each one (:class:`GroupedLayers`).

Layers are numbered as Fed2 numbers them: the weight layers (convolutions and linear
layers) in forward order from 1, the classifier last. ``fed2_from = L`` keeps layers
below ``L`` dense and shared; layer ``L``'s filters read all the shared features and
their outputs are split into the groups; above it, group ``g`` reads only group
``g``'s outputs. A grouped layer's width is rounded up to a multiple of ``G``.

The device's training objective is in :mod:`methods.fed2.device`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from edge_client.models import LayerPlan, ModelHook, ModelSpecError

__all__ = ["Fed2Error", "Fed2Plan", "GroupedLayers", "GroupedLinear", "DecoupledClassifier", "row_groups", "OPTIONS",
           "HOOK"]

OPTIONS = ("fed2_groups", "fed2_from", "fed2_allocation")   # the spec keys of the grouped structure


class Fed2Error(ModelSpecError):
    """Fed2 options that cannot build a model; the message says which to change."""


@dataclass(frozen=True)
class Fed2Plan:
    """Where the groups start (``first``), how many there are, and which group each class belongs to."""

    groups: int
    first: int                        # 1-based weight layer where the groups start
    allocation: tuple[int, ...]       # class -> group

    @classmethod
    def from_options(cls, num_classes: int, layers: int, fed2_groups: int = 0, fed2_from: int | None = None,
                     fed2_allocation: Sequence[int] | None = None) -> "Fed2Plan | None":
        """The plan a spec's options describe for a model of ``layers`` weight layers; None when off.

        Without ``fed2_from`` the groups take the last two thirds of the weight layers
        (the paper decouples the last 6 of VGG-9's 9).
        """
        if fed2_groups == 0 and fed2_from is None and fed2_allocation is None:
            return None
        if isinstance(fed2_groups, bool) or not isinstance(fed2_groups, int) or fed2_groups < 1:
            raise Fed2Error(f"fed2_groups must be a positive integer (the number of groups, e.g. 10), "
                            f"got {fed2_groups!r}")
        if fed2_groups > num_classes:
            raise Fed2Error(f"fed2_groups = {fed2_groups} is more than the {num_classes} classes: every group "
                            "needs a class of its own; use at most as many groups as classes")
        first = layers - round(2 * layers / 3) + 1 if fed2_from is None else fed2_from
        if isinstance(first, bool) or not isinstance(first, int) or not 1 <= first <= layers:
            raise Fed2Error(f"fed2_from is the weight layer where the groups start, 1 to {layers} for this "
                            f"model (the classifier is {layers}), got {fed2_from!r}; "
                            "fedge-coordinator fed2-depth suggests one")
        if fed2_allocation is None:
            allocation = tuple(c % fed2_groups for c in range(num_classes))
        else:
            allocation = tuple(fed2_allocation)
            if len(allocation) != num_classes or any(
                    isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < fed2_groups for g in allocation):
                raise Fed2Error(f"fed2.allocation gives each of the {num_classes} classes a group in "
                                f"0..{fed2_groups - 1}, got {list(fed2_allocation)!r}")
        empty = sorted(set(range(fed2_groups)) - set(allocation))
        if empty:
            raise Fed2Error(f"fed2.allocation leaves groups {empty} without a class; give every group at least one")
        return cls(fed2_groups, first, allocation)

    def grouped(self, layer: int) -> bool:
        """Whether weight layer ``layer`` (1-based) has its outputs split into groups."""
        return layer >= self.first

    def width(self, units: int, layer: int) -> int:
        """A hidden layer's width: rounded up to a multiple of the groups where it is grouped."""
        return self.groups * math.ceil(units / self.groups) if self.grouped(layer) else units

    def input_groups(self, layer: int) -> int:
        """How many blocks layer ``layer`` reads its input in: the groups above the first grouped layer."""
        return self.groups if layer > self.first else 1


class GroupedLinear(nn.Module):
    """A block-diagonal linear layer: output block ``g`` reads only input block ``g``.

    The weight is stored as ``(out, in / groups)``, like a group convolution's, so a
    group's parameters are a block of rows in every grouped layer; it runs as a 1-wide
    group convolution, which ONNX has as a standard ``Conv`` with ``group``.
    """

    row_outputs = True   # output j is row j of the weight plus bias j: an export may scale or shift it there

    def __init__(self, in_features: int, out_features: int, groups: int) -> None:
        super().__init__()
        if in_features % groups or out_features % groups:
            raise Fed2Error(f"a grouped linear layer needs sizes divisible by {groups}, "
                            f"got {in_features} -> {out_features}")
        self.in_features, self.out_features, self.groups = in_features, out_features, groups
        reference = nn.Linear(in_features // groups, out_features)   # the same initialization as a block's fan-in
        self.weight = nn.Parameter(reference.weight.detach().clone())
        self.bias = nn.Parameter(reference.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv1d(x.unsqueeze(-1), self.weight.unsqueeze(-1), self.bias, groups=self.groups).squeeze(-1)

    def multiply_adds(self, output: torch.Tensor) -> int:
        """Every stored weight is one connection (the blocks off the diagonal are not stored)."""
        return self.weight.numel()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, groups={self.groups}"


class DecoupledClassifier(nn.Linear):
    """The last layer with group ``g``'s features connected only to the logits of ``g``'s classes.

    A fixed mask (a non-persistent buffer, rebuilt from the spec, never sent) zeroes
    every other connection in the forward pass, so no gradient ever reaches them and a
    value received there cannot change a prediction.
    """

    mask: torch.Tensor

    def __init__(self, in_features: int, allocation: Sequence[int], groups: int) -> None:
        super().__init__(in_features, len(allocation))
        self.allocation = tuple(allocation)   # class -> group
        feature_group = torch.arange(in_features) * groups // in_features   # near-equal contiguous blocks
        mask = (torch.tensor(list(allocation)).unsqueeze(1) == feature_group.unsqueeze(0)).to(self.weight.dtype)
        self.register_buffer("mask", mask, persistent=False)
        with torch.no_grad():
            self.weight.mul_(mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * self.mask, self.bias)

    def multiply_adds(self, output: torch.Tensor) -> int:
        """Only the connections the mask keeps are computed."""
        return int(self.mask.sum())


def row_groups(model: nn.Module) -> dict[str, torch.Tensor]:
    """For every parameter of the grouped layers, the group of each of its rows (dimension 0).

    Modules the builders mark with ``fed2_groups`` split their rows into that many equal
    blocks (convolutions, grouped linear layers, their GroupNorms); the decoupled
    classifier's row ``c`` belongs to class ``c``'s group. Parameters not listed are shared.
    """
    out: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, DecoupledClassifier):
            owner = torch.tensor(module.allocation)   # logit c's row: class c's group
        elif getattr(module, "fed2_groups", 0):
            owner = None
        else:
            continue
        for name, param in module.named_parameters(recurse=False):
            rows = param.shape[0]
            groups = owner if owner is not None else torch.arange(rows) // (rows // module.fed2_groups)
            out[f"{prefix}.{name}" if prefix else name] = groups
    return out


def _grouped(module: nn.Module, groups: int) -> nn.Module:
    module.fed2_groups = groups   # read by row_groups
    return module


class GroupedLayers(LayerPlan):
    """A backbone built as a :class:`Fed2Plan` says: grouped from its first grouped layer up."""

    def __init__(self, base: LayerPlan, fed2: Fed2Plan) -> None:
        super().__init__(base)
        self.fed2 = fed2

    def width(self, units: int, index: int) -> int:
        return self.fed2.width(super().width(units, index), index)

    def conv(self, channels: int, width: int, index: int) -> nn.Module:
        groups = self.fed2.input_groups(index)
        layer = super().conv(channels, width, index) if groups == 1 else nn.Conv2d(channels, width, 3, padding=1,
                                                                                    groups=groups)
        return _grouped(layer, self.fed2.groups) if self.fed2.grouped(index) else layer

    def linear(self, features: int, width: int, index: int) -> nn.Module:
        groups = self.fed2.input_groups(index)
        layer = super().linear(features, width, index) if groups == 1 else GroupedLinear(features, width, groups)
        return _grouped(layer, self.fed2.groups) if self.fed2.grouped(index) else layer

    def norm(self, kind: str, width: int, conv: bool, index: int) -> nn.Module | None:
        if not self.fed2.grouped(index) or kind == "none":
            return super().norm(kind, width, conv, index)
        return _grouped(nn.GroupNorm(self.fed2.groups, width), self.fed2.groups)   # normalization groups = Fed2's

    def classifier(self, features: int, num_classes: int) -> nn.Module:
        """Each group connected only to its classes' logits."""
        return DecoupledClassifier(features, self.fed2.allocation, self.fed2.groups)


def _plan(base: LayerPlan, options: Mapping[str, Any], num_classes: int, layers: int) -> LayerPlan:
    fed2 = Fed2Plan.from_options(num_classes, layers, **options)
    return base if fed2 is None else GroupedLayers(base, fed2)


def without_groups(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The spec of the original model a grouped one was adapted from."""
    return {k: v for k, v in spec.items() if k not in OPTIONS}


HOOK = ModelHook(options=OPTIONS, plan=_plan, original=without_groups)
