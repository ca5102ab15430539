"""What a report needs to size hardware from: per device, does the model fit and how fast is it per sample.

The straggler figures (:func:`profiling.runs.device_stats`) answer "which device is slow
and why". Deciding whether a board can take a model needs other ones:

- the peak memory against the memory the device may use (``memory_total_bytes``: the
  host's, or its cgroup's limit when lower), the headroom left, and which kind of task
  set the peak: a calibration or evaluation task can need more than training, and the
  board must hold the largest;
- the time per sample trained rather than per task: a device holding twice the data
  takes twice as long per task without being any slower;
- its class and site, its traffic, when it was offline, and its ONNX Runtime
  inference benchmarks beside its training.

Everything is computed from the records :mod:`profiling.runs` loaded (checked there);
a figure no record has is None, shown as absent.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from profiling.device import device_labels
from profiling.runs import Device, RunRecords, TaskRecord, slowest_first
from profiling.schema import clean_device_facts

__all__ = ["Sizing", "InferenceSummary", "sizing", "device_sizing", "memory_total", "peaks_by_kind",
           "offline_spans", "traffic", "per_sample_ranks", "fit_order", "train_seconds", "UNNAMED_KIND"]

UNNAMED_KIND = "task"   # the kind of a task whose record does not name its objective (older runs)


@dataclass(frozen=True)
class InferenceSummary:
    """A device's latest ``fedge-profile infer`` benchmark, in a few figures (the full ones: the inference table)."""

    p50_batch1: float | None          # seconds per run at batch 1
    batch: int | None                 # the largest batch benchmarked
    samples_per_second: float | None  # at that batch
    peak_rss_bytes: int | None


@dataclass(frozen=True)
class Sizing:
    """One device's sizing figures; None where no record has them."""

    client_id: str
    device_class: str
    site: str
    memory_total_bytes: int | None
    peak_rss_bytes: int | None
    peak_kind: str | None               # the kind of task (objective) whose peak was the largest
    peak_round: int | None
    peaks: dict[str, int]               # peak RSS per kind of task, largest first
    seconds_per_sample: float | None    # median over training tasks of train_seconds / samples trained
    samples_per_task: float | None      # median samples trained per training task
    bytes_down: int | None
    bytes_up: int | None
    # (went offline, came back or the records' end); None: no presence records (a run from before they were kept)
    offline: list[tuple[float, float]] | None = None
    inference: InferenceSummary | None = None

    @property
    def headroom_bytes(self) -> int | None:
        """Memory left at the peak: ``memory_total_bytes`` - ``peak_rss_bytes`` (negative: it did not fit)."""
        if self.memory_total_bytes is None or self.peak_rss_bytes is None:
            return None
        return self.memory_total_bytes - self.peak_rss_bytes

    @property
    def offline_seconds(self) -> float | None:
        return None if self.offline is None else sum(end - start for start, end in self.offline)


def memory_total(device: Device) -> int | None:
    """What the device's process may use: the latest task profile's ``memory_total_bytes``, else its hello's,
    else its RAM (runs recorded before devices reported the first two)."""
    for task in reversed(device.tasks):
        if task.profile.get("memory_total_bytes"):
            return int(task.profile["memory_total_bytes"])
    facts = clean_device_facts(device.facts)
    return facts["memory_total_bytes"] or facts["ram_bytes"] or None


def peaks_by_kind(tasks: list[TaskRecord]) -> dict[str, tuple[int, int | None]]:
    """The largest peak RSS of each kind of task and the round it was in, largest first."""
    peaks: dict[str, tuple[int, int | None]] = {}
    for task in tasks:
        rss = task.profile.get("peak_rss_bytes")
        kind = task.objective or UNNAMED_KIND
        if rss is not None and (kind not in peaks or rss > peaks[kind][0]):
            peaks[kind] = (rss, task.round)
    return dict(sorted(peaks.items(), key=lambda kv: (-kv[1][0], kv[0])))


