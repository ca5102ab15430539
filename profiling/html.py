"""``fedge-profile html``: one self-contained HTML file with the run's report and plots.

The plots are drawn with matplotlib's object API (``Figure`` with the Agg canvas: no
display, no pyplot global state) and embedded as base64 PNG images, so the file can be
mailed or archived and opens anywhere without the run directory. The tables are the
same as ``fedge-profile show`` prints. The sizing section comes first (a person
choosing boards reads it before the straggler tables), with two plots of its own: each
device's peak memory against its memory, and its memory, CPU and temperature over time
with its offline spans.

Every per-round axis has integer ticks, legends sit below the axes (never over a bar
or a line), and the round-time plot keeps to its data's scale: a deadline far above
every round time is drawn along the top edge with its value in the legend, instead
of squashing the data into the bottom of the plot.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import io
import math
from collections.abc import Callable

import matplotlib
import matplotlib.patches
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from profiling.report import (SIZING_NOTE, TableData, breakdown_table, device_table, facts_line,
                              fleet_inference_table, kind_peaks_table, memory_fit_table, resources_table, rounds_table,
                              run_title, speed_table, traffic_table)
from profiling.runs import ACCURACY, DeviceStats, RunRecords, TaskRecord, part_names, straggler_ranks
from profiling.sizing import UNNAMED_KIND, Sizing, fit_order, sizing
from profiling.units import human_bytes

__all__ = ["render_html", "PLOTS", "DEADLINE_SCALE", "plot_headroom", "plot_over_time", "TIMELINE_DEVICES",
           "BOARD_SIZES"]

_MIB = 2**20   # every report writes bytes in binary units (profiling.units), labelled MiB
# The round-time plot's y-axis reaches up to the deadline while the deadline is at most this many
# times the longest round time; above that the deadline is drawn at the top edge, off scale.
DEADLINE_SCALE = 2.0
_LEGEND_COLUMNS = 5
# Memory sizes boards come in, drawn as references on the headroom plot (512 MiB: a Raspberry Pi Zero 2 W).
BOARD_SIZES = (512 * _MIB, 1024 * _MIB, 2048 * _MIB, 4096 * _MIB, 8192 * _MIB)
TIMELINE_DEVICES = 12   # the over-time plot shows this many devices, those with the least headroom first
_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; font-size: 0.8em; margin: 0.5em 0; }
th, td { padding: 2px 6px; border-bottom: 1px solid #eee; text-align: right; white-space: nowrap; }
th { background: #f4f4f4; } td.l, th.l { text-align: left; }
figure { margin: 1em 0; } figcaption { font-size: 0.85em; color: #555; }
img { max-width: 100%; border: 1px solid #eee; }
"""


