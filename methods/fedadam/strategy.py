"""FedAdam (Reddi et al., 2021): Adam on the server, over the clients' mean update."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from coordinator.strategies.fedavg import OptimizerShorthand
from coordinator.strategies.server import AdaptiveSection, AdaptiveStep

__all__ = ["FedAdam", "FedAdamStep", "FedAdamSection"]


@dataclass(frozen=True)
class FedAdamSection(AdaptiveSection):
    """``[fedadam]``: the server's Adam step (server.optimizer = "fedadam", or run.strategy = "fedadam")."""

    section: ClassVar[str] = "fedadam"


class FedAdamStep(AdaptiveStep):
    """FedAdam's server step, for any strategy that combines model deltas (``server.optimizer = "fedadam"``)."""

    name = "fedadam"
    section = "fedadam"

    def second_moment(self, v: torch.Tensor, square: torch.Tensor) -> torch.Tensor:
        """An exponential average of the squared update."""
        b = self.settings.beta2
        return b * v + (1 - b) * square


class FedAdam(OptimizerShorthand):
    """``run.strategy = "fedadam"``: FedAvg with FedAdam's server step."""

    name = "fedadam"
    step = FedAdamStep
