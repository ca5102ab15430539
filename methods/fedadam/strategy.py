"""FedAdam (Reddi et al., 2021): Adam on the server, over the clients' mean update."""

from __future__ import annotations


import torch

from coordinator.strategies.fedavg import OptimizerShorthand
from coordinator.strategies.server import AdaptiveStep
from methods.fedadam.settings import FedAdamSection

__all__ = ["FedAdam", "FedAdamStep", "FedAdamSection"]


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
