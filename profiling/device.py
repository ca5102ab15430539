"""Facts about the device a client runs on, sent once in its hello message.

Nothing here imports torch or onnxruntime: versions come from the installed
packages' metadata, and torch's thread count only when the process already uses
torch. So ``fedge-profile infer`` can record the same facts on a device that has
ONNX Runtime but no torch.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from typing import Any

import psutil

from profiling.memory import battery, memory_available_bytes, memory_total_bytes

__all__ = ["device_facts", "device_labels"]

_LABEL_CHARS = 64


def _cpu_model() -> str:
    """The CPU's marketing name where Linux tells it (``platform.processor`` is often empty)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _board() -> str | None:
    """The board's name from the device tree ("Raspberry Pi 4 Model B Rev 1.4", Jetsons); None on PCs."""
    try:
        with open("/proc/device-tree/model", encoding="utf-8", errors="replace") as fh:
            return fh.read().strip("\0\n ") or None
    except OSError:
        return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpu_max_mhz() -> float | None:
    try:
        freq = psutil.cpu_freq()
    except (AttributeError, OSError, NotImplementedError):
        return None
    return float(freq.max) if freq is not None and freq.max else None


def device_facts() -> dict[str, Any]:
    """Architecture, board, CPU, cores, RAM, OS and library versions; absent ones are None.

    ``ram_bytes`` is the host's memory as the OS reports it; inside a container with
    a memory limit the limit is lower, and ``memory_total_bytes`` / ``memory_available_bytes``
    say what this process may use (the cgroup's limit when it is lower). ``battery_percent`` and
    ``power_plugged`` only where the device has a battery. ``device_class`` and ``site`` are what the
    variables ``FEDGE_DEVICE_CLASS`` and ``FEDGE_SITE`` say, for grouping a fleet.
    """
    torch = sys.modules.get("torch")
    return {
        "arch": platform.machine(),
        "board": _board(),
        "cpu_model": _cpu_model(),
        "cpu_max_mhz": _cpu_max_mhz(),
        "cores": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "memory_total_bytes": memory_total_bytes(),
        "memory_available_bytes": memory_available_bytes(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "onnxruntime": _version("onnxruntime"),
        # the operator's own grouping, for the coordinator's metrics and status (docs/monitoring.md)
        "device_class": os.environ.get("FEDGE_DEVICE_CLASS") or None,
        "site": os.environ.get("FEDGE_SITE") or None,
        **battery(),
    }


def _label(value: Any) -> str:
    """A device's own words made safe to show and to use as a metric label: printable, at most 64 characters."""
    if not isinstance(value, str):
        return ""
    return "".join(ch for ch in value if ch.isprintable()).strip()[:_LABEL_CHARS]


def device_labels(device: Any) -> tuple[str, str]:
    """The class and site of a device, from the facts it announced (anything: they come over the network).

    The class is what the device says it is (``device_class``, from ``FEDGE_DEVICE_CLASS`` on the device),
    else its board ("Raspberry Pi 4 Model B Rev 1.4"), else its architecture, else "unknown"; the site is
    its ``site`` (``FEDGE_SITE``), else "". The metrics endpoint and ``fedge-coordinator status`` group by them.
    """
    facts = device if isinstance(device, dict) else {}
    klass = next((text for key in ("device_class", "board", "arch") if (text := _label(facts.get(key)))), "")
    return klass or "unknown", _label(facts.get("site"))
