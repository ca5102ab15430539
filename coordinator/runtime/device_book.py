"""What the coordinator knows of each device from its own reports: speed, memory, heat and battery.

Every answer to a task brings the device's profile (checked by
:func:`profiling.schema.clean_profile`) and every hello its device facts (checked by
:func:`profiling.schema.clean_device_facts`). :class:`DeviceBook` keeps, per device:

- its seconds per training sample (the inverse of the profile's ``samples_per_second``) and the rest
  of its round time (decoding, transfer, queueing: the round time the coordinator measured minus
  the training steps), each an exponentially weighted mean (:data:`EWMA`) of its answers, so a device
  that got faster or slower shows it within a few rounds;
- the peak resident memory it measured per model size (parameter count), the memory it may use and
  has available (the cgroup's limit inside a container), and the model sizes it refused for
  memory (a ``memory:`` error): it is not given a task on a model that size or larger again until
  it announces itself with other memory facts;
- its latest temperature, throttling flags and battery, for resting a hot or discharging device;
- its statistical utility of its last participation (Oort: the number of samples times the root of
  the mean squared per-sample loss, the result's ``train_loss_sq``), and the round it was last
  selected in and how many times it was selected;
- its presence history (:class:`~coordinator.runtime.availability.PresenceHistory`): its online sessions.

The book is JSON (:meth:`DeviceBook.saved`), kept in the run's checkpoint (``ServerState.extra["selection"]``),
so a resumed run selects as knowingly as the run it continues.

Nothing here decides: :mod:`coordinator.runtime.profile_selection` reads the book.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from coordinator.runtime.availability import PresenceHistory
from edge_client.memory_guard import REFUSAL_PREFIX, estimate_task_bytes
from edge_client.registry import build_aside
from profiling.schema import clean_device_facts

__all__ = ["DeviceBook", "DeviceRecord", "ModelSize", "EWMA", "BOOK_EXTRA"]

EWMA = 0.5   # weight of the newest answer in the running means
BOOK_EXTRA = "selection"   # the key of ServerState.extra the book is checkpointed under


@dataclass(frozen=True)
class ModelSize:
    """The model tasks train now: its parameter count (the size memory is judged by) and the bytes a
    training task on it needs by the device's own estimate (:func:`edge_client.memory_guard.estimate_task_bytes`)."""

    parameters: int
    estimate_bytes: int

    @classmethod
    def of(cls, spec: Mapping[str, Any], batch_size: int) -> ModelSize:
        return _model_size(json.dumps(spec, sort_keys=True), batch_size)


@functools.lru_cache(maxsize=16)
def _model_size(spec: str, batch_size: int) -> ModelSize:
    """Counting builds the network: once per spec, not at every answer."""
    model = build_aside(json.loads(spec))
    return ModelSize(sum(p.numel() for p in model.parameters()), estimate_task_bytes(model, json.loads(spec),
                                                                                    batch_size))


@dataclass
class DeviceRecord:
    """One device's book; every reading absent (None) until the device reports it."""

    seconds_per_sample: float | None = None
    overhead_seconds: float | None = None      # round time beyond the training steps
    samples: int | None = None                 # samples the last training task stepped through
    peaks: dict[int, int] = field(default_factory=dict)   # parameters -> peak RSS measured
    refused_at: int | None = None              # smallest model size refused for memory
    memory_total: int | None = None
    memory_available: int | None = None
    temperature_c: float | None = None
    throttled_now: list[str] = field(default_factory=list)
    battery_percent: float | None = None
    power_plugged: bool | None = None
    utility: float | None = None               # |B| * sqrt(mean squared loss) of its last training
    last_selected: int | None = None           # round
    picks: int = 0                             # times selected in the run
    rested_until: int = 0                      # rested while the round is below this
    fresh: bool = False                        # readings came that selection has not judged yet


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else EWMA * new + (1 - EWMA) * old


