"""Draw a Grafana dashboard's panels from Prometheus, without Grafana.

``deploy/grafana-fedge.json`` is read as it is: every panel at its ``gridPos`` (Grafana's 24-column
grid, 30 px rows, 8 px gaps), with its title, unit and PromQL targets. Each target is evaluated by
Prometheus's HTTP API (``/api/v1/query_range``) after the dashboard's variables are substituted:
a query variable with ``includeAll`` takes its ``allValue`` (``$instance`` → ``.*``: every
coordinator), ``$__rate_interval`` is computed by Grafana's own rule (the larger of
``$__interval`` + the scrape interval and four scrape intervals). Time series panels are drawn as
lines (or stacked bars where the panel's ``drawStyle`` says so), stat panels as the last non-null
value over an area sparkline, with Grafana's default thresholds (green, red from 80). The result is
one self-contained HTML page (the plots embedded as PNG), for a headless browser to screenshot.

This is a faithful reading of the dashboard's layout and queries, not Grafana's renderer: fonts,
colours and axis choices are approximations of Grafana 10's dark theme.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Box", "Series", "panel_boxes", "page_height", "variable_values", "substitute", "rate_interval",
           "legend_name", "format_value", "unit_scale", "axis_ticks", "axis_labels", "query_range", "first_sample",
           "render_dashboard"]

GRID_COLUMNS = 24
ROW_HEIGHT = 30          # px per grid row (Grafana's GRID_CELL_HEIGHT)
GAP = 8                  # px between panels (GRID_CELL_VMARGIN)
TITLE_HEIGHT = 32        # px of a panel's header
HEADER_HEIGHT = 56       # px of the page's header (the dashboard's title, the time range and the variables)
CLASSIC = ["#7EB26D", "#EAB839", "#6ED0E0", "#EF843C", "#E24D42", "#1F78C1", "#BA43A9", "#705DA0", "#508642",
           "#CCA300", "#447EBC", "#C15C17", "#890F02", "#0A437C", "#6D1F62", "#584477"]   # Grafana's classic palette
BACKGROUND, PANEL, TEXT, MUTED, GRID = "#111217", "#181b1f", "#ccccdc", "#8e8e9a", "#2c3235"
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


@dataclass(frozen=True)
class Box:
    """A panel's rectangle on the page, in CSS pixels."""
    left: int
    top: int
    width: int
    height: int


@dataclass(frozen=True)
class Series:
    """One series of a target's answer: its legend name and its (unix seconds, value) points."""
    name: str
    times: list[float]
    values: list[float]


def panel_boxes(panels: list[dict], width: int) -> list[Box]:
    """Each panel's rectangle on a page ``width`` px wide, from its ``gridPos`` (x, w in columns of 24;
    y, h in rows), laid out as Grafana lays them: column width such that 24 columns and 23 gaps fill
    the width, a panel of ``h`` rows ``h`` × 30 px plus the gaps between them."""
    column = (width - (GRID_COLUMNS - 1) * GAP) / GRID_COLUMNS
    boxes = []
    for panel in panels:
        grid = panel["gridPos"]
        if grid["x"] < 0 or grid["w"] < 1 or grid["x"] + grid["w"] > GRID_COLUMNS:
            raise ValueError(f"panel {panel.get('title')!r}: gridPos {grid} leaves the 24-column grid")
        boxes.append(Box(left=round(grid["x"] * (column + GAP)), top=grid["y"] * (ROW_HEIGHT + GAP),
                         width=round(grid["w"] * column + (grid["w"] - 1) * GAP),
                         height=grid["h"] * ROW_HEIGHT + (grid["h"] - 1) * GAP))
    return boxes


def page_height(panels: list[dict]) -> int:
    """The page's height in px: its header, then the grid down to the lowest panel's bottom edge."""
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    return HEADER_HEIGHT + rows * (ROW_HEIGHT + GAP)


def variable_values(dashboard: dict) -> dict[str, str]:
    """The value each of the dashboard's query variables takes with "All" selected (its ``allValue``).
    A variable without one cannot be expanded without Grafana: the error says which."""
    values = {}
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue   # a datasource variable picks the data source, which is Prometheus here
        if not variable.get("includeAll") or variable.get("allValue") is None:
            raise ValueError(f"variable ${variable['name']} has no allValue: give it one (e.g. \".*\") to draw "
                             "the dashboard for every value")
        values[variable["name"]] = variable["allValue"]
    return values


def substitute(expr: str, values: dict[str, str]) -> str:
    """``expr`` with ``$name``, ``${name}`` and ``[[name]]`` replaced by ``values[name]``; an unknown
    variable is an error naming it."""
    def replace(match: re.Match) -> str:
        name = next(group for group in match.groups() if group)
        if name not in values:
            raise ValueError(f"query {expr!r} uses ${name}, which has no value here")
        return values[name]
    return VARIABLE.sub(replace, expr)


