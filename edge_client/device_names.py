"""The device names ``--device`` and ``eval.device`` take, checked without torch.

Apart from :mod:`edge_client.device`, which imports torch, so that a configuration is checked before
torch loads; only a device torch must look for (``cuda``, ``mps``) needs torch to check.
"""

from __future__ import annotations

from storage.errors import FedgeError

__all__ = ["DEVICES", "DeviceError", "device_kind", "LOOKED_FOR"]

DEVICES = ("auto", "cpu", "cuda", "mps")
LOOKED_FOR = ("cuda", "mps")   # kinds torch must find (edge_client.device.resolve_device); auto falls back to the CPU


class DeviceError(FedgeError, ValueError):
    """The requested device is not usable by this torch; the message says what to install or pick."""


def device_kind(name: str) -> str:
    """The kind of device ``name`` is (``cuda`` for ``cuda:1``); DeviceError for a name fedge does not know."""
    kind, _, index = name.partition(":")
    if kind not in DEVICES or (index and (kind != "cuda" or not index.isdigit())):
        raise DeviceError(f"unknown device {name!r}; choose one of {', '.join(DEVICES)} (or cuda:N)")
    return kind