def _png(fig: Figure) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _figure(title: str, xlabel: str, ylabel: str, width: float = 9.0, height: float = 3.8) -> tuple[Figure, Axes]:
    fig = Figure(figsize=(width, height), layout="constrained")   # constrained: room for a legend outside
    ax = fig.subplots()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _round_axis(ax: Axes, rounds: list[int]) -> None:
    """Integer ticks on a per-round x-axis: every round when there are few, else a readable subset."""
    if len(set(rounds)) <= 20:
        ax.set_xticks(sorted(set(rounds)))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _legend_below(fig: Figure, ax: Axes) -> None:
    """The axes' legend below them, outside the plotted area, in up to five columns."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncol=min(len(handles), _LEGEND_COLUMNS),
                   fontsize="small", frameon=False)


def plot_headline(run: RunRecords, stats: list[DeviceStats]) -> Figure | None:
    """The run's headline metric per round: accuracy, or its app's (every metric its rows hold while the app's
    run has no summary to name it)."""
    metrics = run.headline_metrics
    series = [(m, [r for r in run.rounds if isinstance(r.get(m.column), (int, float))]) for m in metrics]
    series = [(m, rows) for m, rows in series if rows]
    if not series:
        return None
    name = ylabel = _metric_words(run)
    if len(metrics) == 1 and metrics[0] != ACCURACY and metrics[0].higher_is_better is not None:
        ylabel += " (higher is better)" if metrics[0].higher_is_better else " (lower is better)"
    fig, ax = _figure(f"Test {name} per round", "round", ylabel)
    for metric, rows in series:
        ax.plot([r["round"] for r in rows], [r[metric.column] for r in rows], marker="o",
                label=metric.name if len(series) > 1 else None)
    _round_axis(ax, [r["round"] for _, rows in series for r in rows])
    _legend_below(fig, ax)
    return fig


def _metric_words(run: RunRecords) -> str:
    """The headline metric's name in a title or caption: ``accuracy``, ``r2``, or ``mae, r2`` for an app's run
    whose summary does not name its headline yet."""
    return ", ".join(m.name for m in run.headline_metrics) or "metric"


def plot_bytes(run: RunRecords, stats: list[DeviceStats]) -> Figure | None:
    rows = [r for r in run.rounds if r["round"] > 0]
    if not rows:
        return None
    fig, ax = _figure("Bytes moved per round", "round", "MiB")
    x = [r["round"] for r in rows]
    ax.bar([v - 0.2 for v in x], [(r.get("bytes_down") or 0) / _MIB for r in rows], width=0.4, label="down (tasks)")
    ax.bar([v + 0.2 for v in x], [(r.get("bytes_up") or 0) / _MIB for r in rows], width=0.4, label="up (results)")
    _round_axis(ax, x)
    _legend_below(fig, ax)
    return fig


def plot_round_times(run: RunRecords, stats: list[DeviceStats]) -> Figure | None:
    fig, ax = _figure("Round time per device (task sent to result received)", "round", "seconds")
    rounds: list[int] = []
    longest = 0.0
    for device in run.devices.values():
        points = [(t.round, t.round_seconds if t.round_seconds is not None else t.profile.get("seconds"), t)
                  for t in run.training_tasks(device) if t.round is not None]
        points = [p for p in points if p[1] is not None]
        if not points:
            continue
        rounds += [p[0] for p in points]
        longest = max(longest, *(p[1] for p in points))
        color = None
        for segment in _consecutive(points):   # no line across rounds the device was not in
            line, = ax.plot([p[0] for p in segment], [p[1] for p in segment], marker="o", color=color,
                            label=device.client_id if color is None else None)
            color = line.get_color()
        for flag, marker, size in (("late", "x", 11), ("missed", "v", 9)):
            marked = [p for p in points if getattr(p[2], flag)]
            if marked:
                ax.plot([p[0] for p in marked], [p[1] for p in marked], marker, color=color,
                        markersize=size, linestyle="none")
    if not rounds:
        return None
    _round_axis(ax, rounds)
    _deadline(ax, run.round_timeout, longest)
    _legend_below(fig, ax)
    return fig


def _deadline(ax: Axes, timeout: float | None, longest: float) -> None:
    """The y-axis from 0 to the data (and the deadline, when it is within :data:`DEADLINE_SCALE` of it)."""
    if timeout is None:
        ax.set_ylim(0, longest * 1.1 or 1.0)
    elif timeout <= DEADLINE_SCALE * longest:
        ax.set_ylim(0, max(longest, timeout) * 1.1)
        ax.axhline(timeout, color="red", linestyle="--", linewidth=1, label=f"round_timeout ({timeout:g} s)",
                   gid="deadline")
    else:   # far above every round time: keep the data readable, name the deadline's value
        top = longest * 1.15 or 1.0
        ax.set_ylim(0, top)
        ax.axhline(top, color="red", linestyle="--", linewidth=2, clip_on=False, gid="deadline",
                   label=f"round_timeout ({timeout:g} s, above this scale)")
        ax.text(0.995, 0.98, f"round_timeout {timeout:g} s ↑", transform=ax.transAxes, ha="right", va="top",
                color="red", fontsize="small")


def _consecutive(points: list[tuple]) -> list[list[tuple]]:
    """Split (round, ...) points, sorted by round, into runs of consecutive rounds."""
    segments: list[list[tuple]] = []
    for point in sorted(points, key=lambda p: p[0]):
        if segments and point[0] - segments[-1][-1][0] <= 1:
            segments[-1].append(point)
        else:
            segments.append([point])
    return segments


def plot_breakdown(run: RunRecords, stats: list[DeviceStats]) -> Figure | None:
    timed = [s for s in stats if s.breakdown]
    if not timed:
        return None
    parts = part_names(s.breakdown for s in timed)
    legend_rows = -(-len(parts) // _LEGEND_COLUMNS)
    fig, ax = _figure("Where a task's time goes, per device (mean seconds per task)", "seconds", "",
                      height=1.4 + 0.45 * len(timed) + 0.25 * legend_rows)
    names = [s.client_id for s in timed]
    left = [0.0] * len(timed)
    tab10, tab20 = matplotlib.colormaps["tab10"], matplotlib.colormaps["tab20"]
    colors = [tab10(i) for i in range(10)] + [tab20(2 * i + 1) for i in range(10)]   # 20 distinct colours
    for i, part in enumerate(parts):
        widths = [s.breakdown.get(part, 0.0) for s in timed]
        if any(widths):
            ax.barh(names, widths, left=left, label=part.replace("_", " "), color=colors[i % len(colors)])
            left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    _legend_below(fig, ax)
    return fig


def plot_memory(run: RunRecords, stats: list[DeviceStats]) -> Figure | None:
    """Peak RSS, USS and GPU memory per device, over every task. A reading a device did not take
    (no USS, no GPU) is a gap in its group of bars, never a bar of height 0 (docs/profiling.md)."""
    measured = [s for s in stats if s.peak_rss_bytes is not None]
    if not measured:
        return None
    fig, ax = _figure("Peak memory per device (over every task)", "", "MiB")
    series: list[tuple[str, list[int | None]]] = [("peak RSS", [s.peak_rss_bytes for s in measured]),
                                                  ("peak USS", [s.peak_uss_bytes for s in measured])]
    if any(s.gpu_peak_bytes is not None for s in measured):   # beside RSS, only where a device trained on a GPU
        series.append(("peak GPU memory", [s.gpu_peak_bytes for s in measured]))
    width = 0.8 / len(series)
    for k, (label, values) in enumerate(series):
        shown = [(i, v) for i, v in enumerate(values) if v is not None]
        if shown:
            ax.bar([i + (k - (len(series) - 1) / 2) * width for i, _ in shown], [v / _MIB for _, v in shown],
                   width=width, label=label, gid=label)
    ax.set_xticks(range(len(measured)), [s.client_id for s in measured], rotation=30 if len(measured) > 6 else 0)
    _legend_below(fig, ax)
    return fig


def _kind_colors(rows: list[Sizing]) -> dict[str, object]:
    kinds = sorted({kind for s in rows for kind in s.peaks})
    tab10 = matplotlib.colormaps["tab10"]
    return {kind: tab10(i % 10) for i, kind in enumerate(kinds)}


def _size_label(n: float) -> str:
    return f"{n / 1024**3:g} GiB" if n >= 1024**3 else f"{n / _MIB:g} MiB"


def plot_headroom(rows: list[Sizing]) -> Figure | None:
    """Each device's peak memory (coloured by the kind of task that set it) against the memory it may use, on
    a log-2 axis so that a 300 MiB peak and a 24 GiB host both stay readable; board sizes as references."""
    shown = [s for s in fit_order(rows) if s.peak_rss_bytes is not None]
    if not shown:
        return None
    colors = _kind_colors(shown)
    fig = Figure(figsize=(9.0, 1.5 + 0.5 * len(shown)), layout="constrained")
    ax = fig.subplots()
    ax.set_title("Peak memory against each device's memory (tightest first)")
    ax.set_xscale("log", base=2)
    floor = 2 ** int(math.log2(max(1, min(s.peak_rss_bytes for s in shown) / _MIB / 4)))   # in MiB, at least 1
    top = max([s.peak_rss_bytes for s in shown] + [s.memory_total_bytes or 0 for s in shown]) / _MIB * 1.6
    for y, s in enumerate(shown):
        peak = s.peak_rss_bytes / _MIB
        if s.memory_total_bytes:
            total = s.memory_total_bytes / _MIB
            ax.barh(y, total - floor, left=floor, color="#e8e8e8", edgecolor="#999", height=0.6)
        ax.barh(y, peak - floor, left=floor, color=colors[s.peak_kind], height=0.6)
        free = s.headroom_bytes
        note = (f"{human_bytes(s.peak_rss_bytes)} ({s.peak_kind})" +
                ("" if free is None else f": {human_bytes(abs(free))} {'free' if free >= 0 else 'short'} of "
                                         f"{human_bytes(s.memory_total_bytes)}"))
        ax.text(peak * 1.05, y, note, va="center", fontsize="small")
    for size in BOARD_SIZES:
        if floor * _MIB < size < top * _MIB:
            ax.axvline(size / _MIB, color="#555", linestyle=":", linewidth=1)
            ax.text(size / _MIB, -0.7, _size_label(size), ha="center", va="bottom", fontsize="x-small", color="#555")
    ticks = [2**k for k in range(int(math.log2(floor)), int(math.log2(top)) + 1)]
    ax.set_xticks(ticks, [_size_label(t * _MIB) for t in ticks])
    ax.set_xlim(floor, top)
    ax.set_ylim(len(shown) - 0.5, -1.0)
    ax.set_yticks(range(len(shown)), [s.client_id for s in shown])
    ax.grid(True, axis="x", alpha=0.3)
    setters = {s.peak_kind for s in shown}
    handles = [matplotlib.patches.Patch(color=c, label=f"peak set by {k}") for k, c in colors.items() if k in setters]
    handles.append(matplotlib.patches.Patch(facecolor="#e8e8e8", edgecolor="#999", label="memory the device may use"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 4), fontsize="small",
               frameon=False)
    return fig


def _clock(run: RunRecords) -> tuple[Callable[[TaskRecord], float | None], str, float | None]:
    """The over-time plot's x: minutes since the run's first record when every task has its time, else rounds."""
    tasks = [t for d in run.devices.values() for t in d.tasks]
    times = [t.time for t in tasks if t.time is not None] + [p["time"] for p in run.presence]
    if tasks and all(t.time is not None for t in tasks):
        start = min(times)
        return (lambda t: (t.time - start) / 60), "minutes since the run's first record", start
    return (lambda t: t.round), "round", None


def plot_over_time(run: RunRecords, rows: list[Sizing]) -> Figure | None:
    """Per device (a row each): peak memory, CPU and temperature of each task over the run, its offline spans
    shaded. A reading the device could not take is left out; a device without any says so in its panel."""
    devices = [s for s in fit_order(rows) if run.devices[s.client_id].tasks][:TIMELINE_DEVICES]
    if not devices:
        return None
    x_of, xlabel, start = _clock(run)
    colors = _kind_colors(rows)
    panels = [(key, label, scale) for key, label, scale in (
        ("peak_rss_bytes", "peak RSS, MiB", _MIB), ("cpu_percent", "CPU % (of one core)", 1),
        ("temperature_c", "temperature °C", 1))   # a reading no device took has no column
        if any(t.profile.get(key) is not None for s in devices for t in run.devices[s.client_id].tasks)]
    if not panels:
        return None
    fig = Figure(figsize=(max(9.0, 3.7 * len(panels)), 1.0 + 1.7 * len(devices)), layout="constrained")
    axes = fig.subplots(len(devices), len(panels), sharex=True, squeeze=False)
    for row, s in zip(axes, devices):
        tasks = [t for t in run.devices[s.client_id].tasks if x_of(t) is not None]
        for ax, (key, label, scale) in zip(row, panels):
            ax.set_title(f"{s.client_id}: {label}", fontsize="small", loc="left")
            ax.grid(True, alpha=0.3)
            read = [t for t in tasks if t.profile.get(key) is not None]
            if not read:
                ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", va="center", color="#777")
            for kind in sorted({t.objective or UNNAMED_KIND for t in read}):
                mine = [t for t in read if (t.objective or UNNAMED_KIND) == kind]
                ax.plot([x_of(t) for t in mine], [t.profile[key] / scale for t in mine], "o", markersize=4,
                        color=colors.get(kind), label=kind)
            if read:
                ax.plot([x_of(t) for t in read], [t.profile[key] / scale for t in read], color="#bbb", linewidth=1,
                        zorder=0)
                if key != "temperature_c":   # memory and CPU from 0: a few MiB more must look like a few
                    ax.set_ylim(bottom=0, top=max(t.profile[key] / scale for t in read) * 1.15)
            if key == "peak_rss_bytes" and read and s.memory_total_bytes:
                highest = max(t.profile[key] for t in read)
                if s.memory_total_bytes <= 2 * highest:   # the limit is near enough to draw on this scale
                    ax.axhline(s.memory_total_bytes / _MIB, color="red", linestyle="--", linewidth=1,
                               label="memory the device may use")
            if start is not None:
                for left, right in s.offline or []:
                    ax.axvspan((left - start) / 60, (right - start) / 60, color="#f4b183", alpha=0.5,
                               label="offline")
    for ax in axes[-1]:
        ax.set_xlabel(xlabel)
    labels: dict[str, object] = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            labels.setdefault(label, handle)
    fig.legend(list(labels.values()), list(labels), loc="outside lower center", ncol=min(len(labels), 5),
               fontsize="small", frameon=False)
    return fig


# (anchor, caption, plot): the report's figures, in order. "{metric}" stands for the run's headline metric: in a
# caption its name (accuracy for fedge's own networks, an app's own: _metric_words), in an anchor "accuracy" or,
# for a run on an app, "headline" (a metric's name need not be a valid HTML id)
PLOTS: tuple[tuple[str, str, Callable[[RunRecords, list[DeviceStats]], Figure | None]], ...] = (
    ("{metric}", "Test {metric} of the global model after each round (round 0: the initial model).", plot_headline),
    ("bytes", "Bytes of task messages sent and result messages received in each round.", plot_bytes),
    ("round-times", "Each device's round time as the coordinator measured it (x: the answer came after its "
                    "attempt ended; triangle: no answer by then, drawn at the timeout); dashed red: the deadline "
                    "(round_timeout), drawn along the top edge when it is far above every round time.",
     plot_round_times),
    ("phases", "Mean seconds per task in each phase: receive (waiting on the device), decode, the four parts of "
               "each training step, the rest of training, encode and publish.", plot_breakdown),
    ("memory", "Largest resident (RSS) and unique (USS) memory of each device's client process over every task "
               "(training, evaluation, calibration), and the GPU memory torch allocated where a device trained on "
               "its GPU, in MiB; a reading a device did not take is left out (a gap), not drawn as 0.", plot_memory),
)


def _table(data: TableData) -> str:
    def cell(tag: str, column: str, text: str) -> str:
        cls = ' class="l"' if column in data.left else ""
        return f"<{tag}{cls}>{html.escape(text)}</{tag}>"

    head = "".join(cell("th", c, c) for c in data.columns)
    body = "".join("<tr>" + "".join(cell("td", c, v) for c, v in zip(data.columns, row)) + "</tr>"
                   for row in data.rows)
    return f"<h2>{html.escape(data.title)}</h2>\n<div class=\"scroll\"><table><tr>{head}</tr>{body}</table></div>\n"


def _facts_table(run: RunRecords, stats: list[DeviceStats]) -> str:
    ranks = straggler_ranks(stats)
    data = TableData("Devices' facts (from their hello message)",
                     ("device", "summary", "arch", "cpu", "OS", "python", "torch", "onnxruntime"),
                     frozenset({"device", "summary", "arch", "cpu", "OS"}))
    for cid in sorted(run.devices, key=lambda c: (ranks.get(c, 10**9), c)):
        f = run.devices[cid].facts or {}
        data.add_row(cid, facts_line(f or None), *(str(f.get(k) or "—") for k in
                                                    ("arch", "cpu_model", "os", "python", "torch", "onnxruntime")))
    return _table(data)


def _figure_html(anchor: str, caption: str, fig: Figure | None) -> str:
    if fig is None:
        return ""
    alt = caption.split(";")[0]
    return (f'<figure id="{anchor}"><img alt="{html.escape(alt)}" src="data:image/png;base64,{_png(fig)}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


SIZING_CAPTIONS = {
    "headroom": "Each device's largest resident memory (RSS) over every task, coloured by the kind of task that "
                "set it, against the memory its process may use (grey: the host's RAM, or its memory cgroup's "
                "limit when lower); dotted: the sizes boards come in (512 MiB is a Raspberry Pi Zero 2 W, whose "
                "OS keeps part of it). Log-2 axis.",
    "over-time": "Per device, each task's peak RSS, CPU use and temperature (a column only for readings some "
                 "device took) as it answered (a dot per task, coloured by kind); shaded: offline (from its going offline to its coming back, or the run's "
                 "last record); dashed red: the memory the device may use, where it is within twice the peak. "
                 "Round numbers stand for time in runs recorded before tasks had times.",
}


def _sizing_section(run: RunRecords) -> list[str]:
    """The tables and plots a person sizing hardware reads first."""
    rows = sizing(run)
    parts = [f"<h2 id=\"sizing\">Sizing</h2><p>{html.escape(SIZING_NOTE)} Headroom = memory − peak; the speed "
             f"rank is by the median milliseconds per sample of each training task's local training (its "
             f"<code>train</code> phase over the samples it trained on), the round rank by round time as in "
             f"the devices table. Down: the device's tasks plus the model broadcast of each round it had a task "
             f"in; up: its results.</p>",
             _table(memory_fit_table(rows)), _table(kind_peaks_table(rows)),
             _figure_html("headroom", SIZING_CAPTIONS["headroom"], plot_headroom(rows)),
             _table(speed_table(run, rows)), _table(traffic_table(rows)),
             _figure_html("over-time", SIZING_CAPTIONS["over-time"], plot_over_time(run, rows))]
    benchmarked = [d for d in run.devices.values() if d.inference]
    if benchmarked:
        parts.append(_table(fleet_inference_table(benchmarked)))
    else:
        parts.append("<p>No inference benchmarks: run <code>fedge-profile infer MODEL.onnx --state-dir DIR</code> on "
                     "a device (into its state directory, or a copy of it under the run's <code>clients/ID/</code>) "
                     "to see them here.</p>")
    return parts


def render_html(run: RunRecords) -> str:
    """The whole report as one HTML document: sizing first, then where the time goes, then the rounds."""
    stats = run.stats()
    title = run_title(run)
    parts = [f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
             f"<title>fedge report: {html.escape(title)}</title><style>{_STYLE}</style></head><body>",
             f"<h1>fedge report</h1><p>{html.escape(title)}</p>",
             f"<p>source: <code>{html.escape(str(run.source))}</code>; written "
             f"{dt.datetime.now().strftime('%Y-%m-%d %H:%M')}. Absent readings (no sensor, not measured) "
             f"show as —.</p>"]
    if stats:
        parts += _sizing_section(run)
        parts.append(_table(device_table(run, stats)))
        parts.append(_table(resources_table(stats)))
    metric = _metric_words(run)
    for anchor, caption, plot in PLOTS:
        parts.append(_figure_html(anchor.replace("{metric}", "headline" if metric != "accuracy" else metric),
                                  caption.replace("{metric}", metric), plot(run, stats)))
    if stats:
        parts.append(_table(breakdown_table(stats)))
        parts.append(_facts_table(run, stats))
    if run.rounds:
        parts.append(_table(rounds_table(run)))
    parts.append("</body></html>\n")
    return "\n".join(p for p in parts if p)
