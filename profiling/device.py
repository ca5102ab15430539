"""Facts about the device a client runs on, sent once in its hello message."""

from __future__ import annotations

import os
import platform
from typing import Any

import psutil

__all__ = ["device_facts"]


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


def device_facts() -> dict[str, Any]:
    """Architecture, CPU, cores, RAM, OS and library versions; absent ones are None."""
    facts: dict[str, Any] = {
        "arch": platform.machine(),
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": None,
        "torch_threads": None,
        "onnxruntime": None,
    }
    try:
        import torch

        facts["torch"] = torch.__version__
        facts["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    try:
        import onnxruntime

        facts["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    return facts
