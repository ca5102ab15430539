"""Reading what runs and devices recorded, and the per-device figures every report shows.

Two kinds of input, both JSON lines:

- a run directory the coordinator wrote: ``metrics.jsonl`` (one row per round),
  ``summary.json``, ``config.toml``, ``presence.jsonl`` (when each client came online
  and went offline), and per client ``clients/ID.jsonl`` (one line per answered task:
  round, time, round time, late, error, profile) plus ``clients/ID.json`` (latest
  profile and the device facts) and, for a client whose state directory is
  ``clients/ID/``, the ``infer`` lines of its ``profile.jsonl``;
- a device's own history, ``STATE_DIR/profile.jsonl`` (``task`` lines with the client
  id and the profile fields at the top level, ``infer`` lines from ``fedge-profile
  infer``; the state directory itself names it too), or a single ``clients/ID.jsonl``.

Both are turned into :class:`TaskRecord` lists, so :func:`device_stats` computes the
same figures for the terminal and the HTML report. Everything read is checked with
:func:`~profiling.schema.clean_profile`: a report must not crash on a bad line.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from profiling.errors import ProfileError
from profiling.history import HISTORY_FILE
from profiling.profiler import STEP_PHASES, TASK_PHASES
from profiling.schema import clean_profile
from storage.files import read_jsonl

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["ReportError", "TaskRecord", "Device", "RunRecords", "DeviceStats", "Metric", "ACCURACY", "load",
           "device_stats", "task_kinds", "straggler_ranks", "slowest_first", "task_breakdown", "part_names",
           "BREAKDOWN"]

# The parts a task's time is shown in, in order. `train_other` is the local objective's
# time outside the four step phases (setup, shuffling, reading the loss).
BREAKDOWN = ("receive", "decode", *STEP_PHASES, "train_other", "encode", "publish")


class ReportError(ProfileError):
    """The path is not a run directory or a profile file; the message says what was expected."""


@dataclass(frozen=True)
class TaskRecord:
    """One task a device ran: its profile, and what the coordinator saw of it (when known)."""

    round: int | None
    task_id: str | None
    profile: dict[str, Any]
    round_seconds: float | None = None    # coordinator: task sent -> result received
    late: bool = False
    error: str | None = None
    run_id: str | None = None
    missed: bool = False                  # no answer by the end of its attempt: round_seconds is the timeout
    objective: str | None = None          # what the task ran (train, evaluate, ...); None in older records
    time: float | None = None             # when the answer came (Unix time); None in older records


@dataclass(frozen=True)
class Metric:
    """A figure a run is judged by, as its rows hold it (``test_NAME``)."""

    name: str
    higher_is_better: bool | None = True   # None: not known (an app's run whose summary.json is not written yet)

    @property
    def column(self) -> str:
        return f"test_{self.name}"


ACCURACY = Metric("accuracy")   # fedge's own networks' headline


@dataclass
class Device:
    client_id: str
    facts: dict[str, Any] | None = None
    tasks: list[TaskRecord] = field(default_factory=list)
    inference: list[dict[str, Any]] = field(default_factory=list)   # `infer` lines of a device history


@dataclass
class RunRecords:
    source: Path
    rounds: list[dict[str, Any]] = field(default_factory=list)      # metrics.jsonl rows
    summary: dict[str, Any] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    devices: dict[str, Device] = field(default_factory=dict)
    presence: list[dict[str, Any]] = field(default_factory=list)    # presence.jsonl: time, client_id, state

    @property
    def is_run(self) -> bool:
        return bool(self.rounds) or self.summary is not None

    @property
    def training_objectives(self) -> set[str] | None:
        """Objectives that ran optimizer steps: the round times and phases reports are about.

        Evaluation or statistics tasks are short and would pull a device's figures down.
        None when no record names its objective (older runs): then every task counts.
        """
        found = {t.objective for d in self.devices.values() for t in d.tasks
                 if t.objective is not None and (t.profile.get("steps") or 0) > 0}
        return found or None

    def training_tasks(self, device: Device) -> list[TaskRecord]:
        objectives = self.training_objectives
        return [t for t in device.tasks if objectives is None or t.objective is None or t.objective in objectives]

    def stats(self) -> list["DeviceStats"]:
        """Each device's figures: counts and peaks over every task it was given, times over its training tasks."""
        return [device_stats(d, self.training_tasks(d)) for d in self.devices.values()]

    @property
    def headline_metrics(self) -> list[Metric]:
        """What the run is judged by: accuracy for fedge's own networks; for a run on an app, the headline its
        summary names with its direction, or, while the run goes (no summary yet), every metric its rows hold:
        which one is the headline only the app knows, and reports do not import apps."""
        summary = self.summary or {}
        if isinstance(summary.get("headline"), str):
            return [Metric(summary["headline"], summary.get("higher_is_better") is not False)]
        app = self.config.get("app")
        if not isinstance(app, dict) or app.get("module", "") in ("", "vision"):   # fedge's own networks
            return [ACCURACY]
        names = dict.fromkeys(key[len("test_"):] for row in self.rounds for key in row
                              if key.startswith("test_") and key != "test_loss")
        return [Metric(name, None) for name in names]

    @property
    def round_timeout(self) -> float | None:
        value = self.config.get("clients", {}).get("round_timeout")
        return float(value) if isinstance(value, (int, float)) else None


