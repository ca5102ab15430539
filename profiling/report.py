"""``fedge-profile show``: the terminal report.

For a run: one row per device (median round time, step latency, throughput, peak
memory, CPU, temperature, straggler rank), the phase breakdown per device, the
sizing tables (peak memory against the device's memory and the kind of task that set
it, speed per sample, traffic, time offline, inference: :mod:`profiling.sizing`), and
one row per round (the headline metric: accuracy, or a run's app's own; bytes, slowest
client, skipped clients). For a single device's history: one row per task, whether the
model fits it, and one row per inference benchmark.

The tables are built as plain data (:class:`TableData`, :func:`report_parts`) and drawn
with rich where it is installed (:func:`render`), else as aligned plain text
(:func:`render_plain`): a device with only the ``client`` extra can read its own history.
"""

from __future__ import annotations

import datetime as dt
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from profiling.runs import (Device, DeviceStats, RunRecords, device_stats, part_names, straggler_ranks,
                            task_breakdown)
from profiling.sizing import Sizing, device_sizing, fit_order, per_sample_ranks, sizing
from profiling.units import ABSENT, human_bytes, milliseconds, number, seconds

if TYPE_CHECKING:   # rich is imported only by the functions that draw with it
    from rich.console import Console
    from rich.table import Table

__all__ = ["TableData", "Note", "report_parts", "render", "render_plain", "to_text", "device_table", "resources_table",
           "breakdown_table", "rounds_table", "tasks_table", "inference_table", "facts_line", "run_title", "to_rich",
           "kinds_text", "memory_fit_table", "kind_peaks_table", "speed_table", "traffic_table",
           "sizing_tables", "SIZING_NOTE", "inference_rows",
           "fleet_inference_table"]


@dataclass
class TableData:
    """A report table as text cells, rendered by rich here and as HTML by :mod:`profiling.html`."""

    title: str
    columns: tuple[str, ...]
    left: frozenset[str] = frozenset()          # left-aligned columns; numbers align right
    rows: list[list[str]] = field(default_factory=list)

    def add_row(self, *cells: str) -> None:
        self.rows.append(list(cells))


@dataclass(frozen=True)
class Note:
    """A line of text between the tables; ``bold`` for a heading."""

    text: str
    bold: bool = False


def to_rich(data: TableData) -> Table:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=data.title)
    for name in data.columns:
        table.add_column(name, justify="left" if name in data.left else "right")
    for row in data.rows:
        table.add_row(*(Text(cell) for cell in row))   # Text: a device's own strings are never markup
    return table


def facts_line(facts: dict[str, Any] | None) -> str:
    """A device in a few words: board (or CPU), cores, RAM."""
    if not isinstance(facts, dict):
        return ABSENT
    ram = facts.get("ram_bytes")
    return ", ".join([str(facts.get("board") or facts.get("cpu_model") or facts.get("arch") or "?"),
                      f"{facts.get('cores', '?')} cores",
                      human_bytes(ram) if isinstance(ram, (int, float)) else "RAM ?"])


def run_title(run: RunRecords) -> str:
    s = run.summary or {}
    spec = s.get("model") if isinstance(s.get("model"), dict) else {}
    app = spec.get("app") if isinstance(spec.get("app"), dict) else {}
    model = spec.get("name") or (f"app {app['name']}" if app.get("name") else None)
    bits = [f"run {s['run_id']}" if s.get("run_id") else str(run.source)]
    if s.get("strategy"):
        bits.append(f"{s['strategy']} / {model or '?'}")
    for metric in run.headline_metrics:   # accuracy, or an app's headline (the summary's final_NAME)
        if isinstance(s.get(f"final_{metric.name}"), (int, float)):
            bits.append(f"final {metric.name} {s[f'final_{metric.name}']:.4f}")
    if isinstance(s.get("bytes_down"), int) and isinstance(s.get("bytes_up"), int):
        bits.append(f"{human_bytes(s['bytes_down'])} down, {human_bytes(s['bytes_up'])} up")
    return " · ".join(bits)


