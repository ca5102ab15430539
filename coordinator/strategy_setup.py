"""Building the configured strategy: the step after a configuration is read and checked.

Kept apart from :mod:`coordinator.methods`, which the configuration itself needs for the
methods' sections and requirements, so that reading a configuration and building a strategy
from it do not import each other.
"""

from __future__ import annotations

import dataclasses
import functools

from coordinator.aggregation import Aggregator
from coordinator.config import RunConfig
from coordinator.methods import method, resolve
from coordinator.strategies.server import PlainStep, ServerOptimizer
from coordinator.privacy import CentralPrivacy, LocalPrivacy
from coordinator.strategies.base import PersonalizedEval, Strategy

__all__ = ["make_strategy"]


def make_strategy(config: RunConfig) -> Strategy:
    """The configured strategy, with its stages (server optimizer, privacy, robust rule, learning-rate schedule)
    and the optional personalized evaluation from ``[eval]``."""
    strategy = resolve(method(config.run.strategy).strategy).from_config(config)
    # What it can run with was checked with the configuration (coordinator/config_checks.py), from the same
    # declaration the strategy now holds under the configured settings.
    strategy.capabilities = config.capabilities
    if config.server.optimizer and config.server.optimizer != config.run.strategy:
        strategy.optimizer = _optimizer(config)
    privacy = CentralPrivacy.from_config(config) or LocalPrivacy.from_config(config)
    if privacy is not None:
        strategy.privacy = privacy
    if config.schedule.scheduled:
        strategy.lr_factor = functools.partial(config.schedule.factor, rounds=config.run.rounds)
    if strategy.capabilities.robust:
        strategy.aggregator = Aggregator(config.aggregate.rule, config.aggregate.trim)
    if config.eval.personalized:
        strategy.personalized = PersonalizedEval(every=config.eval.every, finetune_epochs=config.eval.finetune_epochs,
                                                 train=dataclasses.asdict(config.train))
    return strategy


def _optimizer(config: RunConfig) -> ServerOptimizer:
    """The server optimizer ``server.optimizer`` names, configured by its own section."""
    if config.server.optimizer == "fedavg":
        return PlainStep()
    step = resolve(method(config.server.optimizer).optimizer)
    return step(getattr(config, step.section))