# -- loading --------------------------------------------------------------------
def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _coordinator_record(line: dict[str, Any]) -> TaskRecord:
    return TaskRecord(round=_int(line.get("round")), task_id=_text(line.get("task_id")),
                      profile=clean_profile(line.get("profile")), round_seconds=_float(line.get("round_seconds")),
                      late=line.get("late") is True, error=_text(line.get("error")), missed=line.get("missed") is True,
                      objective=_text(line.get("objective")), time=_float(line.get("time")))


def _latest_per_task(records: list[TaskRecord]) -> list[TaskRecord]:
    """A late answer replaces the `missed` line of the same task (in the missed line's place)."""
    by_task: dict[Any, TaskRecord] = {}
    for i, record in enumerate(records):
        by_task[record.task_id if record.task_id is not None else ("line", i)] = record
    return list(by_task.values())


def _history_record(line: dict[str, Any]) -> TaskRecord:
    return TaskRecord(round=_int(line.get("round")), task_id=_text(line.get("task_id")),
                      profile=clean_profile(line), run_id=_text(line.get("run_id")),
                      objective=_text(line.get("objective")), time=_float(line.get("time")))


def _with_send_times(tasks: list[TaskRecord]) -> list[TaskRecord]:
    """Give each task the encode and publish times its device reported with the next result."""
    sent = {}
    for task in tasks:
        previous = task.profile.get("previous_send")
        if isinstance(previous, dict) and previous.get("task_id"):
            sent[previous["task_id"]] = {k: v for k, v in previous.items() if k in ("encode", "publish")}
    out = []
    for task in tasks:
        phases = dict(task.profile.get("phases") or {})
        for name, value in sent.get(task.task_id, {}).items():
            phases.setdefault(name, value)
        out.append(dataclasses.replace(task, profile={**task.profile, "phases": phases}))
    return out


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def _history_client_id(rows: list[dict[str, Any]]) -> str | None:
    """The client id a device's history names (its latest task line's ``client_id``): a device's state
    directory is often named for the service (``fedge-state``, ``/var/lib/fedge``), not for the device.
    None in histories written before the client recorded it."""
    ids = [r["client_id"] for r in rows if r.get("kind", "task") == "task" and isinstance(r.get("client_id"), str)
           and r["client_id"]]
    return ids[-1] if ids else None


def _load_history_file(path: Path) -> RunRecords:
    rows = read_jsonl(path)
    records = RunRecords(source=path)
    if path.parent.name == "clients" and path.suffix == ".jsonl":   # the coordinator's clients/ID.jsonl
        client_id = path.stem
        latest = _read_json(path.with_suffix(".json"))
        device = Device(client_id, latest.get("device") if isinstance(latest, dict) else None)
        device.tasks = _with_send_times(_latest_per_task([_coordinator_record(r) for r in rows]))
    else:                                                             # a device's own profile.jsonl
        device = Device(_history_client_id(rows) or path.parent.name or path.stem)
        device.tasks = _with_send_times([_history_record(r) for r in rows if r.get("kind", "task") == "task"])
        device.inference = _inference_lines(rows)
        facts = [r.get("device") for r in device.inference if isinstance(r.get("device"), dict)]
        device.facts = facts[-1] if facts else None
    records.devices[device.client_id] = device
    return records


