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
from coordinator.errors import ConfigError
from coordinator.methods import method, one_update_per_device, resolve, strategies_that
from coordinator.strategies.server import PlainStep, ServerOptimizer
from coordinator.privacy import CentralPrivacy, LocalPrivacy
from coordinator.strategies.fedavg import FedAvg
from coordinator.strategies.base import PersonalizedEval, Strategy

__all__ = ["make_strategy"]


def make_strategy(config: RunConfig) -> Strategy:
    """The configured strategy, with its stages (server optimizer, privacy, robust rule, learning-rate schedule)
    and the optional personalized evaluation from ``[eval]``."""
    strategy = resolve(method(config.run.strategy).strategy).from_config(config)
    a = config.aggregate
    if (a.rule != "mean" or a.norm_bound > 0) and not strategy.robust:
        raise ConfigError(f"aggregate.rule = {a.rule!r} and aggregate.norm_bound apply to strategies that average "
                          f"updates ({strategies_that(lambda cls: bool(cls.robust))}); {config.run.strategy!r} as "
                          "configured combines results its own way: leave them at mean and 0")
    if config.server.optimizer and config.server.optimizer != config.run.strategy:
        if not strategy.aggregates_deltas:
            raise ConfigError(f"server.optimizer = {config.server.optimizer!r} cannot step run.strategy = "
                              f"{config.run.strategy!r}: it does not combine its results into one model update; "
                              "leave server.optimizer empty or use a strategy that does "
                              f"({strategies_that(lambda cls: bool(cls.aggregates_deltas))})")
        strategy.optimizer = _optimizer(config)
    if config.run.mode == "async" and strategy.sync_only:
        raise ConfigError(f"run.mode = 'async' cannot run run.strategy = {config.run.strategy!r}: "
                          f"{strategy.sync_only}; use run.mode = 'sync' or a strategy that folds every result into "
                          f"one update ({strategies_that(lambda cls: bool(cls.aggregates_deltas) and not cls.sync_only)})")
    privacy = CentralPrivacy.from_config(config) or LocalPrivacy.from_config(config)
    if privacy is not None:
        # Local DP needs the same of a strategy: one update per device of the model it was sent, which the device
        # can clip and add noise to; layers matched raw or per-device statistics would leave it without noise.
        if strategy.central_dp or not isinstance(strategy, FedAvg):
            raise ConfigError(f"privacy.mode = {config.privacy.mode!r} cannot run run.strategy = "
                              f"{config.run.strategy!r}: {strategy.central_dp or 'it combines results its own way'}; "
                              "use privacy.mode = 'off' or a strategy whose every result is one clipped update per "
                              f"device ({strategies_that(one_update_per_device)}; docs/privacy.md)")
        strategy.privacy = privacy
    if config.secagg.enabled and (strategy.central_dp or not isinstance(strategy, FedAvg)
                                  or not strategy.streams("train")):
        raise ConfigError(f"secagg.enabled = true cannot run run.strategy = {config.run.strategy!r}: "
                          f"{strategy.central_dp or 'it combines results its own way'}; the coordinator sees only "
                          "the sum of the round's updates, so use secagg.enabled = false or a strategy that folds one "
                          f"update per device into one sum ({strategies_that(one_update_per_device)}; docs/privacy.md)")
    if config.schedule.scheduled:
        strategy.lr_factor = functools.partial(config.schedule.factor, rounds=config.run.rounds)
    if strategy.robust:
        strategy.aggregator = Aggregator(a.rule, a.trim)
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
