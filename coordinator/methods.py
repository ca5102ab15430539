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

__all__ = ["strategies_that", "one_update_per_device", "folds_updates", "compatibility_table", "method", "resolve", "method_sections", "requirements"]


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


def one_update_per_device(cls: type) -> bool:
    """Every training result is one update of the model it was sent, which a device can clip and noise and a
    secure sum can add up: a strategy that aggregates deltas and declares no reason against it (``central_dp``)."""
    return bool(cls.aggregates_deltas) and not cls.central_dp


def folds_updates(cls: type) -> bool:
    """Besides, every phase folds its results into one weighted sum whenever they come (no ``sync_only``)."""
    return one_update_per_device(cls) and not cls.sync_only


def compatibility_table() -> str:
    """Which stage and mode each registered strategy takes, as a Markdown table, from the classes' declarations
    (the same ones the checks at start read)."""
    columns = [("`[server] optimizer`", lambda cls: bool(cls.aggregates_deltas)),
               ("`run.mode = \"async\"`", lambda cls: bool(cls.aggregates_deltas) and not cls.sync_only),
               ("central and local DP, SecAgg", one_update_per_device),
               ("aggregation workers", folds_updates),
               ("`aggregate.rule`, `norm_bound`", lambda cls: bool(cls.robust)),
               ("apps", lambda cls: False)]
    lines = ["| strategy | " + " | ".join(title for title, _ in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for name in strategies():
        cls, entry = resolve(method(name).strategy), method(name)
        marks = ["yes" if (entry.takes_apps if title == "apps" else can(cls)) else "-" for title, can in columns]
        lines.append(f"| `{name}` | " + " | ".join(marks) + " |")
    return "\n".join(lines) + "\n"
