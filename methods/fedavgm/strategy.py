"""FedAvgM (Hsu et al., "Measuring the Effects of Non-Identical Data Distribution", 2019):
FedAvg with momentum on the server, over the clients' mean update."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from coordinator.strategies.fedavg import OptimizerShorthand
from coordinator.strategies.server import ServerOptimizer, moment
from methods.fedavgm.settings import FedAvgMSection
from storage.state import ServerState

if TYPE_CHECKING:
    pass

__all__ = ["FedAvgM", "FedAvgMStep", "FedAvgMSection"]


class FedAvgMStep(ServerOptimizer):
    """v = momentum v + d;  x = x + lr v, with d the combined update and v kept in the state's buffers."""

    name = "fedavgm"
    section = "fedavgm"

    def __init__(self, settings: FedAvgMSection) -> None:
        self.settings = settings

    def step(self, round: int, state: ServerState, update: dict[str, torch.Tensor]) -> ServerState:
        s = self.settings
        params, buffers = dict(state.params), dict(state.buffers)
        for name, d in update.items():
            v = s.momentum * moment(state, f"momentum/{name}", d) + d
            params[name] = (state.params[name].to(torch.float64) + s.lr * v).to(torch.float32)
            buffers[f"momentum/{name}"] = v
        return dataclasses.replace(state, round=round, params=params, buffers=buffers)


class FedAvgM(OptimizerShorthand):
    """``run.strategy = "fedavgm"``: FedAvg with server momentum."""

    name = "fedavgm"
    step = FedAvgMStep
