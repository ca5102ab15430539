"""The fleet file: device classes, how many of each, and what the OS will enforce for each device.

A class names a relative CPU ``speed`` (1.0 = the slowest board the file calibrates against), a
``memory`` cap, ``uplink``/``downlink`` rates, an ``availability`` pattern and an optional
``throttle`` pattern. The CPU share a device gets is ``speed * cpu_scale`` of one core: the
machine running the lab is shared by every device, so ``cpu_scale`` (file, or ``--cpu-scale``)
shrinks the published speeds until the devices that train at once fit its cores.
Latency and loss are not in the format: the lab's kernels have no ``netem``.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["FleetError", "Availability", "Throttle", "Device", "Fleet", "load_fleet", "parse_size", "parse_rate", "torch_threads"]


class FleetError(ValueError):
    """A fleet file that cannot be used; the message names the key to fix."""


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.I)
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)bit\s*$", re.I)
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_RATE_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3}
_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,30}$")


def parse_size(text: Any, where: str) -> int:
    """Bytes of "512M", "2G", "1.5G" (binary units) or a plain integer."""
    if isinstance(text, int) and text > 0:
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise FleetError(f"{where}: {text!r} is not a size; write e.g. \"512M\" or \"4G\"")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_rate(text: Any, where: str) -> int:
    """Bits per second of "20mbit", "500kbit" (decimal units, as tc reads them)."""
    match = _RATE.match(str(text))
    if not match or float(match.group(1)) <= 0:
        raise FleetError(f"{where}: {text!r} is not a rate; write e.g. \"20mbit\" or \"500kbit\"")
    return int(float(match.group(1)) * _RATE_UNITS[match.group(2).lower()])


@dataclass(frozen=True)
class Availability:
    """``always``; ``intermittent`` (online and offline spells, exponential means, seeded); ``offline``
    (explicit ``windows`` of [start_s, end_s] since the policy's start)."""
    kind: str = "always"
    online_mean_s: float = 0.0
    offline_mean_s: float = 0.0
    windows: tuple[tuple[float, float], ...] = ()

    @property
    def offline_fraction(self) -> float:
        """The long-run share of time offline (windows: not counted, they end)."""
        if self.kind != "intermittent":
            return 0.0
        return self.offline_mean_s / (self.online_mean_s + self.offline_mean_s)


@dataclass(frozen=True)
class Throttle:
    """Every ``every_s`` seconds the CPU quota drops to ``fraction`` of the device's share for ``for_s``."""
    every_s: float
    for_s: float
    fraction: float


@dataclass(frozen=True)
class Device:
    id: str                      # also the client id
    klass: str
    index: int                   # position in the fleet: names its interfaces and data partition
    speed: float
    cpu_share: float             # fraction of one core, after cpu_scale
    memory_bytes: int
    uplink_bps: int
    downlink_bps: int
    availability: Availability
    throttle: Throttle | None


@dataclass(frozen=True)
class Fleet:
    name: str
    cpu_scale: float
    devices: tuple[Device, ...]

    @property
    def classes(self) -> list[str]:
        return list(dict.fromkeys(d.klass for d in self.devices))

    def expected_offline_fraction(self) -> float:
        return sum(d.availability.offline_fraction for d in self.devices) / len(self.devices)

    def busiest_cpu(self, at_once: int) -> float:
        """Cores the ``at_once`` fastest devices need when they all train together (the worst case)."""
        return sum(sorted((d.cpu_share for d in self.devices), reverse=True)[:at_once])


def _availability(raw: Any, where: str) -> Availability:
    raw = {"kind": "always"} if raw is None else raw
    if isinstance(raw, str):
        raw = {"kind": raw}
    if not isinstance(raw, dict):
        raise FleetError(f"{where}.availability: give a table, e.g. {{ kind = \"always\" }}")
    kind = raw.get("kind", "always")
    if kind == "always":
        return Availability()
    if kind == "intermittent":
        on, off = raw.get("online_mean_s"), raw.get("offline_mean_s")
        if not all(isinstance(v, (int, float)) and v > 0 for v in (on, off)):
            raise FleetError(f"{where}.availability: intermittent needs online_mean_s and offline_mean_s > 0")
        return Availability(kind, float(on), float(off))
    if kind == "offline":
        windows = raw.get("windows")
        ok = isinstance(windows, list) and all(isinstance(w, list) and len(w) == 2 and 0 <= w[0] < w[1]
                                               for w in windows)
        if not ok:
            raise FleetError(f"{where}.availability: offline needs windows = [[START_S, END_S], ...], start < end")
        return Availability(kind, windows=tuple((float(a), float(b)) for a, b in sorted(windows)))
    raise FleetError(f"{where}.availability.kind {kind!r}: use always, intermittent or offline")


def _throttle(raw: Any, where: str) -> Throttle | None:
    if raw is None:
        return None
    try:
        t = Throttle(float(raw["every_s"]), float(raw["for_s"]), float(raw["fraction"]))
    except (TypeError, KeyError, ValueError):
        raise FleetError(f"{where}.throttle: give {{ every_s = S, for_s = S, fraction = F }}") from None
    if not (0 < t.for_s < t.every_s and 0 < t.fraction < 1):
        raise FleetError(f"{where}.throttle: need 0 < for_s < every_s and 0 < fraction < 1")
    return t


def _class_devices(name: str, raw: dict[str, Any], scale: float, start: int) -> list[Device]:
    where = f"classes.{name}"
    if not _ID.match(name):
        raise FleetError(f"{where}: class names are lower-case letters, digits and '-' (up to 31)")
    count, speed = raw.get("count", 1), raw.get("speed")
    if not isinstance(count, int) or count < 1:
        raise FleetError(f"{where}.count: a whole number of devices, at least 1")
    if not isinstance(speed, (int, float)) or speed <= 0:
        raise FleetError(f"{where}.speed: the relative CPU speed, a number > 0")
    share = speed * scale
    if share * 100_000 < 1000:   # cfs_quota_us cannot go below 1 ms per 100 ms period
        raise FleetError(f"{where}: speed x cpu_scale = {share:.4f} of a core is below the kernel's minimum "
                         "quota (0.01 of a core): raise cpu_scale")
    common = dict(klass=name, speed=float(speed), cpu_share=share,
                  memory_bytes=parse_size(raw.get("memory", "1G"), f"{where}.memory"),
                  uplink_bps=parse_rate(raw.get("uplink", "100mbit"), f"{where}.uplink"),
                  downlink_bps=parse_rate(raw.get("downlink", "100mbit"), f"{where}.downlink"),
                  availability=_availability(raw.get("availability"), where),
                  throttle=_throttle(raw.get("throttle"), where))
    return [Device(id=f"{name}-{i + 1:02d}", index=start + i, **common) for i in range(count)]


def load_fleet(path: Path, cpu_scale: float | None = None) -> Fleet:
    """Read and check a fleet file; ``cpu_scale`` overrides the file's."""
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise FleetError(f"fleet file {path}: {exc}") from None
    scale = cpu_scale if cpu_scale is not None else raw.get("cpu_scale", 1.0)
    if not isinstance(scale, (int, float)) or not 0 < scale <= 64:
        raise FleetError("cpu_scale: cores of this machine per unit of speed, a number in (0, 64]")
    classes = raw.get("classes")
    if not isinstance(classes, dict) or not classes:
        raise FleetError(f"fleet file {path}: no [classes.NAME] tables")
    devices: list[Device] = []
    for name, body in classes.items():
        if not isinstance(body, dict):
            raise FleetError(f"classes.{name}: a table of speed, memory, uplink, downlink, availability, count")
        devices += _class_devices(name, body, float(scale), len(devices))
    if len(devices) > 200:
        raise FleetError(f"{len(devices)} devices: the lab's /24 holds at most 200")
    return Fleet(name=Path(path).stem, cpu_scale=float(scale), devices=tuple(devices))


def torch_threads(device: Device) -> int:
    """Threads a device's torch may use: its share rounded up (a share above one core needs more than one)."""
    return max(1, math.ceil(device.cpu_share - 1e-9))