def rate_interval(range_seconds: float, scrape_seconds: float, max_points: int) -> str:
    """Grafana's ``$__rate_interval``: max(``$__interval`` + scrape interval, 4 × scrape interval),
    where ``$__interval`` is the range over the panel's data points, never below the scrape interval.
    Whole seconds, as a PromQL duration."""
    interval = max(scrape_seconds, range_seconds / max_points)
    return f"{math.ceil(max(interval + scrape_seconds, 4 * scrape_seconds))}s"


def legend_name(legend_format: str, labels: dict[str, str]) -> str:
    """A series' name as Grafana writes it: ``{{label}}`` replaced by the label's value (empty when the
    series has no such label); with no format, the label set as PromQL prints it."""
    if legend_format:
        return LEGEND_LABEL.sub(lambda m: labels.get(m.group(1), ""), legend_format).strip()
    shown = {k: v for k, v in labels.items() if k != "__name__"}
    return labels.get("__name__", "") + "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(shown.items())) + "}"


def format_value(value: float, unit: str | None, decimals: int | None = None) -> str:
    """``value`` in Grafana's notation for the units the dashboard uses: ``percentunit`` (0.93 → 93.0%),
    ``s`` (ms below a second), ``Bps`` and ``bytes`` (decimal and binary prefixes), ``celsius``,
    ``ops``; anything else (or none) as a plain number."""
    if value is None or math.isnan(value):
        return "—"
    if unit == "percentunit":
        return f"{value * 100:.{1 if decimals is None else decimals}f}%"
    if unit == "s":
        return f"{value * 1000:.0f} ms" if abs(value) < 1 and value else f"{_plain(value, decimals)} s"
    if unit in ("Bps", "bytes"):
        base, prefixes = (1000, ["B", "kB", "MB", "GB", "TB"]) if unit == "Bps" else \
            (1024, ["B", "KiB", "MiB", "GiB", "TiB"])
        step = 0
        while abs(value) >= base and step < len(prefixes) - 1:
            value, step = value / base, step + 1
        return f"{_plain(value, decimals)} {prefixes[step]}" + ("/s" if unit == "Bps" else "")
    if unit == "celsius":
        return f"{value:.1f} °C"
    if unit == "ops":
        return f"{_plain(value, decimals)} ops/s"
    return _plain(value, decimals)


def unit_scale(magnitude: float, unit: str | None) -> float:
    """The prefix ``format_value`` writes a value of this magnitude with, as a factor (MiB: 2**20), so
    ticks can be placed at round numbers of what the axis shows."""
    base = {"bytes": 1024, "Bps": 1000}.get(unit)
    scale = 1.0
    while base and abs(magnitude) >= scale * base and scale < base ** 4:
        scale *= base
    return scale


def axis_ticks(low: float, high: float, unit: str | None, count: int = 5) -> list[float]:
    """At most ``count`` + 1 ticks in [low, high] at round numbers of the prefix the axis is written in
    (333.8, 334.0, 334.2 MiB rather than round numbers of bytes, which are not round in MiB)."""
    from matplotlib.ticker import MaxNLocator

    scale = unit_scale(max(abs(low), abs(high)), unit)
    ticks = MaxNLocator(count).tick_values(low / scale, high / scale) * scale
    return [float(t) for t in ticks if low - 1e-9 * abs(scale) <= t <= high + 1e-9 * abs(scale)]


def axis_labels(ticks: list[float], unit: str | None) -> list[str]:
    """Tick labels, each with the fewest decimals that write its tick exactly (333.5 MiB beside 334 MiB,
    not 334 MiB twice; 0.8 and 1.6, not 0.800 and 1.60)."""
    def number(label: str) -> float:
        return float(label.split()[0].rstrip("%"))

    def label(tick: float) -> str:
        exact = format_value(tick, unit, 6)
        for decimals in range(4):
            if math.isclose(number(format_value(tick, unit, decimals)), number(exact), rel_tol=1e-9, abs_tol=1e-12):
                return format_value(tick, unit, decimals)
        return format_value(tick, unit, 4)

    return [label(t) for t in ticks]


def _plain(value: float, decimals: int | None) -> str:
    if decimals is None:
        decimals = 0 if float(value).is_integer() or abs(value) >= 100 else 1 if abs(value) >= 10 else \
            2 if abs(value) >= 1 else 3
    return f"{value:.{decimals}f}"


