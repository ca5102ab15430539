"""How reports write bytes, seconds and absent values, the same in the terminal and in HTML."""

from __future__ import annotations

__all__ = ["human_bytes", "seconds", "milliseconds", "number", "ABSENT"]

ABSENT = "—"   # a reading the device could not take: never shown as 0


def human_bytes(n: float | None) -> str:
    if n is None:
        return ABSENT
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def seconds(value: float | None, digits: int = 2) -> str:
    return ABSENT if value is None else f"{value:.{digits}f}"


def milliseconds(value: float | None) -> str:
    if value is None:
        return ABSENT
    return f"{value * 1000:.3f}" if value < 0.001 else f"{value * 1000:.2f}"


def number(value: float | None, fmt: str = ".1f") -> str:
    return ABSENT if value is None else format(value, fmt)
