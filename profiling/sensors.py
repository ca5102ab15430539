"""Readings of the device's state that may not exist: CPU temperature and Pi throttling.

A reading the device cannot give is ``None`` (absent), never zero: a report that
said 0 °C or "not throttled" for a machine without a sensor would be a lie. Both
readings are cheap enough to take once or twice per task, not per step.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any

import psutil

__all__ = ["cpu_temperature", "pi_throttling", "parse_throttled", "THROTTLE_FLAGS"]

# Sensor names that measure the CPU: Raspberry Pi (cpu_thermal), Jetson (CPU-therm,
# cpu-thermal), x86 (coretemp, k10temp, zenpower). Anything else (NVMe, Wi-Fi, GPU)
# would mislead a report about the CPU, so it is never used.
_CPU_SENSOR = re.compile(r"cpu|coretemp|k10temp|zenpower|soc_thermal", re.IGNORECASE)

# Bits of `vcgencmd get_throttled`, from the Raspberry Pi firmware documentation.
THROTTLE_FLAGS = {
    0: "under_voltage",
    1: "frequency_capped",
    2: "throttled",
    3: "soft_temperature_limit",
}
_SINCE_BOOT_SHIFT = 16
_VCGENCMD = shutil.which("vcgencmd")


def cpu_temperature() -> tuple[float, str] | None:
    """Hottest CPU sensor reading in °C and the sensor's name; None when there is none.

    ``psutil.sensors_temperatures()`` is empty in most containers and VMs; on a
    Raspberry Pi it has ``cpu_thermal``.
    """
    try:
        sensors = psutil.sensors_temperatures()
    except (AttributeError, OSError):   # AttributeError: the platform has no sensor support
        return None
    best: tuple[float, str] | None = None
    for name, readings in sensors.items():
        if not _CPU_SENSOR.search(name):
            continue
        for reading in readings:
            if reading.current is not None and (best is None or reading.current > best[0]):
                best = (float(reading.current), name)
    return best


def parse_throttled(output: str) -> dict[str, Any] | None:
    """``throttled=0x50005`` -> the flags set now and since boot; None for anything else."""
    key, sep, value = output.strip().partition("=")
    try:
        bits = int(value, 16) if sep and key == "throttled" else None
    except ValueError:
        bits = None
    if bits is None:
        return None
    return {
        "raw": hex(bits),
        "now": [name for bit, name in THROTTLE_FLAGS.items() if bits >> bit & 1],
        "since_boot": [name for bit, name in THROTTLE_FLAGS.items() if bits >> (bit + _SINCE_BOOT_SHIFT) & 1],
    }


def pi_throttling() -> dict[str, Any] | None:
    """The Pi firmware's throttling flags (now and since boot); None without ``vcgencmd``."""
    if _VCGENCMD is None:
        return None
    try:
        out = subprocess.run([_VCGENCMD, "get_throttled"], capture_output=True, text=True, timeout=2).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_throttled(out)
