"""The config sections of the strategies in this package and of the server optimizers, apart from their code
(which imports torch), so that a configuration is read and checked before torch loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from coordinator.config import RunConfig

__all__ = ["FedProxSection", "AdaptiveSection"]


@dataclass(frozen=True)
class FedProxSection:
    """``[fedprox]``: the proximal term of FedProx (run.strategy = "fedprox")."""

    mu: float = 0.01        # the proximal weight: (mu/2)||w - w_global||^2 added to each device's loss, with
                            # run.strategy = "fedprox"

    def checks(self, config: RunConfig) -> list[tuple[bool, str]]:
        return [(self.mu >= 0, "fedprox.mu must be >= 0")]


@dataclass(frozen=True)
class AdaptiveSection:
    """A section of an adaptive server optimizer: its step and moment settings.

    ``tau`` keeps the step bounded where the second moment is tiny: Reddi et al. found 1e-3 a
    good choice across their tasks (smaller values make the step erratic early on).
    """

    lr: float = 0.01        # the server learning rate (eta)
    beta1: float = 0.9      # first-moment decay (0: no momentum)
    beta2: float = 0.99     # second-moment decay (of the steps that keep an average of the squared update)
    tau: float = 1e-3       # adaptivity: added to the root of the second moment
    section: ClassVar[str] = "adaptive"

    def checks(self, config: RunConfig) -> list[tuple[bool, str]]:
        s = self.section
        return [(self.lr > 0, f"{s}.lr (the server learning rate) must be > 0, got {self.lr}"),
                (0 <= self.beta1 < 1, f"{s}.beta1 must be in [0, 1), got {self.beta1}"),
                (0 < self.beta2 < 1, f"{s}.beta2 must be in (0, 1), got {self.beta2}"),
                (self.tau > 0, f"{s}.tau must be > 0 (1e-3 is the paper's choice), got {self.tau}")]