def _inference_lines(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``infer`` lines of a device history, each result kept only when its figures are numbers (a report
    computes with them)."""
    out = []
    for row in rows:
        if row.get("kind") != "infer":
            continue
        given = row.get("results") if isinstance(row.get("results"), list) else []
        results = [r for r in given if isinstance(r, dict) and (_int(r.get("batch")) or 0) > 0
                   and all(_float(r.get(k)) is not None for k in ("p50", "p95", "p99", "samples_per_second"))]
        out.append({**row, "results": results})
    return out


def _presence_lines(path: Path) -> list[dict[str, Any]]:
    """``presence.jsonl``: the lines with a time, a client id and a state of online or offline."""
    if not path.is_file():
        return []
    return [{"time": float(r["time"]), "client_id": r["client_id"], "state": r["state"]} for r in read_jsonl(path)
            if _float(r.get("time")) is not None and _text(r.get("client_id"))
            and r.get("state") in ("online", "offline")]


def _load_run_dir(path: Path) -> RunRecords:
    records = RunRecords(source=path)
    metrics = path / "metrics.jsonl"
    if metrics.is_file():
        records.rounds = [r for r in read_jsonl(metrics) if _int(r.get("round")) is not None]
    summary = _read_json(path / "summary.json")
    records.summary = summary if isinstance(summary, dict) else None
    try:
        records.config = tomllib.loads((path / "config.toml").read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError):
        records.config = {}
    clients = path / "clients"
    for latest_path in sorted(clients.glob("*.json")) if clients.is_dir() else []:
        history = latest_path.with_suffix(".jsonl")
        if history.is_file():
            device = next(iter(_load_history_file(history).devices.values()))
        else:   # a run from before per-round records: only the latest profile
            latest = _read_json(latest_path)
            latest = latest if isinstance(latest, dict) else {}
            device = Device(latest_path.stem, latest.get("device") if isinstance(latest.get("device"), dict) else None,
                            [_coordinator_record(latest)])
        own = clients / device.client_id / HISTORY_FILE   # a spawned client's state directory, or one put there
        if own.is_file():
            device.inference = _inference_lines(read_jsonl(own))
        records.devices[device.client_id] = device
    records.presence = _presence_lines(path / "presence.jsonl")
    if not records.is_run and not records.devices:
        raise ReportError(f"{path} holds no metrics.jsonl, summary.json or clients/*.json; "
                          "pass a run directory (the coordinator's --out), a device's state directory "
                          "or its profile.jsonl")
    return records


def _is_state_dir(path: Path) -> bool:
    """A device's state directory: its profile history, none of a run directory's files."""
    return (path / HISTORY_FILE).is_file() and not any(
        (path / name).exists() for name in ("metrics.jsonl", "summary.json", "clients"))


def load(path: Path) -> RunRecords:
    """A run directory, a device's state directory or its ``profile.jsonl``, or a ``clients/ID.jsonl``."""
    if path.is_dir():
        return _load_history_file(path / HISTORY_FILE) if _is_state_dir(path) else _load_run_dir(path)
    if path.is_file():
        return _load_history_file(path)
    raise ReportError(f"{path} does not exist; pass a run directory, a device's state directory "
                      "or a profile.jsonl file")


# -- figures --------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceStats:
    """What a report shows for one device; None where no task had the reading."""

    client_id: str
    tasks: int                             # every task, of whatever kind
    late: int
    missed: int                            # never answered (while the run lasted)
    errors: int
    median_round_seconds: float | None     # coordinator-measured (missed: the timeout); else the device's time
    median_device_seconds: float | None
    breakdown: dict[str, float]            # mean seconds per part of a task (BREAKDOWN order)
    step_p50: float | None
    step_p95: float | None
    step_max: float | None
    samples_per_second: float | None
    peak_rss_bytes: int | None
    peak_uss_bytes: int | None
    cpu_percent: float | None
    temperature_c: float | None
    throttled: list[str] | None            # flags seen since boot in any task; None: no vcgencmd
    train_device: str | None = None        # torch device(s) the tasks ran on ("cpu", "cuda:0"); None: not said
    gpu_peak_bytes: int | None = None      # largest GPU memory torch allocated in a task (CUDA only)
    gpu_temperature_c: float | None = None  # hottest GPU-therm reading (Jetson only)
    kinds: dict[str, int] = field(default_factory=dict)   # tasks by objective (train, evaluate, a method's own, ...)


def _values(tasks: Iterable[TaskRecord], key: str) -> list[Any]:
    return [t.profile[key] for t in tasks if t.profile.get(key) is not None]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def task_breakdown(profile: dict[str, Any]) -> dict[str, float]:
    """Seconds of each part of one task: :data:`BREAKDOWN` order, then any other phase the client reported."""
    phases, steps = profile.get("phases") or {}, profile.get("train_phases") or {}
    parts = {name: phases[name] for name in ("receive", "decode", "encode", "publish") if name in phases}
    parts.update({name: steps[name] for name in STEP_PHASES if name in steps})
    if "train" in phases:
        parts["train_other"] = max(0.0, phases["train"] - sum(steps.get(n, 0.0) for n in STEP_PHASES))
    extra = {name: v for name, v in phases.items() if name not in TASK_PHASES}   # e.g. waiting for a model
    return {**{name: parts[name] for name in BREAKDOWN if name in parts}, **extra}


def part_names(breakdowns: Iterable[dict[str, float]]) -> list[str]:
    """The parts present in any of ``breakdowns``, in :data:`BREAKDOWN` order, other phases last."""
    present = {name for b in breakdowns for name in b}
    return [n for n in BREAKDOWN if n in present] + sorted(present - set(BREAKDOWN))


def _breakdown(tasks: list[TaskRecord]) -> dict[str, float]:
    per_task = [task_breakdown(t.profile) for t in tasks]
    means = {name: [parts[name] for parts in per_task if name in parts] for name in part_names(per_task)}
    return {name: statistics.fmean(v) for name, v in means.items() if v}


def task_kinds(tasks: Iterable[TaskRecord]) -> dict[str, int]:
    """How many of ``tasks`` ran each objective, most frequent first; {} when no record names one (older runs)."""
    counts = Counter(t.objective or "other" for t in tasks)
    return {} if set(counts) == {"other"} else dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def device_stats(device: Device, training: list[TaskRecord] | None = None) -> DeviceStats:
    """A device's figures. Counts and peaks (memory, temperature, throttling) are over every task it was
    given: a calibration or evaluation task that peaks higher than training is what sizes a board. Times,
    rates and the phase breakdown are over ``training`` (default: every task), which reports pass as the
    run's training tasks, so that short evaluation tasks do not pull the medians down."""
    every = device.tasks
    training = every if training is None else training
    round_times = [t.round_seconds for t in training if t.round_seconds is not None]
    profiled = [t for t in every if t.profile]
    timed = [t for t in training if t.profile]
    device_times = _values(timed, "seconds")
    throttled = [t.profile["throttled"] for t in profiled if isinstance(t.profile.get("throttled"), dict)]
    rss, uss = _values(profiled, "peak_rss_bytes"), _values(profiled, "peak_uss_bytes")
    temps = _values(profiled, "temperature_c")
    return DeviceStats(
        client_id=device.client_id, tasks=len(every), late=sum(t.late for t in every),
        missed=sum(t.missed for t in every), errors=sum(t.error is not None for t in every),
        median_round_seconds=_median(round_times) if round_times else _median(device_times),
        median_device_seconds=_median(device_times), breakdown=_breakdown(timed),
        step_p50=_median(_values(timed, "step_p50")), step_p95=_median(_values(timed, "step_p95")),
        step_max=max(_values(timed, "step_max"), default=None),
        samples_per_second=_median(_values(timed, "samples_per_second")),
        peak_rss_bytes=max(rss) if rss else None, peak_uss_bytes=max(uss) if uss else None,
        cpu_percent=_median(_values(timed, "cpu_percent")), temperature_c=max(temps) if temps else None,
        throttled=sorted({f for t in throttled for f in t.get("since_boot", [])}) if throttled else None,
        train_device=", ".join(sorted(set(_values(timed, "device")))) or None,
        gpu_peak_bytes=max(_values(profiled, "gpu_peak_bytes"), default=None),
        gpu_temperature_c=max(_values(profiled, "gpu_temperature_c"), default=None),
        kinds=task_kinds(every),
    )


def slowest_first(times: Iterable[tuple[str, float | None]]) -> dict[str, int]:
    """Ranks of (client id, time) pairs: 1 for the longest time, 2 for the next, ...; a None time is unranked."""
    timed = sorted(((cid, t) for cid, t in times if t is not None), key=lambda pair: (-pair[1], pair[0]))
    return {cid: rank for rank, (cid, _) in enumerate(timed, start=1)}


def straggler_ranks(stats: Iterable[DeviceStats]) -> dict[str, int]:
    """1 for the device with the longest median round time, 2 for the next, ...; unranked without times."""
    return slowest_first((s.client_id, s.median_round_seconds) for s in stats)
