"""The benchmark protocol (``bench/protocol.toml``): what every method matrix holds fixed.

Results from different matrices compare only if they ran under the same data,
clients, sampling, local work, tuning, rounds and evaluation. The protocol file
says what those are; :func:`deviations` names every way a run's configuration
departs from it, so the harness can refuse such a cell, or record why it ran anyway.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.config import RunConfig
from edge_client.models import MODELS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["PROTOCOL_FILE", "Protocol", "load_protocol", "deviations", "rounds_to_reach"]

PROTOCOL_FILE = Path(__file__).resolve().parent / "protocol.toml"


@dataclass(frozen=True)
class Protocol:
    name: str
    seeds: list[int]
    fixed: dict[str, Any]
    at_least: dict[str, float]
    one_of: dict[str, list[str]]


def load_protocol(path: Path = PROTOCOL_FILE) -> Protocol:
    raw = tomllib.loads(path.read_text(encoding="utf-8"))
    return Protocol(raw["name"], list(raw["seeds"]), dict(raw.get("fixed", {})), dict(raw.get("at_least", {})),
                    dict(raw.get("one_of", {})))


def _value(config: RunConfig, key: str) -> Any:
    """``section.key`` of a configuration; ``model`` is ``NAME@WIDTH/NORM`` (the model's own default norm
    where the configuration sets none)."""
    if key == "model":
        name = config.model["name"]
        norm = config.model.get("norm", inspect.signature(MODELS[name]).parameters["norm"].default
                                if name in MODELS else "?")
        return f"{name}@{float(config.model.get('width', 1.0))}/{norm}"
    section, _, name = key.partition(".")
    holder = getattr(config, section)
    return holder.get(name) if isinstance(holder, dict) else getattr(holder, name)


def _matches(value: Any, allowed: list[str]) -> bool:
    return any(value == a or (a.endswith("*") and str(value).startswith(a[:-1])) for a in allowed)


def deviations(config: RunConfig, protocol: Protocol, seeds: list[int]) -> list[str]:
    """Every way ``config`` (one cell) and the matrix's ``seeds`` depart from the protocol; [] if none."""
    out = [f"{key} = {_value(config, key)!r}, the protocol fixes {want!r}"
           for key, want in protocol.fixed.items() if _value(config, key) != want]
    out += [f"{key} = {_value(config, key)!r}, the protocol needs at least {least!r}"
            for key, least in protocol.at_least.items() if _value(config, key) < least]
    out += [f"{key} = {_value(config, key)!r}, the protocol allows {', '.join(allowed)}"
            for key, allowed in protocol.one_of.items() if not _matches(_value(config, key), allowed)]
    if sorted(seeds) != sorted(protocol.seeds):
        out.append(f"seeds {seeds}, the protocol runs seeds {protocol.seeds}")
    return out


def rounds_to_reach(rows: list[dict[str, Any]], target: float | None, key: str = "test_accuracy") -> int | None:
    """The first round whose ``key`` (test accuracy, or the personalized mean) reaches ``target``
    (None: it never did, or no target)."""
    if target is None:
        return None
    return next((r["round"] for r in rows if r["round"] > 0 and (r.get(key) or 0.0) >= target), None)
