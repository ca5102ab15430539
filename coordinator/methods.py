"""The coordinator's side of the method registry (:mod:`edge_client.registry`).

The registry names each method's strategy and config sections by import path, so
the device package never imports coordinator code; here those paths are resolved,
and the method's required model options and defaults are applied to a configuration.
Its strategy is built by :mod:`coordinator.strategy_setup`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from coordinator.errors import ConfigError
from edge_client.registry import METHODS, Method, resolve, strategies

__all__ = ["strategies_that", "folds_updates", "method", "resolve", "method_sections", "requirements"]


def method(name: str) -> Method:
    """The registry entry of the strategy ``run.strategy`` names."""
    entry = METHODS.get(name)
    if entry is None or not entry.strategy:
        what = f"unknown strategy {name!r}" if entry is None else f"{name!r} is a model option, not a strategy"
        raise ConfigError(f"{what}; available: {', '.join(strategies())} (docs/methods.md)")
    return entry


@functools.cache
def method_sections() -> dict[str, type]:
    """Every method's config sections (name -> frozen dataclass), in registry order.

    All of them are part of every configuration, with their defaults, whichever
    strategy runs: a config file keeps its meaning when only ``run.strategy`` changes.
    """
    sections: dict[str, type] = {}
    for entry in METHODS.values():
        for name, path in entry.sections.items():
            cls = resolve(path)
            if name in sections and sections[name] is not cls:
                raise TypeError(f"config section [{name}] is registered twice with different dataclasses")
            sections[name] = cls
    return sections


def requirements(strategy: str, model: Mapping[str, Any], explicit: frozenset[str]) -> tuple[dict[str, Any],
                                                                                             dict[str, Any]]:
    """What ``strategy`` adds to a configuration: (model options, ``section.key`` defaults).

    A required model option the user set to another value is a real conflict and an
    error naming both; a default is dropped where the user set the key (``explicit``).
    """
    entry = method(strategy)
    for key, value in entry.model_options.items():
        if key in model and model[key] != value:
            raise ConfigError(f"run.strategy = {strategy!r} needs model.{key} = {value!r}, but the configuration "
                              f"sets {model[key]!r}; remove model.{key} (the strategy sets it) or choose "
                              "another strategy")
    defaults = {k: v for k, v in entry.defaults.items() if k not in explicit}
    return dict(entry.model_options), defaults


def strategies_that(can: Callable[[type], bool]) -> str:
    """The registered strategies whose class ``can``, comma-separated: what a refusal offers instead, read from
    each strategy's own declarations so that no message lists methods by hand."""
    return ", ".join(name for name in strategies() if can(resolve(method(name).strategy)))


def folds_updates(cls: type) -> bool:
    """Every result is one update of the model it was sent, folded into one weighted sum: a FedAvg whose class
    declares no reason against it (``sync_only``, ``central_dp``)."""
    from coordinator.strategies.fedavg import FedAvg

    return issubclass(cls, FedAvg) and not cls.sync_only and not cls.central_dp