class DeviceBook:
    """Per-device knowledge from profiles and hellos; ``model()`` gives the model tasks train now."""

    def __init__(self, model: Callable[[], ModelSize | None] = lambda: None) -> None:
        self.model = model
        self.devices: dict[str, DeviceRecord] = {}
        self.presence = PresenceHistory()

    def record(self, client_id: str) -> DeviceRecord:
        return self.devices.setdefault(client_id, DeviceRecord())

    def saved(self) -> dict[str, Any]:
        """The book as JSON: every record (bar whether selection judged its latest readings) and the presence."""
        devices = {}
        for c, rec in sorted(self.devices.items()):
            row = dataclasses.asdict(rec)
            row.pop("fresh")
            row["peaks"] = {str(k): v for k, v in rec.peaks.items()}
            devices[c] = row
        return {"devices": devices, "presence": self.presence.saved()}

    def restore(self, saved: Any) -> None:
        """Take back a book :meth:`saved` wrote (from a checkpoint); anything else leaves the book empty."""
        if not isinstance(saved, Mapping):
            return
        names = {f.name for f in dataclasses.fields(DeviceRecord)} - {"fresh"}
        devices = saved.get("devices")
        for c, row in (devices.items() if isinstance(devices, Mapping) else ()):
            if isinstance(row, Mapping):
                rec = DeviceRecord(**{k: v for k, v in row.items() if k in names})
                rec.peaks = {int(k): int(v) for k, v in (row.get("peaks") or {}).items()}
                rec.throttled_now = list(rec.throttled_now or [])
                self.devices[str(c)] = rec
        if isinstance(saved.get("presence"), Mapping):
            self.presence.restore(saved["presence"])

    def hello(self, client_id: str, raw_facts: Any) -> None:
        """A device announced itself with these facts (unchecked, from the network)."""
        facts, rec = clean_device_facts(raw_facts), self.record(client_id)
        if facts["memory_total_bytes"] != rec.memory_total:
            rec.refused_at = None   # other memory: what it refused may fit now
        rec.memory_total = facts["memory_total_bytes"]
        rec.memory_available = facts["memory_available_bytes"]
        if facts["battery_percent"] is not None:
            rec.battery_percent, rec.power_plugged = facts["battery_percent"], facts["power_plugged"]

    def answered(self, client_id: str, round_seconds: float, profile: Mapping[str, Any],
                 metrics: Mapping[str, float], num_samples: int, error: str | None) -> None:
        """A first answer to a task: its measured round time, checked profile, metrics and error."""
        rec, model = self.record(client_id), self.model()
        if error is not None and error.startswith(REFUSAL_PREFIX) and model is not None:
            rec.refused_at = min(model.parameters, rec.refused_at or model.parameters)
        self._readings(rec, profile)
        if error is not None:
            return
        speed, samples = profile.get("samples_per_second"), profile.get("samples")
        if speed and samples:
            rec.seconds_per_sample = _ewma(rec.seconds_per_sample, 1.0 / speed)
            rec.samples = samples
            rec.overhead_seconds = _ewma(rec.overhead_seconds, max(0.0, round_seconds - samples / speed))
            peak = profile.get("peak_rss_bytes")
            if model is not None and peak:
                rec.peaks[model.parameters] = peak
        loss_sq = metrics.get("train_loss_sq")
        if loss_sq is not None and math.isfinite(loss_sq) and loss_sq >= 0 and num_samples > 0:
            rec.utility = num_samples * math.sqrt(loss_sq)

    @staticmethod
    def _readings(rec: DeviceRecord, profile: Mapping[str, Any]) -> None:
        """The device's state as its latest profile says; a reading it did not take leaves the old one."""
        rec.fresh = True
        rec.temperature_c = profile.get("temperature_c", rec.temperature_c)
        throttled = profile.get("throttled")
        rec.throttled_now = list(throttled["now"]) if isinstance(throttled, dict) else []
        if profile.get("memory_available_bytes") is not None:
            rec.memory_available = profile["memory_available_bytes"]
        if profile.get("battery_percent") is not None:
            rec.battery_percent, rec.power_plugged = profile["battery_percent"], profile.get("power_plugged")

    def completion_seconds(self, client_id: str) -> float | None:
        """Samples times seconds per sample plus the rest of its round time; None for a device never heard from."""
        rec = self.devices.get(client_id)
        if rec is None or rec.seconds_per_sample is None or rec.samples is None:
            return None
        return rec.samples * rec.seconds_per_sample + (rec.overhead_seconds or 0.0)

    def memory_problem(self, client_id: str, margin: float) -> str:
        """Why the current model does not fit the device ('' when it fits or nothing is known)."""
        rec, model = self.devices.get(client_id), self.model()
        if rec is None or model is None:
            return ""
        if rec.refused_at is not None and model.parameters >= rec.refused_at:
            return f"it refused a model of {rec.refused_at:,} parameters for memory"
        peak = rec.peaks.get(model.parameters)
        if peak is not None and rec.memory_total is not None and peak * margin > rec.memory_total:
            return f"its measured peak {peak:,} B x {margin} exceeds its memory {rec.memory_total:,} B"
        if peak is None and rec.memory_available is not None and model.estimate_bytes * margin > rec.memory_available:
            return (f"the estimate {model.estimate_bytes:,} B x {margin} exceeds its available memory "
                    f"{rec.memory_available:,} B")
        return ""
