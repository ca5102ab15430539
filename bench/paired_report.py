"""Every row of a matrix against its baseline row, paired seed by seed, with a 95 % t-interval.

Why: a matrix's table (``bench/run_matrix.py MATRIX --report``) gives each row's mean ± spread over
seeds, and two such figures overlap even where one row beats the other in every seed: the runs of one
seed share the partition, the initialization and the clients drawn each round, so their difference is
what to average. A verdict says "reproduced" only when this interval excludes zero in the paper's
direction (docs/benchmarks.md, "The evidence at a glance").

Reads the committed run files only (never runs anything): the matrix's runs as ``bench/run_matrix.py``
expands them, ``RESULTS/NAME/LABELS-sSEED-rROUNDS.json``. Each row (a label on the baseline's axis,
``baseline = "AXIS=LABEL"`` in the matrix, or ``--baseline``) is paired with the baseline row of the same
cell (the same labels on every other axis) and seed; only the seeds both ran count (n is reported), and
a run that stopped (``failure``) has no figure. The figure per run is the same for every row:

- ``last5``: the mean of the last 5 evaluations (the protocol's figure, ``run_matrix.final_mean``);
- ``final``: the last evaluation (for SphereFed + FFC the calibrated model a run ends with);
- ``best``: the best evaluation of the run;

of ``--key`` (``test_accuracy``, or ``personalized_accuracy_mean`` for DFL's personalized figure).
``--derive ROW=TWIN`` reads ROW's missing seeds off TWIN's runs before their calibration, as
``bench/spherefed_ffc.py`` does for SphereFed without FFC (its runs are its twin's until the last round).

Prints the table, writes ``bench/results/paired/NAME.json`` (``NAME[-vs-BASELINE][-METRIC][-KEY].json``
for another baseline than the matrix's or another figure, or ``--out``).

    python bench/paired_report.py bench/matrices/fed2.toml [--baseline fedavg] [--metric last5|final|best]
        [--key test_accuracy] [--derive sphere=sphere+ffc] [--results bench/results] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import RESULTS, write_result  # noqa: E402
from paired import CONFIDENCE, paired_difference  # noqa: E402
from run_matrix import LAST_ROUNDS, Matrix, Run, expand, final_mean, load_matrix  # noqa: E402
from spherefed_ffc import _accuracy_rows as uncalibrated_rows  # noqa: E402
from coordinator.config import ConfigError  # noqa: E402

__all__ = ["METRICS", "compare", "main", "run_figure"]


def _evaluated(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key] for r in rows if r["round"] > 0 and r.get(key) is not None]


METRICS: dict[str, tuple[str, Callable[[list[dict[str, Any]], str], float | None]]] = {
    "last5": (f"mean of the last {LAST_ROUNDS} evaluations", final_mean),
    "final": ("the last evaluation", lambda rows, key: (_evaluated(rows, key) or [None])[-1]),
    "best": ("the best evaluation", lambda rows, key: max(_evaluated(rows, key), default=None)),
}


def run_figure(record: dict[str, Any], metric: str, key: str) -> float | None:
    """One run's figure on ``metric`` of ``key``; None for a run that stopped or never evaluated ``key``."""
    if record.get("failure"):
        return None
    return METRICS[metric][1](record["rows"], key)


def _baseline(matrix: Matrix, label: str | None) -> tuple[int, str]:
    """(position of the baseline's axis, baseline label) from ``--baseline`` (LABEL or AXIS=LABEL) or the matrix."""
    if label and "=" in label:
        axis, _, label = label.partition("=")
    else:
        if matrix.baseline is None and label is None:
            raise ConfigError(f"{matrix.path} names no baseline: pass --baseline AXIS=LABEL")
        axis = matrix.baseline[0] if matrix.baseline else ""
        label = label or matrix.baseline[1]   # type: ignore[index]
    if axis not in matrix.axes or label not in [str(e["label"]) for e in matrix.axes[axis]]:
        raise ConfigError(f"--baseline {label!r} is no label of axis {axis!r} in {matrix.path}; its labels: "
                          + ", ".join(f"{a}={e['label']}" for a, es in matrix.axes.items() for e in es))
    return list(matrix.axes).index(axis), label


def _derivations(spec: list[str]) -> dict[str, str]:
    out = {}
    for item in spec:
        row, _, twin = item.partition("=")
        if not row or not twin:
            raise ConfigError(f"--derive must be ROW=TWIN (e.g. sphere=sphere+ffc), got {item!r}")
        out[row] = twin
    return out


