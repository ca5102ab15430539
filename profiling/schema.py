"""The fields of a task profile, and the check a receiver runs before trusting one.

A profile arrives from a device inside a result message, so the coordinator treats
it like any other input: :func:`clean_profile` keeps only known fields of the right
type and finite value, and drops the rest. A dropped field reads as absent, the same
as a reading the device could not take.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["clean_profile", "clean_device_facts", "NUMBER_FIELDS", "COUNT_FIELDS", "FACT_FIELDS"]

# seconds, percentages, degrees: finite numbers, at least zero (temperature may be negative)
NUMBER_FIELDS = ("seconds", "step_p50", "step_p95", "step_max", "samples_per_second", "cpu_percent",
                 "temperature_c", "battery_percent")
# counts and byte sizes: non-negative integers
COUNT_FIELDS = ("steps", "samples", "peak_rss_bytes", "peak_uss_bytes", "gpu_peak_bytes", "memory_available_bytes",
                "memory_total_bytes")
# the device facts (hello message) selection reads; the rest are only shown, never computed with
FACT_FIELDS = ("cores", "ram_bytes", "memory_total_bytes", "memory_available_bytes", "battery_percent",
               "power_plugged")
_PHASE_MAPS = ("phases", "train_phases")
_MAX_NAMES = 32
_MAX_TEXT = 64


def _number(value: Any, *, signed: bool = False) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value) if signed or value >= 0 else None


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _percent(value: Any) -> float | None:
    number = _number(value)
    return number if number is not None and number <= 100 else None


def _flag(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _text(value: Any) -> str | None:
    return value[:_MAX_TEXT] if isinstance(value, str) else None


def _seconds_map(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        return {}
    out = {}
    for name, seconds in list(value.items())[:_MAX_NAMES]:
        number = _number(seconds)
        if isinstance(name, str) and len(name) <= _MAX_TEXT and number is not None:
            out[name] = number
    return out


def _throttled(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict) or _text(value.get("raw")) is None:
        return None
    flags = {key: [f[:_MAX_TEXT] for f in value.get(key, []) if isinstance(f, str)][:_MAX_NAMES]
             for key in ("now", "since_boot") if isinstance(value.get(key), list)}
    return {"raw": _text(value["raw"]), "now": flags.get("now", []), "since_boot": flags.get("since_boot", [])}


def _previous_send(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict) or _text(value.get("task_id")) is None:
        return None
    return {"task_id": _text(value["task_id"]), **_seconds_map({k: value.get(k) for k in ("encode", "publish")})}


def clean_profile(raw: Any) -> dict[str, Any]:
    """The known fields of ``raw`` (anything at all); a field of the wrong type or value becomes None.

    Unknown fields are dropped. A known field the sender left out stays out; one it
    sent as null, or sent malformed, is kept as None: absent.
    """
    if not isinstance(raw, dict):
        return {}
    checks = {**{key: _number for key in NUMBER_FIELDS}, **{key: _count for key in COUNT_FIELDS},
              "temperature_c": lambda v: _number(v, signed=True), "temperature_sensor": _text,
              "device": _text, "gpu_temperature_c": lambda v: _number(v, signed=True),
              "throttled": _throttled, "previous_send": _previous_send, "battery_percent": _percent,
              "power_plugged": _flag}
    out: dict[str, Any] = {key: check(raw[key]) for key, check in checks.items() if key in raw}
    for key in _PHASE_MAPS:
        if key in raw:
            out[key] = _seconds_map(raw[key])
    return out


def clean_device_facts(raw: Any) -> dict[str, Any]:
    """The :data:`FACT_FIELDS` of a hello message's device facts (anything at all), checked like a profile:
    byte sizes and core counts non-negative integers, the battery a percentage, plugged a bool; a field
    missing or malformed is absent (None)."""
    if not isinstance(raw, dict):
        raw = {}
    checks = {"cores": _count, "ram_bytes": _count, "memory_total_bytes": _count, "memory_available_bytes": _count,
              "battery_percent": _percent, "power_plugged": _flag}
    return {key: checks[key](raw.get(key)) for key in FACT_FIELDS}
