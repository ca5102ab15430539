"""The policies a lab compares, each a set of coordinator config overrides, and the coordinator's
config file for one policy. The one table below is the only place a policy is defined.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["POLICIES", "coordinator_config", "toml_text"]

# name -> {section: {key: value}} laid over the lab's base config
POLICIES: dict[str, dict[str, dict[str, Any]]] = {
    "sync-random": {"clients": {"selection": "random"}},
    "sync-deadline": {"clients": {"selection": "deadline"}},
    "sync-profile": {"clients": {"selection": "profile"}},   # profile-driven selection
    # random selection drawing 30 % more devices, the round closing at clients.per_round results
    "sync-overselect": {"clients": {"selection": "random", "over_select": 1.3}},
    "async": {"run": {"mode": "async"}, "async": {}},         # buffered asynchronous aggregation
}


def coordinator_config(policy: str, *, broker: str, out: str, rounds: int, seed: int, model: str, data: str,
                       partition: str, expected: int, per_round: int, min_results: int,
                       round_timeout: float) -> dict[str, dict[str, Any]]:
    """The whole config of one policy's run: the lab's base, then the policy's overrides."""
    config: dict[str, dict[str, Any]] = {
        "run": {"strategy": "fedavg", "rounds": rounds, "seed": seed, "out": out},
        "model": {"name": model},
        "data": {"eval": data, "partition": partition},
        "clients": {"expected": expected, "per_round": per_round, "min_results": min_results,
                    "round_timeout": round_timeout, "presence_timeout": 600.0, "spawn": 0},
        "transport": {"kind": "mqtt", "broker": broker, "prefix": f"lab-{policy}"},
        "export": {"enabled": False},
    }
    for section, keys in POLICIES[policy].items():
        config.setdefault(section, {}).update(keys)
    clients = config["clients"]
    # the coordinator draws at most clients.expected devices: let it wait for as many as over-selection draws
    clients["expected"] = max(expected, math.ceil(per_round * clients.get("over_select", 1.0) - 1e-9))
    return config


def toml_text(config: dict[str, dict[str, Any]]) -> str:
    """TOML of sections of scalars (JSON's strings, numbers and booleans are TOML's)."""
    lines = []
    for section, keys in config.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in keys.items()]
        lines.append("")
    return "\n".join(lines)
