"""Run configuration: TOML file, command-line flags and ``--set KEY=VALUE`` overrides.

Sections are frozen dataclasses so a typo is an error naming the valid keys, not a
silently ignored setting. The runtime's sections are in :mod:`coordinator.config_sections`
and the checks of a whole configuration in :mod:`coordinator.config_checks`; each method brings
its own (``[fedprox]``, ...), named in its registry entry
(:mod:`edge_client.registry`) and defined beside its strategy, along with the model
options it needs and the defaults it brings. The resolved configuration is written
to ``OUT/config.toml``, which is also what ``--resume`` reads back.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from coordinator.config_checks import check_config
from coordinator.errors import ConfigError
from coordinator.methods import method_sections, requirements
from coordinator.run_config import FIELD_OF, RunConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["ConfigError", "RunConfig", "load_config", "apply_overrides", "with_method_requirements", "parse_override",
           "dump_config", "validate", "renamed_keys"]


class OverrideText(str):
    """A ``--set`` value as typed: read as TOML unless the key it sets holds text."""

    def parsed(self) -> Any:
        try:
            return tomllib.loads(f"v = {self}")["v"]
        except tomllib.TOMLDecodeError:
            return str(self)


def _coerce(section: str, key: str, value: Any, default: Any) -> Any:
    expected = type(default)
    if isinstance(value, OverrideText):
        parsed = value.parsed()
        value = parsed if expected is not str or isinstance(parsed, str) else str(value)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise ConfigError(f"{section}.{key} must be {expected.__name__}, got {value!r}")
    return value


_NOT_SECTIONS = ("methods", "explicit")
_SECTION_OF = {v: k for k, v in FIELD_OF.items()}



def _core_sections() -> dict[str, Any]:
    """The runtime's own sections: name -> default value (a dataclass, or the model dict)."""
    return {_SECTION_OF.get(f.name, f.name): f.default_factory()  # type: ignore[misc]
            for f in dataclasses.fields(RunConfig) if f.name not in _NOT_SECTIONS}


def renamed_keys() -> dict[tuple[str, str], tuple[str, str]]:
    """Keys an earlier fedge read, (section, key) -> (section, key) of the same setting now: each section
    names its own (a ``renamed`` class attribute, old key -> "section.key"), for reading old run files."""
    sections = {**_core_sections(), **{name: cls() for name, cls in method_sections().items()}}
    return {(name, old): tuple(new.split(".", 1)) for name, default in sections.items()  # type: ignore[misc]
            for old, new in getattr(default, "renamed", {}).items()}


def _from_dict(raw: dict[str, Any], explicit: frozenset[str] = frozenset()) -> RunConfig:
    core, methods = _core_sections(), method_sections()
    sections: dict[str, Any] = {}
    method_values = {name: cls() for name, cls in methods.items()}
    for name, values in raw.items():
        if name not in core and name not in methods:
            raise ConfigError(f"unknown config section [{name}]; valid: {', '.join([*core, *methods])}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{name}] must be a table")
        if name == "model":
            model = {k: v.parsed() if isinstance(v, OverrideText) and k != "name" else v for k, v in values.items()}
            sections[name] = {"name": "cnn", **{k: str(v) if k == "name" else v for k, v in model.items()}}
            continue
        default = method_values[name] if name in methods else core[name]
        known = {f.name: getattr(default, f.name) for f in dataclasses.fields(default)}
        for key in values:
            if key in getattr(default, "renamed", {}):
                raise ConfigError(f"{name}.{key} is now {default.renamed[key]} (the same values): rename it in the "
                                  "file or the --set flag (a run directory's config.toml too, to resume it)")
            if key not in known:
                raise ConfigError(f"unknown key {name}.{key}; valid: {', '.join(known)}")
        value = dataclasses.replace(default, **{k: _coerce(name, k, v, known[k]) for k, v in values.items()})
        if name in methods:
            method_values[name] = value
        else:
            sections[FIELD_OF.get(name, name)] = value
    return RunConfig(**sections, methods=method_values, explicit=explicit)


def _to_dict(config: RunConfig) -> dict[str, Any]:
    core = {name: dict(config.model) if name == "model"
            else dataclasses.asdict(getattr(config, FIELD_OF.get(name, name))) for name in _core_sections()}
    return {**core, **{name: dataclasses.asdict(value) for name, value in config.methods.items()}}


def parse_override(item: str) -> tuple[str, str, OverrideText]:
    """``section.key=value`` -> (section, key, text); the text is typed by the key it sets.

    A text key keeps the value as typed (``transport.protocol=5`` stays "5"); any other
    key reads it as TOML (``model.hidden=[256,128]``, ``train.lr=0.01``).
    """
    path, sep, text = item.partition("=")
    section, dot, key = path.strip().partition(".")
    if not sep or not dot or not key.strip():
        raise ConfigError(f"--set expects SECTION.KEY=VALUE, got {item!r}")
    return section.strip(), key.strip(), OverrideText(text.strip())


def apply_overrides(config: RunConfig, overrides: list[tuple[str, str, Any]], *, explicit: bool = True) -> RunConfig:
    """``config`` with (section, key, value) overrides; ``explicit``: the user set them (a method's
    defaults never replace what the user set)."""
    raw = _to_dict(config)
    for section, key, value in overrides:
        raw.setdefault(section, {})[key] = value
    marked = {f"{section}.{key}" for section, key, _ in overrides} if explicit else set()
    return _from_dict(raw, config.explicit | marked)


def with_method_requirements(config: RunConfig) -> RunConfig:
    """``config`` with the model options its strategy needs and the defaults it brings, where the user
    set none (a strategy whose registry entry asks for a model head gets it when ``model.head`` is unset;
    docs/methods.md); a conflicting value the user set is an error that names both."""
    model_options, defaults = requirements(config.run.strategy, config.model, config.explicit)
    overrides = [("model", k, v) for k, v in model_options.items() if k not in config.model]
    overrides += [(*key.split(".", 1), value) for key, value in defaults.items()]   # type: ignore[misc]
    return apply_overrides(config, overrides, explicit=False) if overrides else config


def load_config(path: Path | None = None, overrides: list[tuple[str, str, Any]] | None = None) -> RunConfig:
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {path} cannot be read: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    given = frozenset(f"{name}.{key}" for name, values in raw.items() if isinstance(values, dict) for key in values)
    return validate(with_method_requirements(apply_overrides(_from_dict(raw, given), overrides or [])))


def validate(config: RunConfig) -> RunConfig:
    """``config``, checked as a whole (:mod:`coordinator.config_checks`); ConfigError on the first problem."""
    check_config(config)
    return config


def dump_config(config: RunConfig, path: Path) -> None:
    import tomli_w

    path.write_text(tomli_w.dumps(_to_dict(config)), encoding="utf-8")