def collect(matrix: Matrix, results: Path, position: int, metric: str, key: str,
            derive: dict[str, str]) -> tuple[dict[tuple[str, str], dict[int, dict[str, Any]]], list[str]]:
    """(cell, row) -> seed -> the run's figure, file and rounds, for the matrix's runs whose file exists;
    and the run files missing. A cell is the run's labels without the baseline's axis, joined by "/"."""
    run_dir = results / matrix.name
    if not run_dir.is_dir():
        raise ConfigError(f"no run files in {run_dir}: run python bench/run_matrix.py {matrix.path} "
                          "(or pass --results DIR)")
    runs = expand(matrix, None, None, [])
    cells: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    missing = []

    def add(run: Run, path: Path, derived_from: str = "") -> None:
        record = json.loads(path.read_text())
        if derived_from:
            record = {**record, "rows": uncalibrated_rows(record, True)}
        cell = "/".join(run.labels[:position] + run.labels[position + 1:])
        cells.setdefault((cell, run.labels[position]), {})[run.seed] = {
            "figure": run_figure(record, metric, key), "rounds": run.rounds, "failure": record.get("failure"),
            "file": path.name, "derived_from": derived_from}

    for run in runs:
        path = run_dir / run.file_name
        if path.exists():
            add(run, path)
        else:
            missing.append(run.file_name)
    for row, twin in derive.items():   # a row's seeds read off its twin's runs, where it has no run of its own
        for run in runs:
            if run.labels[position] != twin:
                continue
            labels = (*run.labels[:position], row, *run.labels[position + 1:])
            cell = "/".join(labels[:position] + labels[position + 1:])
            path = run_dir / run.file_name
            if path.exists() and run.seed not in cells.get((cell, row), {}):
                add(Run(labels, run.seed, run.rounds, run.overrides), path, derived_from=twin)
    return cells, missing


def _spread(values: list[float]) -> dict[str, Any]:
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values), "per_seed": values}


