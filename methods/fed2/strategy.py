"""Fed2 (Yu et al., ICLR 2021): feature paired averaging over a model whose upper layers are split into groups.

The clients train the Fed2 structure (:mod:`methods.fed2.model`: from
``model.fed2_from`` up, ``model.fed2_groups`` groups that never mix, group ``g``
feeding only the logits of its classes) with ``fed2_train``, which also reports
the label histogram they trained on. Aggregation:

- ``fed2.pairing = "all"`` (the default): every group by FedAvg over all the
  round's clients, sample-weighted. With the allocation fixed by the run, group
  ``g`` of every client is paired with the same classes, so this is the paper's
  feature paired averaging; the devices report nothing beyond FedAvg's.
- ``fed2.pairing = "holders"``: shared layers (below ``fed2_from``) by FedAvg;
  group ``g``'s rows weighted by each client's samples of ``g``'s classes, a client
  with none of them skipped (its copy only learned to push those classes down), a
  group no client holds keeping its previous value. The devices report their
  label histograms (``fed2_train``). Under label skew this diverges: a group's
  logits are then pushed down only by the classes that share a client with its own,
  so they grow on every other class's images (docs/fed2.md measures it).

The allocation of classes to groups is fixed by the run (``fed2.allocation``, or
class ``c`` to group ``c mod G``) and written into the model spec, so pairing is by
group index and every party builds the same decoupled classifier.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import TYPE_CHECKING, Any

import torch

from coordinator.errors import ConfigError
from coordinator.strategies.base import ClientResult, RowWeightedSum, TaskPlan, WeightedSum
from coordinator.strategies.fedavg import FedAvg
from edge_client.registry import build_aside
from methods.common import counts_of, histogram_problem
from methods.fed2.model import row_groups
from methods.fed2.settings import PAIRINGS, Fed2Section
from storage.state import ServerState

if TYPE_CHECKING:
    from coordinator.config import RunConfig

__all__ = ["Fed2", "Fed2Section", "group_weights", "PAIRINGS"]


class Fed2(FedAvg):
    name = "fed2"

    def __init__(self, train: dict[str, Any], allocation: list[int] | None = None, pairing: str = "all") -> None:
        super().__init__(train)
        if pairing not in PAIRINGS:
            raise ValueError(f"fed2.pairing is one of {', '.join(PAIRINGS)}, got {pairing!r}")
        self.allocation = list(allocation or [])
        self.pairing = pairing
        self.objective = "fed2_train" if pairing == "holders" else "train"   # only holders need the histograms
        self.capabilities = self.capabilities.under({"fed2.pairing": pairing}.get)   # holders: its own weights

    @classmethod
    def from_config(cls, config: RunConfig) -> "Fed2":
        return cls(dataclasses.asdict(config.train), config.fed2.allocation, config.fed2.pairing)

    def model_spec(self, spec: dict[str, Any]) -> dict[str, Any]:
        """The configured model with ``fed2.allocation`` in it, so every party decouples the same classes."""
        if not self.allocation:
            return spec
        if "fed2_allocation" in spec and list(spec["fed2_allocation"]) != self.allocation:
            raise ConfigError("model.fed2_allocation and fed2.allocation differ; set only fed2.allocation")
        return {**spec, "fed2_allocation": self.allocation}

    def check_result(self, plan: TaskPlan, result: ClientResult, spec: dict[str, Any]) -> str | None:
        """A training result must carry its label histogram: one whole count per class, summing to its samples."""
        if plan.objective != "fed2_train":
            return None
        return histogram_problem(result.metrics, result.num_samples, int(spec["num_classes"]))

    def streams(self, phase: str) -> bool:
        return self.pairing == "all" and super().streams(phase)

    def aggregate_train(self, round: int, state: ServerState, results: list[ClientResult],
                        partial: WeightedSum | None = None) -> ServerState:
        """Shared rows by sample count, group rows by the client's samples of the group's classes (holders)."""
        if self.pairing == "all":
            return super().aggregate_train(round, state, results, partial)
        owners = _row_groups(json.dumps(state.spec, sort_keys=True))
        allocation = _allocation(json.dumps(state.spec, sort_keys=True))
        total = RowWeightedSum.reduce(
            RowWeightedSum.of(r.deltas, group_weights(r.deltas, r.num_samples, counts_of(r.metrics), owners,
                                                      allocation))
            for r in results)
        still = {k: torch.zeros_like(v) for k, v in total.sums.items()}   # rows no client gave weight stay put
        return self.server_step(round, state, total.mean(still, torch.float64))


def group_weights(tensors: dict[str, torch.Tensor], num_samples: int, counts: torch.Tensor | None,
                  owners: dict[str, torch.Tensor], allocation: torch.Tensor) -> dict[str, torch.Tensor]:
    """One client's weight for every row of every tensor it sent.

    ``owners[name][row]`` is the row's group (tensors not in ``owners`` are shared);
    ``allocation[c]`` is class ``c``'s group; ``counts[c]`` the client's class-c samples.
    """
    per_group = torch.zeros(int(allocation.max()) + 1, dtype=torch.float64)
    if counts is not None:
        per_group.index_add_(0, allocation, counts.to(torch.float64))
    return {k: per_group[owners[k]] if k in owners else torch.full((v.shape[0],), float(num_samples),
                                                                     dtype=torch.float64)
            for k, v in tensors.items()}


@functools.lru_cache(maxsize=4)
def _model(spec_json: str) -> torch.nn.Module:
    return build_aside(json.loads(spec_json))


def _row_groups(spec_json: str) -> dict[str, torch.Tensor]:
    return row_groups(_model(spec_json))


def _allocation(spec_json: str) -> torch.Tensor:
    return torch.tensor(_model(spec_json).classifier.allocation)