def offline_spans(run: RunRecords, client_id: str) -> list[tuple[float, float]]:
    """(start, end) of each time the client went offline during the run; an absence still open at the end of
    the records ends there."""
    times = [t.time for d in run.devices.values() for t in d.tasks if t.time is not None]
    times += [p["time"] for p in run.presence]
    end = max(times, default=None)
    spans: list[tuple[float, float]] = []
    left: float | None = None
    for line in sorted((p for p in run.presence if p["client_id"] == client_id), key=lambda p: p["time"]):
        if line["state"] == "offline" and left is None:
            left = line["time"]
        elif line["state"] == "online" and left is not None:
            spans.append((left, line["time"]))
            left = None
    if left is not None and end is not None:
        spans.append((left, max(left, end)))
    return spans


def traffic(run: RunRecords, client_id: str) -> tuple[int | None, int | None]:
    """Bytes the client received (its tasks, plus the model broadcast of each round it was given a task in: it
    fetches each broadcast its task names) and sent (its results) over the run, from the rounds'
    ``bytes_per_client`` and ``bytes_broadcast``; None when no round recorded them."""
    down = up = None
    for row in run.rounds:
        per_client = row.get("bytes_per_client")
        mine = per_client.get(client_id) if isinstance(per_client, dict) else None
        if not isinstance(mine, dict):
            continue
        tasks, results, broadcast = (_bytes(mine.get("down")), _bytes(mine.get("up")),
                                     _bytes(row.get("bytes_broadcast")))
        if tasks is not None:
            fetched = broadcast if tasks > 0 and broadcast is not None else 0   # with its task: once per round
            down = (down or 0) + tasks + fetched
        if results is not None:
            up = (up or 0) + results
    return down, up


def _bytes(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def train_seconds(profile: dict[str, Any]) -> float | None:
    """The time a task spent in its local objective (the ``train`` phase: the part that grows with the data),
    else the whole task's ``seconds`` (profiles without phases)."""
    phases = profile.get("phases") or {}
    return phases["train"] if "train" in phases else profile.get("seconds")


def _inference(device: Device) -> InferenceSummary | None:
    lines = [line for line in device.inference if line.get("results")]
    if not lines:
        return None
    line = lines[-1]
    results = sorted(line["results"], key=lambda r: r["batch"])
    one = next((r for r in results if r["batch"] == 1), None)
    return InferenceSummary(p50_batch1=float(one["p50"]) if one else None, batch=results[-1]["batch"],
                            samples_per_second=float(results[-1]["samples_per_second"]),
                            peak_rss_bytes=_bytes(line.get("peak_rss_bytes")))


def device_sizing(run: RunRecords, device: Device) -> Sizing:
    """The sizing figures of one device of ``run``."""
    peaks = peaks_by_kind(device.tasks)
    top = next(iter(peaks.items()), None)
    per_sample, samples = [], []
    for task in run.training_tasks(device):
        done, spent = task.profile.get("samples"), train_seconds(task.profile)
        if done and spent is not None and not task.error:
            per_sample.append(spent / done)
            samples.append(done)
    klass, site = device_labels(device.facts)
    down, up = traffic(run, device.client_id)
    return Sizing(
        client_id=device.client_id, device_class=klass, site=site, memory_total_bytes=memory_total(device),
        peak_rss_bytes=top[1][0] if top else None, peak_kind=top[0] if top else None,
        peak_round=top[1][1] if top else None, peaks={kind: rss for kind, (rss, _) in peaks.items()},
        seconds_per_sample=statistics.median(per_sample) if per_sample else None,
        samples_per_task=statistics.median(samples) if samples else None, bytes_down=down, bytes_up=up,
        offline=offline_spans(run, device.client_id) if run.presence else None, inference=_inference(device))


def sizing(run: RunRecords) -> list[Sizing]:
    """Every device's sizing figures, by client id."""
    return [device_sizing(run, run.devices[cid]) for cid in sorted(run.devices)]


def fit_order(rows: list[Sizing]) -> list[Sizing]:
    """Tightest headroom first (the order the reports list devices by memory); devices without figures last."""
    return sorted(rows, key=lambda s: (s.headroom_bytes is None, s.headroom_bytes or 0, s.client_id))


def per_sample_ranks(rows: list[Sizing]) -> dict[str, int]:
    """1 for the device slowest per sample trained, 2 for the next, ...; unranked without figures."""
    return slowest_first((s.client_id, s.seconds_per_sample) for s in rows)
