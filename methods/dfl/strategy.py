"""Disentangled FL (DFL): only the invariant extractor is aggregated; the rest stays on the devices.

The clients run a two-branch model (``methods/dfl/model.py``) around the
configured backbone; :meth:`DFL.model_spec` wraps the spec. Each round:

- ``train``: every selected client gets the global invariant extractor and runs
  ``dfl_train`` (``methods/dfl/device.py``); it sends back its invariant extractor
  only. The new global invariant extractor is their sample-weighted mean.
- ``evaluate`` (every ``eval.every`` rounds and in the last): every online client
  reports the accuracy of the global invariant extractor with its own specific
  extractor and predictor on its held-out split (``dfl_evaluate``).

Diversity transferring (``dfl.diversity = M > 0``) makes the clients also send
their specific extractor; the coordinator keeps each client's latest one and
relays up to M other clients' to each client in the next round. The server state
is the invariant extractor, plus (with diversity) those specific extractors under
``bank/CLIENT_ID/specific.*``, so a resumed run relays them as before.

The coordinator has no predictor of its own (predictors stay on the devices), so
it reports no global test accuracy; the personalized metrics are DFL's result.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from coordinator.errors import ConfigError
from coordinator.strategies.base import ClientResult, PersonalizedEval, Strategy, TaskPlan, WeightedSum
from edge_client.models import federated_names
from edge_client.registry import build_aside
from methods.dfl.model import INVARIANT, SPECIFIC, part_names
from methods.dfl.settings import DflSection, backbone_problem
from storage.state import ServerState

if TYPE_CHECKING:
    from coordinator.config import RunConfig

__all__ = ["DFL", "DflSection", "BANK"]

BANK = "bank"   # state names of relayed specific extractors: bank/CLIENT_ID/specific.*


class DFL(Strategy):
    name = "dfl"

    def __init__(self, train: dict[str, Any], settings: DflSection, *, seed: int, every: int = 1,
                 refresh_epochs: int = 0) -> None:
        self.train = dict(train)
        self.settings = settings
        self.seed = seed
        # DFL's result is personalized accuracy; eval.finetune_epochs is its refresh before testing
        self.personalized = PersonalizedEval(every=every, finetune_epochs=refresh_epochs)

    @classmethod
    def from_config(cls, config: RunConfig) -> "DFL":
        return cls(dataclasses.asdict(config.train), config.dfl, seed=config.run.seed, every=config.eval.every,
                   refresh_epochs=config.eval.finetune_epochs)

    def model_spec(self, spec: dict[str, Any]) -> dict[str, Any]:
        """The two-branch model around the configured backbone (``model.name``)."""
        if backbone_problem(spec["name"]):
            raise ConfigError(backbone_problem(spec["name"]))
        s = self.settings
        wrapped = {**spec, "name": "dfl", "backbone": spec["name"], "specific_width": s.specific_width,
                   "mi_hidden": s.mi_hidden, **({"peers": s.diversity} if s.diversity else {})}
        return wrapped

    def initialize(self, spec: dict[str, Any], params: dict[str, torch.Tensor]) -> ServerState:
        """Only the invariant extractor is global; the other branches start on each device."""
        return ServerState(round=0, params={k: params[k] for k in part_names(params, INVARIANT)}, spec=spec)

    def _specific(self, state: ServerState) -> list[str]:
        """Names of a specific extractor: what clients send and the coordinator relays (diversity only)."""
        return _specific_names(json.dumps(state.spec, sort_keys=True)) if self.settings.diversity else []

    def _hyper(self, peers: int = 0) -> dict[str, Any]:
        s = self.settings
        return {"train": dict(self.train),
                "dfl": {"local_epochs": s.local_epochs, "global_epochs": s.global_epochs,
                        "mi_min_weight": s.mi_min_weight, "mi_max_weight": s.mi_max_weight,
                        "init_seed": self.seed, "peers": peers}}

    @staticmethod
    def _invariant(state: ServerState) -> dict[str, torch.Tensor]:
        return {k: state.params[k] for k in part_names(state.params, INVARIANT)}

    def _peers(self, round: int, state: ServerState, client: str) -> dict[str, torch.Tensor]:
        """Up to ``diversity`` other clients' latest specific extractors, in the model's peer slots."""
        banked = sorted({k.split("/")[1] for k in state.params if k.startswith(BANK + "/")} - {client})
        chosen = random.Random(f"{self.seed}/{round}/{client}").sample(banked, min(self.settings.diversity,
                                                                                    len(banked)))
        return {f"peers.{i}.{name.removeprefix(SPECIFIC + '.')}": state.params[f"{BANK}/{cid}/{name}"]
                for i, cid in enumerate(chosen) for name in self._specific(state)}

    def configure_train(self, round: int, state: ServerState, clients: list[str]) -> list[TaskPlan]:
        invariant = self._invariant(state)
        specific = self._specific(state)
        up = sorted(invariant) + specific
        plans = []
        for c in clients:
            peers = self._peers(round, state, c) if self.settings.diversity else {}
            count = len(peers) // max(len(specific), 1)
            plans.append(TaskPlan(client_id=c, objective="dfl_train", hyper=self._hyper(count),
                                  down={**invariant, **peers}, up=up))
        return plans

    def aggregate(self, phase: str, round: int, state: ServerState, results: list[ClientResult],
                  partial: Any = None) -> tuple[ServerState, dict[str, Any]]:
        if phase != "train":
            return super().aggregate(phase, round, state, results, partial)
        return self.aggregate_train(round, state, results), _train_metrics(results)

    def aggregate_train(self, round: int, state: ServerState, results: list[ClientResult]) -> ServerState:
        """The server's step (:meth:`server_step`, ``[server] optimizer``) on the sample-weighted mean update of
        the invariant extractors; with diversity, bank each specific one."""
        names = part_names(state.params, INVARIANT)
        total = WeightedSum.reduce(WeightedSum.of({k: r.deltas[k] for k in names}, r.num_samples) for r in results)
        stepped = self.server_step(round, state, total.mean(torch.float64))
        banked = {f"{BANK}/{r.client_id}/{k}": r.tensors[k] for r in results for k in self._specific(state)}
        return dataclasses.replace(stepped, params={**stepped.params, **banked})

    def configure_evaluate(self, round: int, state: ServerState, clients: list[str]) -> list[TaskPlan]:
        """The global invariant extractor to every client, tested with its own branches; with
        ``eval.finetune_epochs`` each first refreshes its specific extractor and predictor against it
        (DFL's local stage), as FedAvg + fine-tuning trains the global model first."""
        epochs = self.personalized.finetune_epochs if self.personalized else 0
        hyper: dict[str, Any] = {"dfl": {"init_seed": self.seed}}
        if epochs:   # only then, so a device from before the refresh existed still takes the task
            hyper = self._hyper()
            hyper["dfl"]["refresh_epochs"] = epochs
        return [TaskPlan(client_id=c, objective="dfl_evaluate", hyper=hyper, down=self._invariant(state), up=[],
                         expect={}) for c in clients]

    def evaluate(self, state: ServerState, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        """Nothing: without a device's specific branch and predictor there is no classifier to test."""
        return {}


@functools.lru_cache(maxsize=4)
def _specific_names(spec_json: str) -> list[str]:
    return part_names(federated_names(build_aside(json.loads(spec_json))), SPECIFIC)


def _train_metrics(results: list[ClientResult]) -> dict[str, Any]:
    """Sample-weighted means of the clients' MI estimates, and how many started from fresh branches."""
    n = sum(r.num_samples for r in results)
    out: dict[str, Any] = {}
    for key in ("mi_inv_spe", "mi_inv_glob", "local_stage_loss"):
        values = [(r.metrics.get(key), r.num_samples) for r in results]
        if all(isinstance(v, (int, float)) for v, _ in values):
            out[f"dfl_{key}"] = sum(v * w for v, w in values) / n
    out["dfl_fresh_clients"] = sum(1 for r in results if r.metrics.get("state_initialized") == 1.0)
    return out
