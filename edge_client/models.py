"""Model registry: every party builds the same network from the same spec.

A model spec is a plain JSON-serializable dict (it travels inside each task), e.g.
``{"name": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 28}``.
The coordinator and every client call :func:`build_model` on it, so the parameter
names and shapes agree everywhere without ever sending code or pickles.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = [
    "ModelSpecError",
    "MODELS",
    "build_model",
    "register_model",
    "federated_names",
    "state_shapes",
]


class ModelSpecError(ValueError):
    """A model spec names an unknown model or carries an invalid option."""


ModelFactory = Callable[..., nn.Module]
MODELS: dict[str, ModelFactory] = {}


def register_model(name: str) -> Callable[[ModelFactory], ModelFactory]:
    """Add a factory to the registry under ``name`` (used as a decorator)."""

    def add(factory: ModelFactory) -> ModelFactory:
        MODELS[name] = factory
        return factory

    return add


class MLP(nn.Module):
    """Fully connected network; ``features`` is everything but the last layer."""

    def __init__(self, num_classes: int, in_channels: int, image_size: int,
                 hidden: tuple[int, ...] = (200, 200)) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_channels * image_size * image_size
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class CNN(nn.Module):
    """The small two-block ConvNet (421,834 parameters on 28x28x1, 10 classes)."""

    def __init__(self, num_classes: int, in_channels: int, image_size: int) -> None:
        super().__init__()
        if image_size % 4:
            raise ModelSpecError(f"cnn needs an image size divisible by 4, got {image_size}")
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(64 * (image_size // 4) ** 2, 128), nn.ReLU(),
        )
        self.classifier = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


@register_model("mlp")
def _mlp(num_classes: int, in_channels: int, image_size: int,
         hidden: list[int] | tuple[int, ...] = (200, 200)) -> nn.Module:
    if not hidden or any(int(h) < 1 for h in hidden):
        raise ModelSpecError(f"mlp hidden widths must be positive integers, got {hidden!r}")
    return MLP(num_classes, in_channels, image_size, tuple(int(h) for h in hidden))


@register_model("cnn")
def _cnn(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    return CNN(num_classes, in_channels, image_size)


_SHAPE_KEYS = ("num_classes", "in_channels", "image_size")


def build_model(spec: Mapping[str, Any]) -> nn.Module:
    """Build the model a spec describes; raise ModelSpecError naming the problem."""
    if not isinstance(spec, Mapping) or "name" not in spec:
        raise ModelSpecError(f"a model spec is a mapping with a 'name', got {spec!r}")
    name = spec["name"]
    if name not in MODELS:
        raise ModelSpecError(f"unknown model {name!r}; available: {', '.join(sorted(MODELS))}")
    for key in _SHAPE_KEYS:
        value = spec.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelSpecError(f"model spec needs a positive integer {key!r}, got {value!r}")
    options = {k: v for k, v in spec.items() if k != "name"}
    try:
        return MODELS[name](**options)
    except TypeError as exc:  # an option the factory does not take
        raise ModelSpecError(f"model {name!r} rejects its options {sorted(options)}: {exc}") from exc


def federated_names(model: nn.Module) -> list[str]:
    """Names of the floating-point state that federated training exchanges.

    Non-persistent buffers (fixed encodings rebuilt on every party) are not in the
    state dict, and integer counters such as BatchNorm's ``num_batches_tracked``
    are local bookkeeping, so neither is ever sent.
    """
    return [k for k, v in model.state_dict().items() if v.is_floating_point()]


def state_shapes(model: nn.Module, names: list[str] | None = None) -> dict[str, tuple[int, ...]]:
    """Expected shape of each exchanged tensor, used to validate received messages."""
    state = model.state_dict()
    return {k: tuple(state[k].shape) for k in (names if names is not None else federated_names(model))}
