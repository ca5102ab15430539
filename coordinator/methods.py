"""The coordinator's side of the method registry (:mod:`edge_client.registry`).

The registry names each method's strategy and config sections by import path, so
the device package never imports coordinator code; here those paths are resolved,
and the method's required model options and defaults are applied to a configuration (its declared
capabilities under a configuration's settings: ``RunConfig.capabilities``).
Its strategy is built by :mod:`coordinator.strategy_setup`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from coordinator.errors import ConfigError
from edge_client.registry import METHODS, Capabilities, Method, resolve, strategies


__all__ = ["strategies_that", "compatibility_table", "method", "resolve", "method_sections",
           "requirements"]


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


def strategies_that(can: Callable[[Capabilities], bool]) -> str:
    """The registered strategies whose declared capabilities ``can``, comma-separated: what a refusal offers
    instead, read from the registry so that no message lists methods by hand."""
    return ", ".join(name for name in strategies() if can(method(name).capabilities))


_COLUMNS: list[tuple[str, Callable[[Capabilities], bool]]] = [
    ("`[server] optimizer`", lambda c: c.aggregates_deltas),
    ("`run.mode = \"async\"`", lambda c: c.runs_async),
    ("central and local DP, SecAgg", lambda c: c.one_update_per_device),
    ("aggregation workers", lambda c: c.folds_updates),
    ("`aggregate.rule`, `norm_bound`", lambda c: c.robust),
]


def _setting(key: str, value: Any) -> str:
    text = ("true" if value else "false") if isinstance(value, bool) else repr(value)
    return f"`{key} = {text}`"


def _cell(declared: Capabilities, can: Callable[[Capabilities], bool]) -> str:
    """"yes" or "-", and the settings under which a condition of the declaration turns it over."""
    mark = "yes" if can(declared) else "-"
    turned = [" and ".join(_setting(k, v) for k, v in condition.when.items()) for condition in declared.conditions
              if can(replace(declared, **condition.changes)) != can(declared)]
    return mark + "".join(f", {'not' if can(declared) else 'yes'} with {when}" for when in turned)


def compatibility_table() -> str:
    """Which stage and mode each registered strategy takes, as a Markdown table, from the registry's declarations
    (the same ones the checks of a configuration read)."""
    titles = [title for title, _ in _COLUMNS] + ["apps"]
    lines = ["| strategy | " + " | ".join(titles) + " |", "|---|" + "---|" * len(titles)]
    for name in strategies():
        entry = method(name)
        marks = [_cell(entry.capabilities, can) for _, can in _COLUMNS] + ["yes" if entry.takes_apps else "-"]
        lines.append(f"| `{name}` | " + " | ".join(marks) + " |")
    return "\n".join(lines) + "\n"
