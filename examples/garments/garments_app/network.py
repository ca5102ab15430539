"""A MobileNetV3-Small-class network (Howard et al. 2019, "Searching for MobileNetV3"), written out in torch.

The example defines its own because torchvision does not import beside the CPU build of torch this example
is tested with (``RuntimeError: operator torchvision::nms does not exist``: the registry's torchvision wheels
are CUDA builds). The module names follow torchvision's ``mobilenet_v3_small`` (``features.N.block.M...``,
``classifier.N``), and so do the layer sizes and initialization (1,522,981 parameters with five classes, as
torchvision's), so that ``torchvision.models.mobilenet_v3_small(num_classes=..., norm_layer=...)`` can stand in
for :func:`mobilenet_v3_small` where torchvision works, with the same ``trainable`` patterns and the same
state-dict names; ``norm_layer`` as :data:`_BN_MOMENTUM` says.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["MobileNetV3", "mobilenet_v3_small"]

# torchvision's eps; a momentum of 0.1 (PyTorch's default), not torchvision's 0.01: that suits ImageNet's long
# training, but after the few hundred steps of a short pretraining or a few federated rounds the running statistics
# are still mostly their initial values, and the network in eval mode scored chance (0.196 on five classes, measured)
# while it trained well. With torchvision: norm_layer=functools.partial(nn.BatchNorm2d, eps=0.001, momentum=0.1).
_BN_EPS, _BN_MOMENTUM = 0.001, 0.1


def _divisible(value: float, divisor: int = 8) -> int:
    """``value`` rounded to a multiple of ``divisor``, never more than 10 % below it (the paper's rule)."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


class ConvNormActivation(nn.Sequential):
    """Convolution, batch normalization and (unless ``activation`` is None) an activation: ``N.0``, ``N.1``, ``N.2``."""

    def __init__(self, inputs: int, outputs: int, kernel: int = 3, stride: int = 1, groups: int = 1,
                 activation: Callable[..., nn.Module] | None = nn.Hardswish) -> None:
        layers: list[nn.Module] = [
            nn.Conv2d(inputs, outputs, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(outputs, eps=_BN_EPS, momentum=_BN_MOMENTUM)]
        if activation is not None:
            layers.append(activation(inplace=True))
        super().__init__(*layers)


class SqueezeExcitation(nn.Module):
    """Channel attention: global average, a bottleneck (``fc1``, ReLU, ``fc2``), a hard sigmoid scaling each channel."""

    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.fc1 = nn.Conv2d(channels, squeezed, 1)
        self.fc2 = nn.Conv2d(squeezed, channels, 1)
        self.activation = nn.ReLU()
        self.scale_activation = nn.Hardsigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = F.adaptive_avg_pool2d(x, 1)
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(scale))))
        return scale * x


@dataclass(frozen=True)
class Bneck:
    """One inverted-residual block: input, kernel, expanded and output channels, squeeze-excitation, hard-swish, stride."""

    inputs: int
    kernel: int
    expanded: int
    outputs: int
    se: bool
    hardswish: bool
    stride: int

    def scaled(self, width: float) -> Bneck:
        return Bneck(_divisible(self.inputs * width), self.kernel, _divisible(self.expanded * width),
                     _divisible(self.outputs * width), self.se, self.hardswish, self.stride)


class InvertedResidual(nn.Module):
    """Expand (1x1), depthwise (kxk), optionally squeeze-excite, project (1x1, linear); a residual when shapes allow."""

    def __init__(self, c: Bneck) -> None:
        super().__init__()
        self.use_res_connect = c.stride == 1 and c.inputs == c.outputs
        act = nn.Hardswish if c.hardswish else nn.ReLU
        layers: list[nn.Module] = []
        if c.expanded != c.inputs:
            layers.append(ConvNormActivation(c.inputs, c.expanded, 1, activation=act))
        layers.append(ConvNormActivation(c.expanded, c.expanded, c.kernel, c.stride, groups=c.expanded, activation=act))
        if c.se:
            layers.append(SqueezeExcitation(c.expanded, _divisible(c.expanded // 4)))
        layers.append(ConvNormActivation(c.expanded, c.outputs, 1, activation=None))
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return y + x if self.use_res_connect else y


# MobileNetV3-Small's blocks (Table 2 of the paper; torchvision's _mobilenet_v3_conf("mobilenet_v3_small"))
SMALL: tuple[Bneck, ...] = (
    Bneck(16, 3, 16, 16, True, False, 2),
    Bneck(16, 3, 72, 24, False, False, 2),
    Bneck(24, 3, 88, 24, False, False, 1),
    Bneck(24, 5, 96, 40, True, True, 2),
    Bneck(40, 5, 240, 40, True, True, 1),
    Bneck(40, 5, 240, 40, True, True, 1),
    Bneck(40, 5, 120, 48, True, True, 1),
    Bneck(48, 5, 144, 48, True, True, 1),
    Bneck(48, 5, 288, 96, True, True, 2),
    Bneck(96, 5, 576, 96, True, True, 1),
    Bneck(96, 5, 576, 96, True, True, 1),
)


class MobileNetV3(nn.Module):
    """``features`` (stem, inverted residual blocks, a 1x1 convolution), global average pooling, ``classifier``
    (``Linear``, hard-swish, dropout, ``Linear``): the layout of torchvision's MobileNetV3."""

    def __init__(self, blocks: tuple[Bneck, ...], last_channel: int, num_classes: int, dropout: float = 0.2) -> None:
        super().__init__()
        layers: list[nn.Module] = [ConvNormActivation(3, blocks[0].inputs, 3, 2)]
        layers += [InvertedResidual(b) for b in blocks]
        last_conv = 6 * blocks[-1].outputs
        layers.append(ConvNormActivation(blocks[-1].outputs, last_conv, 1))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(last_conv, last_channel), nn.Hardswish(inplace=True),
                                        nn.Dropout(dropout, inplace=True), nn.Linear(last_channel, num_classes))
        for m in self.modules():   # torchvision's initialization
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def mobilenet_v3_small(num_classes: int, width: float = 1.0, dropout: float = 0.2) -> MobileNetV3:
    """MobileNetV3-Small with ``num_classes`` outputs; ``width`` scales every layer's channels (the paper's
    multiplier, ``width_mult`` in torchvision; it scales the classifier's 1024 hidden units too)."""
    if width <= 0:
        raise ValueError(f"width must be positive, got {width}")
    blocks = tuple(b.scaled(width) for b in SMALL)
    last_channel = _divisible(1024 * width)
    return MobileNetV3(blocks, last_channel, num_classes, dropout)
