"""Model registry: every party builds the same network from the same spec.

A model spec is a plain JSON-serializable dict (it travels inside each task), e.g.
``{"name": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 28}``.
The coordinator and every client call :func:`edge_client.registry.build_model` on it, so
the parameter names and shapes agree everywhere without ever sending code or pickles.

Backbones: ``mlp`` (``hidden`` widths), ``cnn`` and ``vgg9`` (``widths``: every hidden
layer's size, for a network whose layers were grown one by one). Each takes ``norm``
(``none``, ``bn`` or ``gn``) and ``width`` (a multiplier of every hidden layer's size,
default 1). A spec also names how the model's input is made from [0, 1] pixels,
``normalization`` (``{"mean": [...], "std": [...]}``, one number per input channel;
:mod:`storage.pixels`): the network does not depend on it, but every device normalizes its
own data as it says, and the exported model carries it. Specs written before it existed lack it.

Methods change these networks through model hooks (:class:`ModelHook`, each method's
``model.py``, listed in :mod:`edge_client.registry`): a hook owns some spec keys, may
change how a backbone makes its layers (:class:`LayerPlan`), change the built model, or
add networks that wrap backbones. This module builds the backbones and applies the hooks
it is given; it knows no method.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from edge_client.pooling import MaxPool2d
from storage.errors import FedgeError
from storage.pixels import DataError, Normalization

__all__ = ["ModelSpecError", "MODELS", "NORMS", "ImageClassifier", "LayerPlan", "ModelHook", "build_model",
           "register_model", "mlp", "cnn", "vgg9", "federated_names", "limit_exchange", "EXCHANGED", "state_shapes", "model_cost"]


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


class LayerPlan:
    """How a backbone makes each piece of its hidden units and its classifier, layer by layer.

    Weight layers are numbered in forward order from 1, the classifier last. The plain plan
    (no ``base``) makes the architecture as it is; a model hook's plan refines another one
    (``base``) and overrides only what it changes, so the plans of several hooks compose.
    """

    def __init__(self, base: LayerPlan | None = None) -> None:
        self.base = base

    def width(self, units: int, index: int) -> int:
        """Hidden layer ``index``'s width, given the architecture's ``units``."""
        return units if self.base is None else self.base.width(units, index)

    def conv(self, channels: int, width: int, index: int) -> nn.Module:
        """A 3x3 convolution from ``channels`` to ``width``."""
        return nn.Conv2d(channels, width, 3, padding=1) if self.base is None else self.base.conv(channels, width, index)

    def linear(self, features: int, width: int, index: int) -> nn.Module:
        return nn.Linear(features, width) if self.base is None else self.base.linear(features, width, index)

    def norm(self, kind: str, width: int, conv: bool, index: int) -> nn.Module | None:
        """The normalization after the layer (``kind``: the spec's ``norm``), or None."""
        return _norm(kind, width, conv) if self.base is None else self.base.norm(kind, width, conv, index)

    def activation(self, width: int, index: int) -> nn.Module:
        return nn.ReLU() if self.base is None else self.base.activation(width, index)

    def classifier(self, features: int, num_classes: int) -> nn.Module:
        """The last layer, which every model names ``classifier``."""
        return nn.Linear(features, num_classes) if self.base is None else self.base.classifier(features, num_classes)


@dataclass(frozen=True)
class ModelHook:
    """What a method changes in the networks every party builds from a spec (its ``model.py``).

    ``options`` are the spec keys it owns: a backbone never sees them, and the hook is applied
    to a backbone whose spec carries any of them, with those it carries. ``plan(base, options,
    num_classes, layers)`` returns how the backbone makes its layers (``base`` refined: the hooks
    before it, then the plain plan; ``layers`` counts its weight layers, the classifier included);
    ``finish(model, options)`` returns the built model changed. Either raises ModelSpecError
    saying which option to change. ``networks`` are model names the method adds: a factory gets
    the spec's options and ``build``, which builds a backbone spec with every hook applied.
    ``original(spec)`` is the spec of the model before the hook adapted it, for stating both sizes.
    """

    options: tuple[str, ...] = ()
    plan: Callable[[LayerPlan, Mapping[str, Any], int, int], LayerPlan] | None = None
    finish: Callable[[nn.Module, Mapping[str, Any]], nn.Module] | None = None
    networks: Mapping[str, ModelFactory] = field(default_factory=dict)
    original: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None


PlanFactory = Callable[[int], LayerPlan]   # weight layers of the backbone -> its plan


class ImageClassifier(nn.Module):
    """``features`` (the extractor) followed by ``classifier`` (the last linear layer).

    Every backbone has this shape: methods that replace, split or extend one of the two
    parts address them by these names.
    """

    def __init__(self, features: nn.Sequential, classifier: nn.Module) -> None:
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
    """Builds a model's hidden units and classifier in forward order as its plan says, numbering the
    weight layers (1, 2, ...; the classifier last)."""

    def __init__(self, norm: str, plan: LayerPlan, widths: tuple[int, ...] | None) -> None:
        self.norm, self.plan, self.widths = norm, plan, widths
        self.index = 0

    def _unit(self, layer: nn.Module, width: int, norm: str, conv: bool) -> list[nn.Module]:
        """One hidden unit: layer (+ bias), normalization, then the activation; an activation that
        encodes positions must come after the normalization."""
        normalization = self.plan.norm(norm, width, conv, self.index)
        activation = self.plan.activation(width, self.index)
        return [m for m in (layer, normalization, activation) if m is not None]

    def _next(self, units: int) -> int:
        """The next layer's width; explicit ``widths`` replace the architecture's sizes."""
        self.index += 1
        if self.widths is not None:
            units = self.widths[self.index - 1]
        return self.plan.width(units, self.index)

    def conv(self, channels: int, units: int) -> tuple[list[nn.Module], int]:
        """A 3x3 convolution unit and its output width."""
        width = self._next(units)
        return self._unit(self.plan.conv(channels, width, self.index), width, self.norm, True), width

    def linear(self, features: int, units: int, norm: str) -> tuple[list[nn.Module], int]:
        """A fully connected unit and its output width."""
        width = self._next(units)
        return self._unit(self.plan.linear(features, width, self.index), width, norm, False), width

    def classifier(self, features: int, num_classes: int) -> nn.Module:
        self.index += 1
        return self.plan.classifier(features, num_classes)


def mlp(num_classes: int, in_channels: int, image_size: int, hidden: tuple[int, ...] = (1024, 1024, 1024),
        norm: str = "none", scale: float = 1.0, plan: LayerPlan | None = None) -> ImageClassifier:
    """Fully connected network; the default 3 x 1024 hidden widths are the position-aware neurons paper's."""
    build = _Layers(norm, plan or LayerPlan(), None)
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_channels * image_size * image_size
    for h in (_scaled(h, scale) for h in hidden):
        unit, width = build.linear(width, h, norm)
        layers += unit
    return ImageClassifier(nn.Sequential(*layers), build.classifier(width, num_classes))


def cnn(num_classes: int, in_channels: int, image_size: int, norm: str = "gn", scale: float = 1.0,
        plan: LayerPlan | None = None, widths: tuple[int, ...] | None = None) -> ImageClassifier:
    """The small two-block ConvNet (421,834 parameters on 28x28x1, 10 classes, GroupNorm).

    ``scale`` multiplies its 32 and 64 channels and its 128 features; ``widths`` gives all three.
    """
    if image_size % 4:
        raise ModelSpecError(f"cnn needs an image size divisible by 4, got {image_size}")
    build = _Layers(norm, plan or LayerPlan(), widths)
    conv1, c1 = build.conv(in_channels, _scaled(32, scale))
    conv2, c2 = build.conv(c1, _scaled(64, scale))
    fc, d = build.linear(c2 * (image_size // 4) ** 2, _scaled(128, scale), "none")
    features = nn.Sequential(*conv1, MaxPool2d(2), *conv2, MaxPool2d(2), nn.Flatten(), *fc)
    return ImageClassifier(features, build.classifier(d, num_classes))


VGG9_LAYOUT = (32, 64, "M", 128, 128, "M", 256, 256, "M")
VGG9_FC = (512, 512)


def vgg9(num_classes: int, in_channels: int, image_size: int, norm: str = "none", scale: float = 1.0,
         plan: LayerPlan | None = None, widths: tuple[int, ...] | None = None) -> ImageClassifier:
    """VGG-9 as in the matched-averaging, group-aligned and position-aware neuron papers: six 3x3
    convolutions, three max-pools, FC 512, 512.

    The flatten size follows the input (256 x 3 x 3 on 28x28, 256 x 4 x 4 on 32x32).
    Normalization, when asked for, follows the convolutions only. ``widths`` gives all
    eight hidden sizes (a method that grows the model layer by layer sets them).
    """
    if image_size < 8:
        raise ModelSpecError(f"vgg9 halves the image three times and needs an image size of at least 8, "
                             f"got {image_size}; use cnn or mlp for smaller inputs")
    build = _Layers(norm, plan or LayerPlan(), widths)
    layers: list[nn.Module] = []
    channels, size = in_channels, image_size
    for item in VGG9_LAYOUT:
        if item == "M":
            layers.append(MaxPool2d(2))
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


def _plain(layers: int) -> LayerPlan:   # a backbone built without hooks
    return LayerPlan()


@register_model("mlp")
def _mlp(num_classes: int, in_channels: int, image_size: int,
         hidden: list[int] | tuple[int, ...] = (1024, 1024, 1024), norm: str = "none", width: float = 1.0,
         plan: PlanFactory = _plain) -> nn.Module:
    if not hidden or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in hidden):
        raise ModelSpecError(f"mlp hidden widths must be positive integers, got {hidden!r}")
    return mlp(num_classes, in_channels, image_size, tuple(hidden), norm, _check_width(width), plan(len(hidden) + 1))


@register_model("cnn")
def _cnn(num_classes: int, in_channels: int, image_size: int, norm: str = "gn", width: float = 1.0,
         widths: list[int] | None = None, plan: PlanFactory = _plain) -> nn.Module:
    return cnn(num_classes, in_channels, image_size, norm, _check_width(width), plan(4),
               _check_widths(widths, 3, "cnn"))


@register_model("vgg9")
def _vgg9(num_classes: int, in_channels: int, image_size: int, norm: str = "none", width: float = 1.0,
          widths: list[int] | None = None, plan: PlanFactory = _plain) -> nn.Module:
    hidden = sum(1 for item in VGG9_LAYOUT if item != "M") + len(VGG9_FC)
    return vgg9(num_classes, in_channels, image_size, norm, _check_width(width), plan(hidden + 1),
                _check_widths(widths, hidden, "vgg9"))


_SHAPE_KEYS = ("num_classes", "in_channels", "image_size")
_INPUT_KEYS = ("normalization",)       # how the input is made, not the network: see storage/pixels.py


def _check_spec(spec: Mapping[str, Any], names: Sequence[str]) -> None:
    """The keys every spec has, checked: raise ModelSpecError naming the problem."""
    if not isinstance(spec, Mapping) or "name" not in spec:
        raise ModelSpecError(f"a model spec is a mapping with a 'name', got {spec!r}")
    if spec["name"] not in names:
        # The backbones are what a person picks (model.name); methods build their own networks around them.
        raise ModelSpecError(f"unknown model {spec['name']!r}; model.name is one of {', '.join(sorted(MODELS))}")
    for key in _SHAPE_KEYS:
        value = spec.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelSpecError(f"model spec needs a positive integer {key!r}, got {value!r}")
    if spec.get("normalization") is not None:
        try:
            Normalization.from_spec(spec["normalization"], spec["in_channels"])
        except DataError as exc:
            raise ModelSpecError(str(exc)) from None


def _call(name: str, factory: ModelFactory, options: Mapping[str, Any]) -> nn.Module:
    try:
        return factory(**options)
    except TypeError as exc:  # an option the factory does not take
        shown = sorted(k for k in options if k not in ("plan", "build"))
        raise ModelSpecError(f"model {name!r} rejects its options {shown}: {exc}") from exc


def build_model(spec: Mapping[str, Any], hooks: Sequence[ModelHook] = ()) -> nn.Module:
    """Build the model a spec describes, a backbone or a network a hook adds, with ``hooks`` applied
    (:func:`edge_client.registry.build_model` gives every registered one); raise ModelSpecError naming
    the problem."""
    networks = {name: factory for hook in hooks for name, factory in hook.networks.items()}
    _check_spec(spec, [*MODELS, *networks])
    name = spec["name"]
    options = {k: v for k, v in spec.items() if k not in ("name", *_INPUT_KEYS)}
    if name in networks:   # it builds its backbones, which take the hooks' options, through ``build``
        return _call(name, networks[name], {**options, "build": lambda s: build_model(s, hooks)})
    active = [(hook, {k: options.pop(k) for k in hook.options if k in options}) for hook in hooks]
    active = [(hook, own) for hook, own in active if own]

    def plan(layers: int) -> LayerPlan:
        out = LayerPlan()
        for hook, own in active:
            if hook.plan is not None:
                out = hook.plan(out, own, int(spec["num_classes"]), layers)
        return out

    model = _call(name, MODELS[name], {**options, "plan": plan})
    for hook, own in active:
        if hook.finish is not None:
            model = hook.finish(model, own)
    return model


# The attribute of a network that limits what is exchanged to some of its state (fine-tuning: the rest is frozen).
EXCHANGED = "_fedge_exchanged"


def federated_names(model: nn.Module) -> list[str]:
    """Names of the floating-point state that federated training exchanges.

    Non-persistent buffers (fixed encodings rebuilt on every party) are not in the
    state dict, and integer counters such as BatchNorm's ``num_batches_tracked``
    are local bookkeeping, so neither is ever sent. A network whose part is frozen
    (:func:`limit_exchange`) exchanges only the rest.
    """
    limit = getattr(model, EXCHANGED, None)
    return [k for k, v in model.state_dict().items() if v.is_floating_point() and (limit is None or k in limit)]


def limit_exchange(model: nn.Module, names: Iterable[str]) -> nn.Module:
    """``model`` with only ``names`` of its state exchanged, wherever a party asks :func:`federated_names`:
    every party builds the network the same way, so all agree on what travels."""
    setattr(model, EXCHANGED, frozenset(names))
    return model


def state_shapes(model: nn.Module, names: list[str] | None = None) -> dict[str, tuple[int, ...]]:
    """Expected shape of each exchanged tensor, used to validate received messages."""
    state = model.state_dict()
    return {k: tuple(state[k].shape) for k in (names if names is not None else federated_names(model))}


def model_cost(model: nn.Module, sample: torch.Tensor) -> dict[str, int]:
    """Trainable parameters and multiply-adds of one forward pass on ``sample`` (a batch of one).

    Multiply-adds count the connections each weight layer actually computes: a group
    convolution's ``in / groups`` inputs per output, a recurrent layer's weights once per time
    step, and for any other layer whose weight is not what it computes, what its own
    ``multiply_adds(output)`` says. What a method changes in a network's size is stated with
    these two numbers.
    """
    macs = 0
    convolutions = (nn.Conv1d, nn.Conv2d, nn.Conv3d)

    def count(module: nn.Module, _inputs: Any, output: Any) -> None:
        nonlocal macs
        own = getattr(module, "multiply_adds", None)
        if callable(own):
            macs += int(own(output))
        elif isinstance(module, convolutions):
            macs += output[0].numel() * module.weight[0].numel()
        elif isinstance(module, nn.Linear):
            macs += module.weight.numel()
        elif isinstance(module, nn.RNNBase) and isinstance(output[0], torch.Tensor):   # (outputs, state)
            steps = output[0].shape[1 if module.batch_first else 0] if output[0].dim() == 3 else output[0].shape[0]
            macs += steps * sum(w.numel() for name, w in module.named_parameters() if name.startswith("weight_"))

    hooks = [m.register_forward_hook(count) for m in model.modules()
             if isinstance(m, (*convolutions, nn.Linear, nn.RNNBase)) or callable(getattr(m, "multiply_adds", None))]
    try:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            model(sample)
        model.train(was_training)
    finally:
        for hook in hooks:
            hook.remove()
    return {"parameters": sum(p.numel() for p in model.parameters() if p.requires_grad), "multiply_adds": macs}
