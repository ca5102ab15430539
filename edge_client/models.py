"""Model registry: every party builds the same network from the same spec.

A model spec is a plain JSON-serializable dict (it travels inside each task), e.g.
``{"name": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 28}``.
The coordinator and every client call :func:`build_model` on it, so the parameter
names and shapes agree everywhere without ever sending code or pickles.

Models: ``mlp`` (``hidden`` widths), ``cnn`` and ``vgg9`` (``widths``: every hidden
layer's size, for a network whose layers were grown one by one). Each takes ``norm``
(``none``, ``bn`` or ``gn``), ``width`` (a multiplier of every hidden layer's
size, default 1), Fed2's grouping (``fed2_groups``, ``fed2_from``, ``fed2_allocation``:
:mod:`edge_client.methods.fed2_model`) and the PAN options ``pan`` (``none``, ``add``, ``mul``),
``pan_period`` and ``pan_amplitude`` (see :mod:`edge_client.methods.pans`). Every model
also takes ``head``: ``linear`` (default) or ``sphere``, SphereFed's fixed classifier
on L2-normalized features, built from ``sphere_seed`` (see :mod:`edge_client.methods.sphere_head`).
A spec also names how the model's input is made from [0, 1] pixels, ``normalization``
(``{"mean": [...], "std": [...]}``, one number per input channel; :mod:`storage.pixels`):
the network does not depend on it, but every device normalizes its own data as it says,
and the exported model carries it. Specs written before it existed lack it.
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

from edge_client.methods.fed2_model import DecoupledClassifier, Fed2Error, Fed2Plan, GroupedLinear
from edge_client.methods.pans import PanError, PanSettings, PositionAwareReLU
from edge_client.methods.sphere_head import SphereError, apply_head
from storage.pixels import DataError, Normalization
from storage.errors import FedgeError

__all__ = [
    "ModelSpecError",
    "MODELS",
    "NORMS",
    "ImageClassifier",
    "build_model",
    "register_model",
    "mlp",
    "cnn",
    "vgg9",
    "federated_names",
    "state_shapes",
    "model_cost",
    "without_fed2",
]


class ModelSpecError(FedgeError, ValueError):
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


class _Layers:
    """Builds a model's hidden units and classifier in forward order, numbering the weight layers
    (1, 2, ...; the classifier last) so that Fed2 can group them from a given one."""

    def __init__(self, norm: str, pan: PanSettings, fed2: Fed2Plan | None, widths: tuple[int, ...] | None) -> None:
        self.norm, self.pan, self.fed2, self.widths = norm, pan, fed2, widths
        self.index = 0

    def _grouped(self, module: nn.Module | None) -> nn.Module | None:
        if module is not None and self.fed2 is not None and self.fed2.grouped(self.index):
            module.fed2_groups = self.fed2.groups   # read by edge_client.methods.fed2_model.row_groups
        return module

    def _norm(self, kind: str, width: int, conv: bool) -> nn.Module | None:
        if self.fed2 is not None and self.fed2.grouped(self.index) and kind != "none":
            return nn.GroupNorm(self.fed2.groups, width)   # normalization groups = Fed2's groups
        return _norm(kind, width, conv)

    def _unit(self, layer: nn.Module, width: int, norm: str, conv: bool) -> list[nn.Module]:
        """One hidden unit in the order PANs need: layer (+ bias), normalization, then the activation.

        With PANs on, the activation applies the position encoding first; it takes the
        ReLU's place, so parameter names do not depend on the PAN setting.
        """
        normalization = self._grouped(self._norm(norm, width, conv))
        activation = PositionAwareReLU(self.pan, width) if self.pan.enabled else nn.ReLU()
        return [m for m in (self._grouped(layer), normalization, activation) if m is not None]

    def _next(self, units: int) -> tuple[int, int]:
        """The next layer's (width, input groups); explicit ``widths`` replace the architecture's sizes."""
        self.index += 1
        if self.widths is not None:
            units = self.widths[self.index - 1]
        if self.fed2 is None:
            return units, 1
        return self.fed2.width(units, self.index), self.fed2.input_groups(self.index)

    def conv(self, channels: int, units: int) -> tuple[list[nn.Module], int]:
        """A 3x3 convolution unit and its output width."""
        width, groups = self._next(units)
        return self._unit(nn.Conv2d(channels, width, 3, padding=1, groups=groups), width, self.norm, True), width

    def linear(self, features: int, units: int, norm: str) -> tuple[list[nn.Module], int]:
        """A fully connected unit (block-diagonal where grouped) and its output width."""
        width, groups = self._next(units)
        layer = GroupedLinear(features, width, groups) if groups > 1 else nn.Linear(features, width)
        return self._unit(layer, width, norm, False), width

    def classifier(self, features: int, num_classes: int) -> nn.Linear:
        """The last layer; with Fed2, each group connected only to its classes' logits."""
        self.index += 1
        if self.fed2 is None:
            return nn.Linear(features, num_classes)
        return DecoupledClassifier(features, self.fed2.allocation, self.fed2.groups)