def device_table(run: RunRecords, stats: list[DeviceStats]) -> TableData:
    ranks = straggler_ranks(stats)
    slowest_counts: dict[str, int] = {}
    skipped_counts: dict[str, int] = {}
    for row in run.rounds:
        if isinstance(row.get("slowest_client"), str):
            slowest_counts[row["slowest_client"]] = slowest_counts.get(row["slowest_client"], 0) + 1
        for cid in row.get("skipped") or []:
            skipped_counts[cid] = skipped_counts.get(cid, 0) + 1
    contributed = _contributions(run)
    table = TableData("Devices (tasks of every kind; times are medians over training tasks, a missed one counting "
                      "as the timeout; rank 1 = slowest" + ("; counted: async results counted of those taken, and "
                                                            "the share of the weight" if contributed else "") + ")",
                      ("rank", "device", "hardware", "tasks", "kinds", "round s", "device s", "times slowest",
                       "times skipped", *(("counted",) if contributed else ())),
                      frozenset({"device", "hardware", "kinds"}))
    for s in _by_rank(stats, ranks):
        notes = ", ".join(f"{n} {what}" for n, what in ((s.late, "late"), (s.missed, "missed"), (s.errors, "failed"))
                          if n)
        table.add_row(
            str(ranks.get(s.client_id, ABSENT)), s.client_id, facts_line(run.devices[s.client_id].facts),
            f"{s.tasks} ({notes})" if notes else str(s.tasks), kinds_text(s.kinds), seconds(s.median_round_seconds),
            seconds(s.median_device_seconds), str(slowest_counts.get(s.client_id, 0)),
            str(skipped_counts.get(s.client_id, 0)),
            *((_counted_text(contributed.get(s.client_id)),) if contributed else ()))
    return table


def _contributions(run: RunRecords) -> dict[str, Any]:
    """An async run's per-device contributions as its summary adds them up (empty for any other run)."""
    found = (run.summary or {}).get("contributions")
    return found if isinstance(found, dict) else {}


def _counted_text(c: Any) -> str:
    """"13/14, 14%": results counted of those taken (the rest too stale), and the device's share of the weight."""
    if not isinstance(c, dict) or not all(isinstance(c.get(k), (int, float)) for k in ("counted", "dropped",
                                                                                        "weight_share")):
        return ABSENT
    rested = c.get("rested")
    return (f"{c['counted']}/{c['counted'] + c['dropped']}, {c['weight_share']:.0%}"
            + (f", rested {rested}" if isinstance(rested, int) and rested else ""))


def kinds_text(kinds: dict[str, int]) -> str:
    """Tasks by kind in a few words ("train 10, evaluate 1"); absent when the records do not say."""
    return ", ".join(f"{kind} {n}" for kind, n in kinds.items()) or ABSENT


def resources_table(stats: list[DeviceStats]) -> TableData:
    """Speed, memory and heat per device, in the straggler order of :func:`device_table`.

    A table of its own so that both fit an 80-column terminal.
    """
    ranks = straggler_ranks(stats)
    gpu = any(s.gpu_peak_bytes is not None for s in stats)   # GPU columns only where a device trained on one
    table = TableData("Device resources (step times are medians over training tasks; memory and temperature the "
                      "peak over every task)",
                      ("device", "trains on", "step p50 ms", "step p95 ms", "samples/s", "peak RSS", "peak USS",
                       *(("GPU mem", "GPU °C") if gpu else ()), "CPU %", "temp °C", "throttled"),
                      frozenset({"device", "trains on", "throttled"}))
    for s in _by_rank(stats, ranks):
        table.add_row(
            s.client_id, s.train_device or ABSENT, milliseconds(s.step_p50), milliseconds(s.step_p95),
            number(s.samples_per_second, ".0f"), human_bytes(s.peak_rss_bytes), human_bytes(s.peak_uss_bytes),
            *((human_bytes(s.gpu_peak_bytes), number(s.gpu_temperature_c)) if gpu else ()),
            number(s.cpu_percent, ".0f"), number(s.temperature_c),
            ABSENT if s.throttled is None else (", ".join(s.throttled) or "no"))
    return table


