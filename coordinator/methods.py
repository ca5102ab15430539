"""The coordinator's side of the method registry (:mod:`edge_client.registry`).

The registry names each method's strategy and config sections by import path, so
the device package never imports coordinator code; here those paths are resolved,
and the method's required model options and defaults are applied to a configuration.
Its strategy is built by :mod:`coordinator.strategy_setup`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from coordinator.errors import ConfigError
from edge_client.registry import METHODS, Method, resolve, strategies

__all__ = ["method", "resolve", "method_sections", "requirements"]


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
