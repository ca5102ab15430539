"""SphereFed's export hook: the card says which head the model ends in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from export.hooks import ExportHook

__all__ = ["HOOK"]


def _prepare(model: nn.Module, spec: Mapping[str, Any]) -> tuple[nn.Module, dict[str, Any]]:
    """The model as it is (the sphere head exports as ONNX operators); the card's output names its head."""
    return model, {"output": {"head": spec.get("head", "linear")}}


HOOK = ExportHook(prepare=_prepare)