def _by_rank(stats: list[DeviceStats], ranks: dict[str, int]) -> list[DeviceStats]:
    return sorted(stats, key=lambda s: (ranks.get(s.client_id, 10**9), s.client_id))


def breakdown_table(stats: list[DeviceStats]) -> TableData:
    names = part_names(s.breakdown for s in stats)
    table = TableData("Where a task's time goes (mean seconds per task)",
                      ("device", *(name.replace("_", " ") for name in (*names, "total"))), frozenset({"device"}))
    for s in sorted(stats, key=lambda s: s.client_id):
        cells = [seconds(s.breakdown.get(name), 3) for name in names]
        table.add_row(s.client_id, *cells, seconds(sum(s.breakdown.values()), 3) if s.breakdown else ABSENT)
    return table


def rounds_table(run: RunRecords) -> TableData:
    """One row per round; the second column is the run's headline metric (accuracy, or its app's)."""
    metrics = run.headline_metrics
    table = TableData("Rounds", ("round", *(m.name for m in metrics), "loss", "clients", "bytes down", "bytes up",
                                 "slowest client", "slowest s", "skipped", "round s"),
                      frozenset({"slowest client", "skipped"}))
    for row in run.rounds:
        figures = [row.get(m.column) for m in metrics] + [row.get("test_loss")]
        table.add_row(
            str(row["round"]), *(number(v, ".4f") if isinstance(v, (int, float)) else ABSENT for v in figures),
            f"{row.get('returned', 0)}/{row.get('selected', 0)}", human_bytes(row.get("bytes_down")),
            human_bytes(row.get("bytes_up")), str(row.get("slowest_client") or ABSENT),
            seconds(row.get("slowest_seconds")), ", ".join(row.get("skipped") or []) or ABSENT,
            seconds(row.get("seconds"), 1))
    return table