def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list[tuple[dict, list]]:
    """Prometheus's answer to ``expr`` over [start, end]: (labels, [[t, "value"], ...]) per series.
    An error answer (a query Prometheus cannot parse) raises with Prometheus's own message."""
    params = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step}"})
    with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{params}", timeout=30) as answer:
        body = json.loads(answer.read())
    if body.get("status") != "success":
        raise ValueError(f"Prometheus refused {expr!r}: {body.get('error')}")
    return [(item["metric"], item["values"]) for item in body["data"]["result"]]


def first_sample(prometheus: str, expr: str, start: float, end: float, step: float) -> float | None:
    """The time of ``expr``'s first sample in [start, end], None when it has none."""
    times = [float(t) for _, points in query_range(prometheus, expr, start, end, step) for t, _ in points]
    return min(times, default=None)


def _series(prometheus: str, panel: dict, values: dict[str, str], start: float, end: float,
            step: float) -> list[Series]:
    out = []
    for target in panel.get("targets", []):
        expr = substitute(target["expr"], values)
        for labels, points in query_range(prometheus, expr, start, end, step):
            pairs = [(float(t), float(v)) for t, v in points if math.isfinite(float(v))]
            if pairs:
                out.append(Series(legend_name(target.get("legendFormat", ""), labels),
                                  [t for t, _ in pairs], [v for _, v in pairs]))
    return out


def _figure(width: int, height: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(width / 100, height / 100), dpi=100, facecolor=PANEL)
    return plt, fig


