"""Position-Aware Neurons (PANs): a fixed encoding of each hidden neuron's position.

Hidden neurons of a layer are interchangeable, so clients trained from the same
start can drift into different orderings and averaging then blurs them. A PAN
ties neuron ``j`` of ``J`` to its position with a fixed periodic encoding applied
to the pre-activation (after the bias and after normalization, before the
activation), which breaks that permutation symmetry:

- additive: ``z_j + A * sin(2 * pi * T * j / J)``
- multiplicative: ``z_j * (1 + A * sin(2 * pi * T * j / J))``

The encoding is a function of (mode, T, A, J) only, so every party rebuilds it
identically. It lives in a non-persistent buffer: it is never trained, never in
the state dict, and therefore never in a message.

Any strategy trains with PANs: the model hook :data:`HOOK` reads a spec's ``pan``
(``none``, ``add``, ``mul``), ``pan_period`` and ``pan_amplitude`` and gives every hidden
unit of a backbone a :class:`PositionAwareReLU` in its ReLU's place.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from edge_client.models import LayerPlan, ModelHook, ModelSpecError

__all__ = ["PAN_MODES", "DEFAULT_AMPLITUDE", "PanError", "PanSettings", "PositionAwareReLU", "pan_encoding", "HOOK"]

PAN_MODES = ("none", "add", "mul")
DEFAULT_AMPLITUDE = {"add": 0.05, "mul": 0.1}   # the PANs paper's usual choices


class PanError(ModelSpecError):
    """Invalid PAN options; the message names the valid ones."""


@dataclass(frozen=True)
class PanSettings:
    """What a model spec says about PANs: ``pan``, ``pan_period`` and ``pan_amplitude``."""

    mode: str = "none"
    period: float = 1.0
    amplitude: float = 0.0

    @classmethod
    def from_options(cls, pan: str = "none", pan_period: float = 1.0,
                     pan_amplitude: float | None = None) -> "PanSettings":
        """Validate the spec's options; the amplitude defaults per mode (0.05 add, 0.1 mul)."""
        if pan not in PAN_MODES:
            raise PanError(f"pan must be one of {', '.join(PAN_MODES)}, got {pan!r}")
        for key, value in (("pan_period", pan_period), ("pan_amplitude", pan_amplitude)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0):
                raise PanError(f"{key} must be a finite number >= 0, got {value!r}")
        amplitude = DEFAULT_AMPLITUDE.get(pan, 0.0) if pan_amplitude is None else float(pan_amplitude)
        return cls(pan, float(pan_period), amplitude if pan != "none" else 0.0)

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


def pan_encoding(mode: str, period: float, amplitude: float, num_neurons: int) -> torch.Tensor:
    """The encoding vector ``e`` of length ``num_neurons`` (float32) for one layer."""
    j = torch.arange(num_neurons, dtype=torch.float64)
    wave = amplitude * torch.sin(2 * math.pi * period * j / num_neurons)
    if mode == "add":
        return wave.to(torch.float32)
    if mode == "mul":
        return (1.0 + wave).to(torch.float32)
    raise PanError(f"no encoding for pan mode {mode!r}; use add or mul")


class PositionAwareReLU(nn.ReLU):
    """ReLU of the position-encoded pre-activation: ``relu(z + e)`` or ``relu(z * e)``.

    It takes the place of a hidden layer's ReLU, and is one (a subclass), so a model's
    parameter names are the same with PANs off, additive or multiplicative, and code that
    finds a network's activations finds these too. ``z`` is ``[N, J]`` or
    ``[N, J, H, W]`` (the encoding broadcasts over space). The encoding is a
    non-persistent buffer, so ``state_dict()`` (and with it every upload, download
    and checkpoint) never holds it.
    """

    encoding: torch.Tensor

    def __init__(self, settings: PanSettings, num_neurons: int) -> None:
        super().__init__()
        if not settings.enabled:
            raise PanError("PositionAwareReLU needs pan = add or mul; use a plain ReLU for none")
        self.mode = settings.mode
        self.period = settings.period
        self.amplitude = settings.amplitude
        self.register_buffer("encoding", pan_encoding(self.mode, self.period, self.amplitude, num_neurons),
                             persistent=False)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        e = self.encoding.view(1, -1, *([1] * (z.dim() - 2)))   # [C] -> [1, C, 1, 1] for convolutions
        return torch.relu(z + e if self.mode == "add" else z * e)

    def extra_repr(self) -> str:
        return f"{self.mode}, T={self.period}, A={self.amplitude}, J={self.encoding.numel()}"


class _PanPlan(LayerPlan):
    """A backbone whose hidden units end in position-aware ReLUs."""

    def __init__(self, base: LayerPlan, settings: PanSettings) -> None:
        super().__init__(base)
        self.settings = settings

    def activation(self, width: int, index: int) -> nn.Module:
        return PositionAwareReLU(self.settings, width)


def _plan(base: LayerPlan, options: Mapping[str, Any], num_classes: int, layers: int) -> LayerPlan:
    settings = PanSettings.from_options(**options)
    return _PanPlan(base, settings) if settings.enabled else base


HOOK = ModelHook(options=("pan", "pan_period", "pan_amplitude"), plan=_plan)
