"""Model registry: every party builds the same network from the same spec.

A model spec is a plain JSON-serializable dict (it travels inside each task), e.g.
``{"name": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 28}``.
The coordinator and every client call :func:`build_model` on it, so the parameter
names and shapes agree everywhere without ever sending code or pickles.

Models: ``mlp`` (``hidden`` widths), ``cnn`` and ``vgg9``. Each takes ``norm``
(``none``, ``bn`` or ``gn``), ``width`` (a multiplier of every hidden layer's
size, default 1) and the PAN options ``pan`` (``none``, ``add``, ``mul``),
``pan_period`` and ``pan_amplitude`` (see :mod:`edge_client.methods.pans`). Every model
also takes ``head``: ``linear`` (default) or ``sphere``, SphereFed's fixed classifier
on L2-normalized features, built from ``sphere_seed`` (see :mod:`edge_client.methods.sphere_head`).
Methods add networks around these backbones (DFL's two branches,
:mod:`edge_client.methods.dfl_model`); :func:`edge_client.registry.build_model` builds
any of them, this module only the backbones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from edge_client.methods.pans import PanError, PanSettings, PositionAwareReLU
from edge_client.methods.sphere_head import SphereError, apply_head

__all__ = [
    "ModelSpecError",
    "MODELS",
    "NORMS",
    "ImageClassifier",
    "build_model",
    "register_model",
    "hidden_unit",
    "mlp",
    "cnn",
    "vgg9",
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


NORMS = ("none", "bn", "gn")


def _norm(kind: str, channels: int, conv: bool) -> nn.Module | None:
    """The normalization a hidden layer gets: none, BatchNorm, or GroupNorm with up to 8 groups."""
    if kind not in NORMS:
        raise ModelSpecError(f"norm must be one of {', '.join(NORMS)}, got {kind!r}")
    if kind == "bn":
        return nn.BatchNorm2d(channels) if conv else nn.BatchNorm1d(channels)
    if kind == "gn":
        return nn.GroupNorm(math.gcd(channels, 8), channels)
    return None


def _pan_settings(options: Mapping[str, Any]) -> PanSettings:
    try:
        return PanSettings.from_options(**options)
    except PanError as exc:
        raise ModelSpecError(str(exc)) from None


def hidden_unit(layer: nn.Module, width: int, norm: str, pan: PanSettings) -> list[nn.Module]:
    """One hidden layer in the order PANs need: layer (+ bias), normalization, then the activation.

    With PANs on, the activation applies the position encoding first; it takes the
    ReLU's place, so parameter names do not depend on the PAN setting.
    """
    activation = PositionAwareReLU(pan, width) if pan.enabled else nn.ReLU()
    return [m for m in (layer, _norm(norm, width, isinstance(layer, nn.Conv2d)), activation) if m is not None]


class ImageClassifier(nn.Module):
    """``features`` (the extractor) followed by ``classifier`` (the last linear layer).

    Every model in the registry has this shape: SphereFed, DFL and FedMA address
    the two parts by these names.
    """

    def __init__(self, features: nn.Sequential, classifier: nn.Linear) -> None:
        super().__init__()
        self.features = features
        self.classifier = classifier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _scaled(units: int, width: float) -> int:
    """A layer's size under a width multiplier (at least one unit)."""
    return max(1, round(units * width))


def _check_width(width: Any) -> float:
    if isinstance(width, bool) or not isinstance(width, (int, float)) or not 0 < width <= 16:
        raise ModelSpecError(f"width is a multiplier of every hidden layer's size in (0, 16], got {width!r}")
    return float(width)


