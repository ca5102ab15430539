"""FedAvg (McMahan et al.) and FedProx (Li et al.): the baselines.

Both send the whole global model down and ask for the whole model back; FedProx
only adds the proximal weight ``mu`` to the clients' local objective.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from coordinator.aggregation import Aggregator
from coordinator.strategies.base import ClientResult, Strategy, TaskPlan, WeightedSum
from storage.state import ServerState

if TYPE_CHECKING:
    from coordinator.config import RunConfig

__all__ = ["FedAvg", "FedProx", "FedProxSection"]


@dataclass(frozen=True)
class FedProxSection:
    """``[fedprox]``: the proximal term of FedProx (run.strategy = "fedprox")."""

    mu: float = 0.01

    def checks(self, config: RunConfig) -> list[tuple[bool, str]]:
        return [(self.mu >= 0, "fedprox.mu must be >= 0")]


class FedAvg(Strategy):
    name = "fedavg"
    objective = "train"     # the device objective its training tasks run
    robust = True           # takes aggregate.rule and aggregate.norm_bound
    sync_only = ""          # runs in run.mode = "async": every result is one update for server_step
    aggregator = Aggregator()

    def __init__(self, train: dict[str, Any]) -> None:
        self.train = dict(train)

    @classmethod
    def from_config(cls, config: RunConfig) -> "FedAvg":
        return cls(dataclasses.asdict(config.train))

    def hyper(self) -> dict[str, Any]:
        return dict(self.train)

    def configure_train(self, round: int, state: ServerState, clients: list[str]) -> list[TaskPlan]:
        names = sorted(state.params)
        return [TaskPlan(client_id=c, objective=self.objective, hyper=self.hyper(), down=state.params, up=names)
                for c in clients]

    def streams(self, phase: str) -> bool:
        """The mean streams; so does a subclass whose ``aggregate_train`` takes the partial (one written
        without it gets every result, as before)."""
        return (phase == "train" and self.aggregator.streams
                and "partial" in inspect.signature(self.aggregate_train).parameters)

    def fold(self, phase: str, partial: WeightedSum | None, result: ClientResult) -> WeightedSum:
        part = WeightedSum.of(result.deltas, result.num_samples)
        return part if partial is None else partial + part

    def aggregate_train(self, round: int, state: ServerState, results: list[ClientResult],
                        partial: WeightedSum | None = None) -> ServerState:
        """The clients' updates combined by ``aggregate.rule`` (FedAvg's sample-weighted mean by default),
        in the order given (the engine sorts), or the mean of the updates the engine streamed in; then
        the server's step on it (:meth:`server_step`)."""
        if partial is not None:
            update = partial.mean(torch.float64)
        else:
            update = self.aggregator.combine([(r.deltas, r.num_samples) for r in results])
        return self.server_step(round, state, update)

    def server_step(self, round: int, state: ServerState, update: dict[str, torch.Tensor]) -> ServerState:
        """The state after the round's combined update (float64, by tensor name): FedAvg adds it.

        Server optimizers (momentum, adaptive steps) override this and keep what they carry between
        rounds in ``state.buffers``, which is checkpointed with the parameters.
        """
        params = {k: (state.params[k].to(torch.float64) + u).to(torch.float32) for k, u in update.items()}
        return dataclasses.replace(state, round=round, params={**state.params, **params})


class FedProx(FedAvg):
    name = "fedprox"

    def __init__(self, train: dict[str, Any], mu: float) -> None:
        super().__init__(train)
        if mu < 0:
            raise ValueError(f"fedprox.mu must be >= 0, got {mu}")
        self.mu = mu

    @classmethod
    def from_config(cls, config: RunConfig) -> "FedProx":
        return cls(dataclasses.asdict(config.train), config.fedprox.mu)

    def hyper(self) -> dict[str, Any]:
        return {**self.train, "mu": self.mu}