def mlp(num_classes: int, in_channels: int, image_size: int, hidden: tuple[int, ...] = (1024, 1024, 1024),
        norm: str = "none", pan: PanSettings = PanSettings(), scale: float = 1.0,
        fed2: Fed2Plan | None = None) -> ImageClassifier:
    """Fully connected network; the default 3 x 1024 hidden widths are the PANs paper's MLP."""
    build = _Layers(norm, pan, fed2, None)
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_channels * image_size * image_size
    for h in (_scaled(h, scale) for h in hidden):
        unit, width = build.linear(width, h, norm)
        layers += unit
    return ImageClassifier(nn.Sequential(*layers), build.classifier(width, num_classes))


def cnn(num_classes: int, in_channels: int, image_size: int, norm: str = "gn",
        pan: PanSettings = PanSettings(), scale: float = 1.0, fed2: Fed2Plan | None = None,
        widths: tuple[int, ...] | None = None) -> ImageClassifier:
    """The small two-block ConvNet (421,834 parameters on 28x28x1, 10 classes, GroupNorm).

    ``scale`` multiplies its 32 and 64 channels and its 128 features; ``widths`` gives all three.
    """
    if image_size % 4:
        raise ModelSpecError(f"cnn needs an image size divisible by 4, got {image_size}")
    build = _Layers(norm, pan, fed2, widths)
    conv1, c1 = build.conv(in_channels, _scaled(32, scale))
    conv2, c2 = build.conv(c1, _scaled(64, scale))
    fc, d = build.linear(c2 * (image_size // 4) ** 2, _scaled(128, scale), "none")
    features = nn.Sequential(*conv1, nn.MaxPool2d(2), *conv2, nn.MaxPool2d(2), nn.Flatten(), *fc)
    return ImageClassifier(features, build.classifier(d, num_classes))


VGG9_LAYOUT = (32, 64, "M", 128, 128, "M", 256, 256, "M")
VGG9_FC = (512, 512)


def vgg9(num_classes: int, in_channels: int, image_size: int, norm: str = "none",
         pan: PanSettings = PanSettings(), scale: float = 1.0, fed2: Fed2Plan | None = None,
         widths: tuple[int, ...] | None = None) -> ImageClassifier:
    """VGG-9 as in FedMA, Fed2 and PANs: six 3x3 convolutions, three max-pools, FC 512, 512.

    The flatten size follows the input (256 x 3 x 3 on 28x28, 256 x 4 x 4 on 32x32).
    Normalization, when asked for, follows the convolutions only. ``widths`` gives all
    eight hidden sizes (FedMA's matched model grows them one by one).
    """
    if image_size < 8:
        raise ModelSpecError(f"vgg9 halves the image three times and needs an image size of at least 8, "
                             f"got {image_size}; use cnn or mlp for smaller inputs")
    build = _Layers(norm, pan, fed2, widths)
    layers: list[nn.Module] = []
    channels, size = in_channels, image_size
    for item in VGG9_LAYOUT:
        if item == "M":
            layers.append(nn.MaxPool2d(2))
            size //= 2
        else:
            unit, channels = build.conv(channels, _scaled(int(item), scale))
            layers += unit
    layers.append(nn.Flatten())
    width = channels * size * size
    for h in (_scaled(h, scale) for h in VGG9_FC):
        unit, width = build.linear(width, h, "none")
        layers += unit
    return ImageClassifier(nn.Sequential(*layers), build.classifier(width, num_classes))


def _check_widths(widths: Any, count: int, model: str) -> tuple[int, ...] | None:
    """Explicit hidden widths (a spec's ``widths``): one positive integer per hidden weight layer."""
    if widths is None:
        return None
    if not isinstance(widths, (list, tuple)) or len(widths) != count or any(
            isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths):
        raise ModelSpecError(f"{model} widths lists the size of each of its {count} hidden weight layers as "
                             f"positive integers, got {widths!r}")
    return tuple(widths)


def _fed2_plan(num_classes: int, layers: int, options: Mapping[str, Any]) -> Fed2Plan | None:
    try:
        return Fed2Plan.from_options(num_classes, layers, **options)
    except Fed2Error as exc:
        raise ModelSpecError(str(exc)) from None


def _split(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A spec's remaining options as (PAN options, Fed2 options)."""
    fed2 = {k: v for k, v in options.items() if k.startswith("fed2_")}
    return {k: v for k, v in options.items() if k not in fed2}, fed2


@register_model("mlp")
def _mlp(num_classes: int, in_channels: int, image_size: int,
         hidden: list[int] | tuple[int, ...] = (1024, 1024, 1024), norm: str = "none", width: float = 1.0,
         **options: Any) -> nn.Module:
    if not hidden or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in hidden):
        raise ModelSpecError(f"mlp hidden widths must be positive integers, got {hidden!r}")
    pan, fed2 = _split(options)
    return mlp(num_classes, in_channels, image_size, tuple(hidden), norm, _pan_settings(pan), _check_width(width),
               _fed2_plan(num_classes, len(hidden) + 1, fed2))


@register_model("cnn")
def _cnn(num_classes: int, in_channels: int, image_size: int, norm: str = "gn", width: float = 1.0,
         widths: list[int] | None = None, **options: Any) -> nn.Module:
    pan, fed2 = _split(options)
    return cnn(num_classes, in_channels, image_size, norm, _pan_settings(pan), _check_width(width),
               _fed2_plan(num_classes, 4, fed2), _check_widths(widths, 3, "cnn"))


@register_model("vgg9")
def _vgg9(num_classes: int, in_channels: int, image_size: int, norm: str = "none", width: float = 1.0,
          widths: list[int] | None = None, **options: Any) -> nn.Module:
    pan, fed2 = _split(options)
    hidden = sum(1 for item in VGG9_LAYOUT if item != "M") + len(VGG9_FC)
    return vgg9(num_classes, in_channels, image_size, norm, _pan_settings(pan), _check_width(width),
                _fed2_plan(num_classes, hidden + 1, fed2), _check_widths(widths, hidden, "vgg9"))


_SHAPE_KEYS = ("num_classes", "in_channels", "image_size")
_HEAD_KEYS = ("head", "sphere_seed")   # every model's options: see edge_client/methods/sphere.py
_INPUT_KEYS = ("normalization",)       # how the input is made, not the network: see storage/pixels.py


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
    if spec.get("normalization") is not None:
        try:
            Normalization.from_spec(spec["normalization"], spec["in_channels"])
        except DataError as exc:
            raise ModelSpecError(str(exc)) from None
    options = {k: v for k, v in spec.items() if k not in ("name", *_HEAD_KEYS, *_INPUT_KEYS)}
    try:
        model = models[name](**options)
    except TypeError as exc:  # an option the factory does not take
        raise ModelSpecError(f"model {name!r} rejects its options {sorted(options)}: {exc}") from exc
    if isinstance(getattr(model, "classifier", None), DecoupledClassifier) and spec.get("head", "linear") != "linear":
        raise ModelSpecError(f"model {name!r}: Fed2's decoupled classifier (fed2_groups) and head = "
                             f"{spec['head']!r} both replace the last layer; remove one of them")
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


def model_cost(model: nn.Module, in_channels: int, image_size: int) -> dict[str, int]:
    """Trainable parameters and multiply-adds of one forward pass on one image.

    Multiply-adds count the connections each weight layer actually computes: a group
    convolution's ``in / groups`` inputs per output, a grouped linear layer's blocks,
    and only the unmasked weights of Fed2's decoupled classifier. What a method changes
    in a network's size (Fed2's groups) is stated with these two numbers.
    """
    macs = 0

    def count(module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        nonlocal macs
        if isinstance(module, nn.Conv2d):
            macs += output[0].numel() * module.weight[0].numel()
        elif isinstance(module, DecoupledClassifier):
            macs += int(module.mask.sum())
        elif isinstance(module, (nn.Linear, GroupedLinear)):
            macs += module.weight.numel()

    hooks = [m.register_forward_hook(count) for m in model.modules()
             if isinstance(m, (nn.Conv2d, nn.Linear, GroupedLinear))]
    try:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            model(torch.zeros(1, in_channels, image_size, image_size))
        model.train(was_training)
    finally:
        for hook in hooks:
            hook.remove()
    return {"parameters": sum(p.numel() for p in model.parameters() if p.requires_grad), "multiply_adds": macs}


def without_fed2(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The spec of the original model a Fed2 spec was adapted from."""
    return {k: v for k, v in spec.items() if not k.startswith("fed2_")}
