"""What a strategy is: it plans each round's tasks and combines the results.

Strategies never touch the network. The round engine hands them the clients it
sampled and the decoded results; they hand back task plans and a new server state.
Aggregation is an associative reduce of (weighted sum, total weight), so results
can be folded in one at a time, in any grouping, with the same answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ServerState", "TaskPlan", "ClientResult", "WeightedSum", "Strategy", "AggregationError"]


class AggregationError(ValueError):
    """Results that cannot be combined (no weight, mismatched tensors)."""


@dataclass(frozen=True)
class ServerState:
    """Everything the coordinator needs to continue a run: saved in each checkpoint."""

    round: int
    params: dict[str, torch.Tensor]
    extra: dict[str, Any] = field(default_factory=dict)   # JSON-serializable strategy state


@dataclass(frozen=True)
class TaskPlan:
    """What one selected client is asked to do this round."""

    client_id: str
    objective: str
    hyper: dict[str, Any]
    down: dict[str, torch.Tensor]     # tensors sent to the client
    up: list[str]                     # parameter names the client must send back


@dataclass(frozen=True)
class ClientResult:
    client_id: str
    num_samples: int
    tensors: dict[str, torch.Tensor]
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WeightedSum:
    """A partial aggregate: sum of weight * tensor (float64) and the total weight."""

    sums: dict[str, torch.Tensor]
    weight: float

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor], weight: float) -> "WeightedSum":
        if not weight > 0:
            raise AggregationError(f"a result needs a positive weight, got {weight}")
        return cls({k: v.to(torch.float64) * weight for k, v in tensors.items()}, float(weight))

    def __add__(self, other: "WeightedSum") -> "WeightedSum":
        if self.sums.keys() != other.sums.keys():
            raise AggregationError("cannot add partial aggregates over different tensors")
        return WeightedSum({k: v + other.sums[k] for k, v in self.sums.items()}, self.weight + other.weight)

    def mean(self) -> dict[str, torch.Tensor]:
        return {k: (v / self.weight).to(torch.float32) for k, v in self.sums.items()}

    @staticmethod
    def reduce(parts: Iterable["WeightedSum"]) -> "WeightedSum":
        total: WeightedSum | None = None
        for part in parts:
            total = part if total is None else total + part
        if total is None:
            raise AggregationError("nothing to aggregate")
        return total


class Strategy:
    """Base class: FedAvg-shaped defaults that concrete strategies override in part."""

    name = "base"

    def initialize(self, params: dict[str, torch.Tensor]) -> ServerState:
        return ServerState(round=0, params=params)

    def configure_train(self, round: int, state: ServerState, clients: list[str]) -> list[TaskPlan]:
        raise NotImplementedError

    def aggregate_train(self, round: int, state: ServerState, results: list[ClientResult]) -> ServerState:
        raise NotImplementedError
