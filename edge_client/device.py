"""Which torch device a client trains on, and what that device can report about itself.

A Jetson's GPU does the training when the client is started with ``--device cuda`` (or
``auto``, which takes CUDA when torch sees it). Whatever the device, what goes on the
wire is CPU float tensors in the protocol's layouts: the coordinator and the other
clients never learn where a device trained.
"""

from __future__ import annotations

from pathlib import Path

import torch

from edge_client.device_names import DEVICES, DeviceError, device_kind

__all__ = ["DEVICES", "DeviceError", "resolve_device", "GpuMeter", "gpu_temperature"]

_THERMAL = Path("/sys/devices/virtual/thermal")


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def resolve_device(name: str) -> torch.device:
    """``auto``, ``cpu``, ``cuda``, ``cuda:N`` or ``mps`` as a torch device this process can use.

    ``auto`` takes CUDA when ``torch.cuda.is_available()``, else the CPU (Apple's MPS is
    not an edge device, so it is used only when asked for).
    """
    kind, index = device_kind(name), name.partition(":")[2]
    if kind == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {name!r} asked for, but this torch ({torch.__version__}) sees no CUDA GPU: on a "
                              "Jetson install NVIDIA's torch wheel for its JetPack release, or use --device cpu")
        if index and int(index) >= torch.cuda.device_count():
            raise DeviceError(f"device {name!r} asked for, but this machine has {torch.cuda.device_count()} CUDA "
                              "device(s); use cuda:0 or --device auto")
    if kind == "mps" and not _mps_available():
        raise DeviceError("device 'mps' asked for, but this torch has no usable MPS backend; use --device cpu")
    return torch.device(name)


def gpu_temperature(thermal: Path = _THERMAL) -> float | None:
    """The GPU's temperature in °C from a Jetson's ``GPU-therm`` thermal zone; None where there is none."""
    try:
        zones = sorted(thermal.glob("thermal_zone*"))
    except OSError:
        return None
    for zone in zones:
        try:
            if (zone / "type").read_text().strip().lower() == "gpu-therm":
                return int((zone / "temp").read_text().strip()) / 1000.0
        except (OSError, ValueError):
            continue
    return None


class GpuMeter:
    """What a task did on the GPU: peak memory allocated by torch, and the GPU's temperature.

    On the CPU (or MPS) it reports only the device: readings it cannot take stay absent.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def summary(self) -> dict[str, object]:
        facts: dict[str, object] = {"device": str(self.device)}
        if self.cuda:
            facts["gpu_peak_bytes"] = int(torch.cuda.max_memory_allocated(self.device))
            temperature = gpu_temperature()
            if temperature is not None:
                facts["gpu_temperature_c"] = temperature
        return facts