def compare(cells: dict[tuple[str, str], dict[int, dict[str, Any]]], baseline: str,
            order: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """One entry per (cell, row other than the baseline) in the matrix's order: both rows' figures over the
    seeds both have, and the paired difference (row minus baseline) with its interval."""
    out = []
    for cell, row in order:
        if row == baseline or (cell, row) not in cells:
            continue
        mine = {s: v["figure"] for s, v in cells[(cell, row)].items() if v["figure"] is not None}
        base = {s: v["figure"] for s, v in cells.get((cell, baseline), {}).items() if v["figure"] is not None}
        diff = paired_difference(mine, base)
        entry: dict[str, Any] = {
            "cell": cell, "row": row, "baseline": baseline,
            "rounds": sorted({v["rounds"] for v in cells[(cell, row)].values()}),
            "baseline_rounds": sorted({v["rounds"] for v in cells.get((cell, baseline), {}).values()}),
            "seeds_row": sorted(cells[(cell, row)]), "seeds_baseline": sorted(cells.get((cell, baseline), {})),
            "failed": {s: v["failure"] for s, v in cells[(cell, row)].items() if v["failure"]},
            "derived": {s: v["derived_from"] for s, v in cells[(cell, row)].items() if v["derived_from"]},
            "difference": None if diff is None else diff.as_dict()}
        if diff is not None:
            entry["row_figure"] = _spread([mine[s] for s in diff.seeds])
            entry["baseline_figure"] = _spread([base[s] for s in diff.seeds])
        out.append(entry)
    return out


def _pts(value: float | None, signed: bool = False) -> str:
    return "-" if value is None else f"{100 * value:{'+' if signed else ''}.2f}"


def verdict(diff: dict[str, Any] | None) -> str:
    """What the interval says, without a paper's direction (the method pages add it)."""
    if diff is None:
        return "no common seed"
    if diff["interval"] is None:
        return f"n = {diff['n']}: no interval"
    return {1: "above (excludes 0)", -1: "below (excludes 0)", 0: "holds 0"}[diff["direction"]]


def show(console: Console, title: str, entries: list[dict[str, Any]]) -> None:
    table = Table(title=title)
    for name in ("cell", "row", "vs", "rounds", "seeds (n)", "row %", "baseline %", "paired Δ (points)",
                 "95 % interval", "interval"):
        table.add_column(name, justify="left" if name in ("cell", "row", "vs", "interval") else "right")
    for e in entries:
        d = e["difference"]
        derived = f" ({','.join(map(str, e['derived']))} from {next(iter(e['derived'].values()))})" \
            if e["derived"] else ""
        table.add_row(e["cell"], e["row"] + derived, e["baseline"],
                      f"{'/'.join(map(str, e['rounds']))} vs {'/'.join(map(str, e['baseline_rounds']))}",
                      "-" if d is None else f"{','.join(map(str, d['seeds']))} ({d['n']})",
                      "-" if d is None else f"{_pts(e['row_figure']['mean'])} ± {_pts(e['row_figure']['std'])}",
                      "-" if d is None else f"{_pts(e['baseline_figure']['mean'])} ± "
                                            f"{_pts(e['baseline_figure']['std'])}",
                      "-" if d is None else f"{_pts(d['mean'], True)} ± {_pts(d['std'])}",
                      "-" if d is None or d["interval"] is None else
                      f"[{_pts(d['interval'][0], True)}, {_pts(d['interval'][1], True)}]",
                      verdict(d))
    console.print(table)


def default_name(matrix: Matrix, baseline: str, metric: str, key: str) -> str:
    """``NAME[-vs-BASELINE][-METRIC][-KEY].json``: every choice other than the default is in the name, so
    that pairing with another row or on another figure writes beside the default file, not over it."""
    name = matrix.name
    name += "" if matrix.baseline and baseline == matrix.baseline[1] else f"-vs-{baseline}"
    name += "" if metric == "last5" else f"-{metric}"
    name += "" if key == "test_accuracy" else f"-{key}"
    return name + ".json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("matrix", type=Path, help="matrix file, e.g. bench/matrices/fed2.toml")
    parser.add_argument("--baseline", help="the row every other row is paired with: a label on the matrix's "
                                           "baseline axis, or AXIS=LABEL (default: the matrix's baseline)")
    parser.add_argument("--metric", choices=sorted(METRICS), default="last5",
                        help="the figure per run, the same for every row (default last5, the protocol's)")
    parser.add_argument("--key", default="test_accuracy",
                        help="the metric row key (default test_accuracy; personalized_accuracy_mean for DFL)")
    parser.add_argument("--derive", action="append", default=[], metavar="ROW=TWIN",
                        help="read ROW's missing seeds off TWIN's runs before calibration (sphere=sphere+ffc)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="results directory (default bench/results)")
    parser.add_argument("--out", type=Path, help="JSON file (default RESULTS/paired/NAME[-vs-BASELINE][-METRIC][-KEY].json)")
    args = parser.parse_args()
    console = Console(width=None if sys.stdout.isatty() else 170)
    if not args.matrix.is_file():
        console.print(f"[red]no matrix file {args.matrix}: the matrices are bench/matrices/*.toml[/red]")
        return 2
    try:
        matrix = load_matrix(args.matrix)
        position, baseline = _baseline(matrix, args.baseline)
        cells, missing = collect(matrix, args.results, position, args.metric, args.key, _derivations(args.derive))
    except ConfigError as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    order = list(dict.fromkeys(("/".join(r.labels[:position] + r.labels[position + 1:]), r.labels[position])
                               for r in expand(matrix, None, None, [])))
    entries = compare(cells, baseline, order)
    if not any(e["difference"] for e in entries):
        console.print(f"[red]no run of {matrix.name} pairs with a {baseline} run of the same cell and seed under "
                      f"{args.results / matrix.name}: run python bench/run_matrix.py {args.matrix}[/red]")
        return 1
    axis = list(matrix.axes)[position]
    figure = f"{METRICS[args.metric][0]} of {args.key}"
    show(console, f"{matrix.name}: each {axis} row minus {baseline} of the same cell and seed; figure: {figure}",
         entries)
    unpaired = sorted({e["row"] for e in entries if e["difference"] is None})
    if unpaired:
        console.print(f"not paired (no seed shared with {baseline}): {', '.join(unpaired)}")
    out = args.out or args.results / "paired" / default_name(matrix, baseline, args.metric, args.key)
    write_result(out, {
        "matrix": matrix.name, "file": str(args.matrix), "axis": axis, "baseline": baseline,
        "metric": args.metric, "key": args.key, "figure": figure,
        "statistic": f"per seed, row minus {baseline} of the same cell and seed (the seeds both ran); mean, sample "
                     f"std and two-sided {100 * CONFIDENCE:.0f} % Student-t interval over those differences "
                     "(none below 2 seeds); row and baseline figures: mean and population std over the same seeds",
        "derived": {row: twin for row, twin in _derivations(args.derive).items()},
        "missing": missing, "comparisons": entries})
    return 0


if __name__ == "__main__":
    sys.exit(main())
