"""Strategy registry: a name in the run config maps to a constructor here."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from coordinator.config import ConfigError, RunConfig
from coordinator.strategies.base import (ClientResult, PersonalizedEval, ServerState, Strategy, TaskPlan,
                                         WeightedSum)
from coordinator.strategies.dfl import DFL
from coordinator.strategies.fedavg import FedAvg, FedProx
from coordinator.strategies.spherefed import SphereFed

__all__ = ["STRATEGIES", "make_strategy", "Strategy", "ServerState", "TaskPlan", "ClientResult", "WeightedSum"]

STRATEGIES: dict[str, Callable[[RunConfig], Strategy]] = {
    "fedavg": lambda cfg: FedAvg(dataclasses.asdict(cfg.train)),
    "fedprox": lambda cfg: FedProx(dataclasses.asdict(cfg.train), cfg.fedprox.mu),
    "spherefed": SphereFed.from_config,
    "dfl": DFL.from_config,
}


def make_strategy(config: RunConfig) -> Strategy:
    name = config.run.strategy
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy {name!r}; available: {', '.join(sorted(STRATEGIES))}")
    strategy = STRATEGIES[name](config)
    if config.eval.personalized:
        strategy.personalized = PersonalizedEval(every=config.eval.every, finetune_epochs=config.eval.finetune_epochs,
                                                 train=dataclasses.asdict(config.train))
    return strategy