def _when(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return ABSENT
    return dt.datetime.fromtimestamp(value).strftime("%Y-%m-%d %H:%M:%S")


def tasks_table(device: Device) -> TableData:
    """One row per task; the run and round-time columns only when the records have them."""
    with_run = any(t.run_id for t in device.tasks)
    with_round_time = any(t.round_seconds is not None for t in device.tasks)
    with_objective = len({t.objective for t in device.tasks}) > 1
    names = part_names(task_breakdown(t.profile) for t in device.tasks)
    columns = ("run",) * with_run + ("round",) + ("objective",) * with_objective + ("round s",) * with_round_time + (
        "device s", *(n.replace("_", " ") for n in names), "step p50 ms", "step p95 ms", "samples/s",
        "peak RSS", "CPU %", "temp °C", "note")
    table = TableData(f"Tasks of {device.client_id}", columns, frozenset({"run", "objective", "note"}))
    for task in device.tasks:
        p = task.profile
        parts = task_breakdown(p)
        note = "missed" if task.missed else "late" if task.late else (f"error: {task.error}" if task.error else "")
        table.add_row(*((task.run_id or ABSENT,) * with_run), str(task.round if task.round is not None else ABSENT),
                      *((task.objective or ABSENT,) * with_objective),
                      *((seconds(task.round_seconds),) * with_round_time), seconds(p.get("seconds")),
                      *(seconds(parts.get(n), 3) for n in names), milliseconds(p.get("step_p50")),
                      milliseconds(p.get("step_p95")), number(p.get("samples_per_second"), ".0f"),
                      human_bytes(p.get("peak_rss_bytes")), number(p.get("cpu_percent"), ".0f"),
                      number(p.get("temperature_c")), note[:60])
    return table


SIZING_NOTE = ("Does the model fit each device, and how fast is it per sample? Memory is the peak over every "
               "kind of task against what the device's process may use; speed is per sample trained, so a device "
               "holding more data is not ranked slower for it.")


def _signed_bytes(n: int | None) -> str:
    return ABSENT if n is None else ("-" + human_bytes(-n) if n < 0 else human_bytes(n))


def memory_fit_table(rows: list[Sizing]) -> TableData:
    """Peak memory against each device's memory, the headroom left and the kind of task that set the peak;
    tightest headroom first. The sizing tables each fit an 80-column terminal."""
    table = TableData("Will it fit? Peak memory (RSS, every task) against the device's memory; tightest first",
                      ("device", "memory", "peak", "peak set by", "headroom", "free %"),
                      frozenset({"device", "peak set by"}))
    for s in fit_order(rows):
        share = s.headroom_bytes / s.memory_total_bytes if s.headroom_bytes is not None and s.memory_total_bytes \
            else None
        setter = ABSENT if s.peak_kind is None else (
            f"{s.peak_kind} (round {s.peak_round})" if s.peak_round is not None else s.peak_kind)
        table.add_row(s.client_id, human_bytes(s.memory_total_bytes), human_bytes(s.peak_rss_bytes), setter,
                      _signed_bytes(s.headroom_bytes), number(None if share is None else 100 * share, ".1f"))
    return table


def kind_peaks_table(rows: list[Sizing]) -> TableData:
    """Peak memory of each kind of task (a column per kind), in the order of :func:`memory_fit_table`."""
    kinds = sorted({kind for s in rows for kind in s.peaks})
    table = TableData("Peak memory per kind of task", ("device", *kinds), frozenset({"device"}))
    for s in fit_order(rows):
        table.add_row(s.client_id, *(human_bytes(s.peaks.get(kind)) for kind in kinds))
    return table


def speed_table(run: RunRecords, rows: list[Sizing]) -> TableData:
    """Per-sample speed (ranked), beside the rank by round time the devices table uses, with class and site."""
    ranks = per_sample_ranks(rows)
    round_ranks = straggler_ranks(run.stats())
    table = TableData("Speed per sample trained (rank 1 = slowest per sample; round rank: by round time)",
                      ("rank", "device", "class", "site", "ms/sample", "samples/task", "round rank"),
                      frozenset({"device", "class", "site"}))
    for s in sorted(rows, key=lambda s: (ranks.get(s.client_id, 10**9), s.client_id)):
        table.add_row(str(ranks.get(s.client_id, ABSENT)), s.client_id, s.device_class, s.site or ABSENT,
                      milliseconds(s.seconds_per_sample), number(s.samples_per_task, ".0f"),
                      str(round_ranks.get(s.client_id, ABSENT)))
    return table


def traffic_table(rows: list[Sizing]) -> TableData:
    """Bytes each way, time offline and the latest inference benchmark of each device."""
    table = TableData("Traffic, time offline and inference (latest fedge-profile infer: p50 at batch 1, "
                      "samples/s at its largest batch, peak RSS)",
                      ("device", "down", "up", "offline", "p50 ms", "samples/s", "RSS"), frozenset({"device"}))
    for s in rows:
        inf = s.inference
        table.add_row(
            s.client_id, human_bytes(s.bytes_down), human_bytes(s.bytes_up),
            ABSENT if s.offline is None else f"{len(s.offline)}× {s.offline_seconds:.0f} s" if s.offline else "no",
            milliseconds(inf.p50_batch1) if inf else ABSENT,
            f"{inf.samples_per_second:.0f} @{inf.batch}" if inf and inf.samples_per_second is not None else ABSENT,
            human_bytes(inf.peak_rss_bytes) if inf else ABSENT)
    return table


def sizing_tables(run: RunRecords, rows: list[Sizing]) -> list[TableData]:
    """The sizing section's tables, in order."""
    return [memory_fit_table(rows), kind_peaks_table(rows), speed_table(run, rows), traffic_table(rows)]


_INFERENCE_COLUMNS = ("when", "model", "provider", "batch", "runs", "p50 ms", "p95 ms", "p99 ms", "samples/s",
                      "accuracy", "peak RSS")


def _inference_columns(devices: list[Device]) -> tuple[str, ...]:
    """The inference tables' columns: accuracy only where a benchmark may have measured it, that is unless every
    one was of an app's export (whose metrics are the app's code, which ``fedge-profile infer`` does not run)."""
    if all("app" in line for d in devices for line in d.inference):
        return tuple(c for c in _INFERENCE_COLUMNS if c != "accuracy")
    return _INFERENCE_COLUMNS


def inference_rows(device: Device, with_accuracy: bool = True) -> list[list[str]]:
    """One row of cells per batch size of each of the device's ``fedge-profile infer`` benchmarks; the accuracy
    cell only ``with_accuracy`` (:func:`_inference_columns`)."""
    rows = []
    for line in device.inference:
        provider = str(line.get("provider", "CPUExecutionProvider")).removesuffix("ExecutionProvider")
        accuracy = line.get("accuracy")
        for result in line.get("results") or []:
            rows.append([_when(line.get("time")), str(line.get("model_name", ABSENT)), provider,
                         str(result.get("batch")), str(result.get("runs")), milliseconds(result.get("p50")),
                         milliseconds(result.get("p95")), milliseconds(result.get("p99")),
                         number(result.get("samples_per_second"), ".0f"),
                         *((number(100 * accuracy, ".2f") if isinstance(accuracy, (int, float)) else ABSENT,)
                           * with_accuracy),
                         human_bytes(line.get("peak_rss_bytes"))])
    return rows


def inference_table(device: Device) -> TableData:
    columns = _inference_columns([device])
    table = TableData(f"Inference benchmarks (ONNX Runtime) of {device.client_id}", columns,
                      frozenset({"when", "model", "provider"}))
    table.rows = inference_rows(device, "accuracy" in columns)
    return table


def fleet_inference_table(devices: list[Device]) -> TableData:
    """Every device's inference benchmarks in one table, a device column first."""
    columns = _inference_columns(devices)
    table = TableData("Inference benchmarks (ONNX Runtime, fedge-profile infer) of each device",
                      ("device", *columns), frozenset({"device", "when", "model", "provider"}))
    table.rows = [[d.client_id, *row] for d in sorted(devices, key=lambda d: d.client_id)
                  for row in inference_rows(d, "accuracy" in columns)]
    return table


def report_parts(run: RunRecords) -> list[Note | TableData]:
    """Every line and table that applies to ``run``, in the order they are shown."""
    stats = run.stats()
    if run.is_run:
        parts: list[Note | TableData] = [Note(run_title(run), bold=True)]
        if run.devices:
            rows = sizing(run)
            parts += [device_table(run, stats), resources_table(stats), breakdown_table(stats),
                      Note(f"Sizing. {SIZING_NOTE}", bold=True), *sizing_tables(run, rows)]
        else:
            parts.append(Note("no device profiles in this run (clients/ is empty)"))
        return parts + [rounds_table(run)]
    parts = []
    for device in run.devices.values():
        parts.append(Note(f"{device.client_id}: {facts_line(device.facts)}", bold=True))
        if device.tasks:
            parts += [tasks_table(device), breakdown_table([device_stats(device, run.training_tasks(device))]),
                      memory_fit_table([device_sizing(run, device)])]
        if device.inference:
            parts.append(inference_table(device))
        if not device.tasks and not device.inference:
            parts.append(Note(f"{run.source} holds no task or inference records"))
    return parts


def render(run: RunRecords, console: Console) -> None:
    """Print the report of ``run`` with rich."""
    from rich.text import Text

    for part in report_parts(run):
        if isinstance(part, TableData):
            console.print(to_rich(part))
        else:   # Text: a device's own strings are never markup
            console.print(Text(part.text, style="bold" if part.bold else ""))


def to_text(data: TableData) -> str:
    """``data`` as plain text: the title, a header, a rule, one line per row; numbers aligned right."""
    widths = [max([len(name), *(len(row[i]) for row in data.rows)]) for i, name in enumerate(data.columns)]

    def line(cells: list[str] | tuple[str, ...]) -> str:
        return "  ".join(cell.ljust(w) if name in data.left else cell.rjust(w)
                         for name, cell, w in zip(data.columns, cells, widths)).rstrip()

    return "\n".join([data.title, line(data.columns), "  ".join("-" * w for w in widths),
                      *(line(row) for row in data.rows)])


def render_plain(run: RunRecords, out: TextIO = sys.stdout) -> None:
    """Print the report of ``run`` as plain text (no rich needed), a blank line between tables."""
    for part in report_parts(run):
        if isinstance(part, TableData):
            out.write(f"\n{to_text(part)}\n\n")
        else:
            out.write(part.text + "\n")