def _png(plt, fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", facecolor=PANEL, dpi=100)
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _with_gaps(series: Series, step: float) -> tuple[list[float], list[float]]:
    """The series with a NaN where steps are missing (the series was absent), so the line breaks there
    as Grafana's does (its default: nulls not spanned)."""
    times, values = [], []
    for t, v in zip(series.times, series.values):
        if times and t - times[-1] > 1.5 * step:
            times.append((t + times[-1]) / 2)
            values.append(math.nan)
        times.append(t)
        values.append(v)
    return times, values


def _timeseries_png(series: list[Series], unit: str | None, bars: bool, width: int, height: int,
                    start: float, end: float, step: float) -> str:
    from matplotlib.dates import DateFormatter
    from matplotlib.ticker import MaxNLocator
    import datetime as dt

    plt, fig = _figure(width, height)
    legend_rows = math.ceil(len(series) / max(1, width // 190))
    bottom = (24 + 18 * legend_rows) / height
    ax = fig.add_axes((80 / width, bottom, 1 - 110 / width, 1 - bottom - 6 / height), facecolor=PANEL)
    stamp = [dt.datetime.fromtimestamp(t) for t in (start, end)]
    if bars:
        times = sorted({t for s in series for t in s.times})
        base = {t: 0.0 for t in times}
        widths = (times[1] - times[0]) / 86400 * 0.8 if len(times) > 1 else 1 / 86400
        for i, s in enumerate(series):
            xs = [dt.datetime.fromtimestamp(t) for t in s.times]
            ax.bar(xs, s.values, width=widths, bottom=[base[t] for t in s.times], color=CLASSIC[i % len(CLASSIC)],
                   label=s.name)
            for t, v in zip(s.times, s.values):
                base[t] += v
    else:
        for i, s in enumerate(series):
            times, values = _with_gaps(s, step)
            ax.plot([dt.datetime.fromtimestamp(t) for t in times], values, color=CLASSIC[i % len(CLASSIC)],
                    linewidth=1.2, label=s.name)
    ax.set_xlim(*stamp)
    ax.xaxis.set_major_formatter(DateFormatter("%H:%M:%S"))
    ax.xaxis.set_major_locator(MaxNLocator(max(2, width // 110)))
    ticks = axis_ticks(*ax.get_ylim(), unit)
    ax.set_yticks(ticks, axis_labels(ticks, unit))
    ax.tick_params(colors=MUTED, labelsize=8, length=0)
    ax.grid(color=GRID, linewidth=0.6)
    for side in ax.spines.values():
        side.set_visible(False)
    if series:
        ax.legend(loc="upper left", bbox_to_anchor=(-72 / width, -22 / (height * (1 - bottom))),
                  ncol=max(1, width // 190), frameon=False, fontsize=8, labelcolor=TEXT, handlelength=1.2,
                  borderaxespad=0)
    else:
        ax.set_yticks([])
        ax.text(0.5, 0.5, "No data", transform=ax.transAxes, ha="center", va="center", color=MUTED, fontsize=12)
    return _png(plt, fig)


def _sparkline_png(series: Series, colour: str, width: int, height: int, start: float, end: float) -> str:
    plt, fig = _figure(width, height)
    ax = fig.add_axes((0, 0, 1, 1), facecolor=PANEL)
    ax.fill_between(series.times, series.values, min(series.values), color=colour, alpha=0.18, linewidth=0)
    ax.plot(series.times, series.values, color=colour, linewidth=1.2)
    ax.set_xlim(start, end)
    low, high = min(series.values), max(series.values)
    ax.set_ylim(low, high + (high - low or 1) * 1.5)   # the line in the lower part, under the value
    ax.axis("off")
    return _png(plt, fig)


def _threshold_colour(value: float) -> str:
    return "#F2495C" if value >= 80 else "#73BF69"   # Grafana's default thresholds: base green, red from 80


def _panel_html(panel: dict, box: Box, series: list[Series], start: float, end: float, step: float) -> str:
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
    inner_w, inner_h = box.width - 16, box.height - TITLE_HEIGHT - 8
    if panel["type"] == "stat":
        if series:
            s = series[0]
            colour = _threshold_colour(s.values[-1])
            graph = panel.get("options", {}).get("graphMode", "area") == "area" and len(s.values) > 1
            spark = (f'<img class="spark" src="data:image/png;base64,'
                     f'{_sparkline_png(s, colour, inner_w, inner_h, start, end)}">') if graph else ""
            shown = html.escape(format_value(s.values[-1], unit))
            body = f'{spark}<div class="stat" style="color:{colour}">{shown}</div>'
        else:
            body = '<div class="stat nodata">No data</div>'
    elif panel["type"] == "timeseries":
        custom = panel.get("fieldConfig", {}).get("defaults", {}).get("custom", {})
        bars = custom.get("drawStyle") == "bars" and custom.get("stacking", {}).get("mode", "none") != "none"
        body = (f'<img src="data:image/png;base64,'
                f'{_timeseries_png(series, unit, bars, inner_w, inner_h, start, end, step)}">')
    else:
        raise ValueError(f"panel {panel['title']!r} is a {panel['type']!r} panel: only stat and timeseries are drawn")
    return (f'<div class="panel" style="left:{box.left}px;top:{box.top}px;width:{box.width}px;height:{box.height}px">'
            f'<div class="title">{html.escape(panel["title"])}</div><div class="body">{body}</div></div>')


def render_dashboard(dashboard_path: Path, prometheus: str, start: float, end: float, *, scrape_seconds: float,
                     width: int = 1400, note: str = "") -> str:
    """The dashboard's panels, each target evaluated by ``prometheus`` over [start, end] (unix seconds),
    as one HTML page ``width`` px wide. ``note`` is written under the dashboard's title."""
    dashboard = json.loads(dashboard_path.read_text(encoding="utf-8"))
    panels = dashboard["panels"]
    boxes = panel_boxes(panels, width - 2 * GAP)
    points = 300
    step = max(scrape_seconds, (end - start) / points)
    values = {**variable_values(dashboard), "__rate_interval": rate_interval(end - start, scrape_seconds, points)}
    blocks = [_panel_html(p, b, _series(prometheus, p, values, start, end, step), start, end, step)
              for p, b in zip(panels, boxes)]
    height = page_height(panels) - HEADER_HEIGHT
    span = f"{time.strftime('%H:%M:%S', time.localtime(start))} to {time.strftime('%H:%M:%S', time.localtime(end))}"
    shown = ", ".join(f"{k} = {v}" for k, v in sorted(values.items()))
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(dashboard['title'])}</title><style>
body {{ margin:0; background:{BACKGROUND}; color:{TEXT}; font:13px Inter, "Helvetica Neue", Arial, sans-serif;
  width:{width}px }}
header {{ height:{HEADER_HEIGHT}px; box-sizing:border-box; padding:10px {GAP}px 0 }}
h1 {{ font-size:18px; font-weight:500; margin:0 0 4px }}
header p {{ margin:0; color:{MUTED}; font-size:12px }}
.grid {{ position:relative; margin:0 {GAP}px; height:{height}px }}
.panel {{ position:absolute; background:{PANEL}; border:1px solid #22252b; border-radius:2px; box-sizing:border-box;
  overflow:hidden }}
.title {{ height:{TITLE_HEIGHT}px; line-height:{TITLE_HEIGHT}px; padding:0 8px; font-weight:500; font-size:13px;
  white-space:nowrap; overflow:hidden; text-overflow:ellipsis }}
.body {{ position:relative; margin:0 8px }} .body img {{ display:block }}
.spark {{ position:absolute; left:0; top:0 }}
.stat {{ position:relative; font-size:38px; font-weight:500; text-align:center; line-height:{ROW_HEIGHT * 2}px }}
.nodata {{ color:{MUTED}; font-size:16px }}
</style></head><body><header><h1>{html.escape(dashboard['title'])}</h1>
<p>{html.escape(span)} · {html.escape(shown)} · {html.escape(note)}</p></header>
<div class="grid">{''.join(blocks)}</div></body></html>"""
