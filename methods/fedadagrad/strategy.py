"""FedAdagrad (Reddi et al., 2021): Adagrad on the server, over the clients' mean update."""

from __future__ import annotations


import torch

from coordinator.strategies.fedavg import OptimizerShorthand
from coordinator.strategies.server import AdaptiveStep
from methods.fedadagrad.settings import FedAdagradSection

__all__ = ["FedAdagrad", "FedAdagradStep", "FedAdagradSection"]


class FedAdagradStep(AdaptiveStep):
    """FedAdagrad's server step, for any strategy that combines model deltas (``server.optimizer = "fedadagrad"``)."""

    name = "fedadagrad"
    section = "fedadagrad"

    def second_moment(self, v: torch.Tensor, square: torch.Tensor) -> torch.Tensor:
        """Every squared update summed: a coordinate's step only shrinks."""
        return v + square


class FedAdagrad(OptimizerShorthand):
    """``run.strategy = "fedadagrad"``: FedAvg with FedAdagrad's server step."""

    name = "fedadagrad"
    step = FedAdagradStep