def mlp(num_classes: int, in_channels: int, image_size: int, hidden: tuple[int, ...] = (1024, 1024, 1024),
        norm: str = "none", pan: PanSettings = PanSettings(), scale: float = 1.0) -> ImageClassifier:
    """Fully connected network; the default 3 x 1024 hidden widths are the PANs paper's MLP."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_channels * image_size * image_size
    for h in (_scaled(h, scale) for h in hidden):
        layers += hidden_unit(nn.Linear(width, h), h, norm, pan)
        width = h
    return ImageClassifier(nn.Sequential(*layers), nn.Linear(width, num_classes))


def cnn(num_classes: int, in_channels: int, image_size: int, norm: str = "gn",
        pan: PanSettings = PanSettings(), scale: float = 1.0) -> ImageClassifier:
    """The small two-block ConvNet (421,834 parameters on 28x28x1, 10 classes, GroupNorm).

    ``scale`` multiplies its 32 and 64 channels and its 128 features.
    """
    if image_size % 4:
        raise ModelSpecError(f"cnn needs an image size divisible by 4, got {image_size}")
    c1, c2, d = _scaled(32, scale), _scaled(64, scale), _scaled(128, scale)
    features = nn.Sequential(
        *hidden_unit(nn.Conv2d(in_channels, c1, 3, padding=1), c1, norm, pan), nn.MaxPool2d(2),
        *hidden_unit(nn.Conv2d(c1, c2, 3, padding=1), c2, norm, pan), nn.MaxPool2d(2),
        nn.Flatten(),
        *hidden_unit(nn.Linear(c2 * (image_size // 4) ** 2, d), d, "none", pan),
    )
    return ImageClassifier(features, nn.Linear(d, num_classes))


VGG9_LAYOUT = (32, 64, "M", 128, 128, "M", 256, 256, "M")
VGG9_FC = (512, 512)


def vgg9(num_classes: int, in_channels: int, image_size: int, norm: str = "none",
         pan: PanSettings = PanSettings(), scale: float = 1.0) -> ImageClassifier:
    """VGG-9 as in FedMA, Fed2 and PANs: six 3x3 convolutions, three max-pools, FC 512, 512.

    The flatten size follows the input (256 x 3 x 3 on 28x28, 256 x 4 x 4 on 32x32).
    Normalization, when asked for, follows the convolutions only.
    """
    if image_size < 8:
        raise ModelSpecError(f"vgg9 halves the image three times and needs an image size of at least 8, "
                             f"got {image_size}; use cnn or mlp for smaller inputs")
    layers: list[nn.Module] = []
    channels, size = in_channels, image_size
    for item in VGG9_LAYOUT:
        if item == "M":
            layers.append(nn.MaxPool2d(2))
            size //= 2
        else:
            out = _scaled(int(item), scale)
            layers += hidden_unit(nn.Conv2d(channels, out, 3, padding=1), out, norm, pan)
            channels = out
    layers.append(nn.Flatten())
    width = channels * size * size
    for h in (_scaled(h, scale) for h in VGG9_FC):
        layers += hidden_unit(nn.Linear(width, h), h, "none", pan)
        width = h
    return ImageClassifier(nn.Sequential(*layers), nn.Linear(width, num_classes))


@register_model("mlp")
def _mlp(num_classes: int, in_channels: int, image_size: int,
         hidden: list[int] | tuple[int, ...] = (1024, 1024, 1024), norm: str = "none", width: float = 1.0,
         **pan: Any) -> nn.Module:
    if not hidden or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in hidden):
        raise ModelSpecError(f"mlp hidden widths must be positive integers, got {hidden!r}")
    return mlp(num_classes, in_channels, image_size, tuple(hidden), norm, _pan_settings(pan), _check_width(width))


@register_model("cnn")
def _cnn(num_classes: int, in_channels: int, image_size: int, norm: str = "gn", width: float = 1.0,
         **pan: Any) -> nn.Module:
    return cnn(num_classes, in_channels, image_size, norm, _pan_settings(pan), _check_width(width))


@register_model("vgg9")
def _vgg9(num_classes: int, in_channels: int, image_size: int, norm: str = "none", width: float = 1.0,
          **pan: Any) -> nn.Module:
    return vgg9(num_classes, in_channels, image_size, norm, _pan_settings(pan), _check_width(width))


_SHAPE_KEYS = ("num_classes", "in_channels", "image_size")
_HEAD_KEYS = ("head", "sphere_seed")   # every model's options: see edge_client/methods/sphere.py


def build_model(spec: Mapping[str, Any], models: Mapping[str, ModelFactory] = MODELS) -> nn.Module:
    """Build the model a spec describes from ``models`` (the backbones here; with the methods'
    networks through :func:`edge_client.registry.build_model`); raise ModelSpecError naming the problem."""
    if not isinstance(spec, Mapping) or "name" not in spec:
        raise ModelSpecError(f"a model spec is a mapping with a 'name', got {spec!r}")
    name = spec["name"]
    if name not in models:
        # The backbones are what a person picks (model.name); methods build their own networks around them.
        raise ModelSpecError(f"unknown model {name!r}; model.name is one of {', '.join(sorted(MODELS))}")
    for key in _SHAPE_KEYS:
        value = spec.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelSpecError(f"model spec needs a positive integer {key!r}, got {value!r}")
    options = {k: v for k, v in spec.items() if k not in ("name", *_HEAD_KEYS)}
    try:
        model = models[name](**options)
    except TypeError as exc:  # an option the factory does not take
        raise ModelSpecError(f"model {name!r} rejects its options {sorted(options)}: {exc}") from exc
    try:   # any model's last linear layer can become SphereFed's fixed sphere head
        return apply_head(model, **{k: spec[k] for k in _HEAD_KEYS if k in spec})
    except SphereError as exc:
        raise ModelSpecError(f"model {name!r}: {exc}") from None


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
