"""FedYogi (Reddi et al., 2021): Yogi on the server, over the clients' mean update."""

from __future__ import annotations


import torch

from coordinator.strategies.fedavg import OptimizerShorthand
from coordinator.strategies.server import AdaptiveStep
from methods.fedyogi.settings import FedYogiSection

__all__ = ["FedYogi", "FedYogiStep", "FedYogiSection"]


class FedYogiStep(AdaptiveStep):
    """FedYogi's server step, for any strategy that combines model deltas (``server.optimizer = "fedyogi"``)."""

    name = "fedyogi"
    section = "fedyogi"

    def second_moment(self, v: torch.Tensor, square: torch.Tensor) -> torch.Tensor:
        """Moves toward the squared update by a fixed fraction of it, in the direction of the gap:
        unlike Adam's average, a sudden large update cannot shrink the step of every coordinate at once."""
        return v - (1 - self.settings.beta2) * square * torch.sign(v - square)


class FedYogi(OptimizerShorthand):
    """``run.strategy = "fedyogi"``: FedAvg with FedYogi's server step."""

    name = "fedyogi"
    step = FedYogiStep
