"""The device names ``--device`` and ``eval.device`` take, checked without torch.

Apart from :mod:`edge_client.device`, which imports torch, so that a configuration is checked before
torch loads; torch is imported here only for a device it must look for (``cuda``, ``mps``).
"""

from __future__ import annotations

from storage.errors import FedgeError

__all__ = ["DEVICES", "DeviceError", "device_kind", "check_device"]

DEVICES = ("auto", "cpu", "cuda", "mps")


class DeviceError(FedgeError, ValueError):
    """The requested device is not usable by this torch; the message says what to install or pick."""


def device_kind(name: str) -> str:
    """The kind of device ``name`` is (``cuda`` for ``cuda:1``); DeviceError for a name fedge does not know."""
    kind, _, index = name.partition(":")
    if kind not in DEVICES or (index and (kind != "cuda" or not index.isdigit())):
        raise DeviceError(f"unknown device {name!r}; choose one of {', '.join(DEVICES)} (or cuda:N)")
    return kind


def check_device(name: str) -> None:
    """DeviceError unless this process can use device ``name``: ``auto`` and ``cpu`` always can, the others
    are looked for through torch (:func:`edge_client.device.resolve_device`)."""
    if device_kind(name) in ("auto", "cpu"):
        return
    from edge_client.device import resolve_device

    resolve_device(name)
