"""Accuracy-per-round plots of a benchmark matrix's runs (``bench/run_matrix.py``), one PNG per cell of the other axes.

One axis is compared (by default the axis of the matrix's ``baseline``, the method axis; without a
baseline, the last axis). Every combination of the other axes' labels that has runs gets a figure
with one line per label of the compared axis, the baseline first and in black: the mean over
seeds of the metric at each evaluated round, the spread over seeds (min..max) shaded, and
"label (n seeds)" in the legend. With ``--x bytes`` the x axis is the cumulative traffic
(bytes_down + bytes_up summed over rounds, mean over seeds) on a log scale, to compare methods at
equal bytes (FedMA's few phases against FedAvg's rounds); ``--x upload`` counts bytes_up alone (upload
codecs, whose rows all download the same).

Only run files whose ``rounds`` is their cell's full length are read (the matrix's run.rounds, or
the entry's own run.rounds, as ``run_matrix.py`` runs them); ``--rounds N`` reads the runs of N
rounds instead (a shorter trial). Files that are not runs of the matrix, have no rows, or are
marked ``subset`` are skipped and counted.

Files: ``OUT_DIR/NAME-<the other axes' labels joined by _>[-personalized|-divergence][-bytes|-upload].png``.
``weight_divergence_mean`` needs runs with ``run.diagnostics = true`` (the PANs matrices).

    python bench/plot_matrix.py bench/matrices/pans.toml [--axis AXIS]
        [--metric test_accuracy|personalized_accuracy_mean|weight_divergence_mean] [--x round|bytes|upload] [--rounds N]
        [--out-dir docs/images] [--results bench/results]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_matrix import RESULTS, Matrix, expand, load_matrix  # noqa: E402

from coordinator.config import ConfigError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "docs" / "images"
# metric -> (y label, scale from the rows' value to the plotted one, file name suffix)
METRICS = {"test_accuracy": ("test accuracy (%)", 100.0, ""),
           "personalized_accuracy_mean": ("personalized accuracy, mean over clients (%)", 100.0, "-personalized"),
           "weight_divergence_mean": ("weight divergence, mean over layers", 1.0, "-divergence")}
FIGSIZE, DPI = (6.0, 4.0), 100


class PlotError(Exception):
    """A matrix that cannot be plotted as asked; the message says why and what to run."""


# x axes in cumulative bytes: their label and the row fields summed
X_AXES = {"bytes": ("cumulative bytes (down + up)", ("bytes_down", "bytes_up")),
          "upload": ("cumulative upload bytes (all devices)", ("bytes_up",))}


@dataclass
class Series:
    """One line of a figure: per evaluated round, the metric and the cumulative bytes of each seed."""

    label: str
    counted: tuple[str, ...] = ("bytes_down", "bytes_up")   # the row fields the cumulative bytes sum
    seeds: list[int] = field(default_factory=list)
    points: dict[int, list[tuple[float, float]]] = field(default_factory=dict)   # round -> [(value, bytes)]

    def add(self, seed: int, rows: list[dict[str, Any]], metric: str) -> bool:
        total, points = 0.0, []
        for row in sorted(rows, key=lambda r: r.get("round", 0)):
            total += sum(float(row.get(key) or 0) for key in self.counted)
            if row.get(metric) is not None and "round" in row:
                points.append((int(row["round"]), float(row[metric]), total))
        if not points:
            return False
        self.seeds.append(seed)
        for rnd, value, cumulative in points:
            self.points.setdefault(rnd, []).append((value, cumulative))
        return True

    def arrays(self) -> dict[str, np.ndarray]:
        """round, mean, min, max of the metric and mean cumulative bytes, over the seeds evaluated there."""
        rounds = sorted(self.points)
        values = [np.array([v for v, _ in self.points[r]]) for r in rounds]
        return {"round": np.array(rounds, dtype=float),
                "mean": np.array([v.mean() for v in values]),
                "min": np.array([v.min() for v in values]),
                "max": np.array([v.max() for v in values]),
                "bytes": np.array([np.mean([b for _, b in self.points[r]]) for r in rounds])}


def compared_axis(matrix: Matrix, axis: str | None) -> str:
    axes = list(matrix.axes)
    if axis is None:
        return matrix.baseline[0] if matrix.baseline else axes[-1]
    if axis not in axes:
        raise PlotError(f"{matrix.path}: no axis {axis!r}; its axes are {', '.join(axes)}")
    return axis


def expected_rounds(matrix: Matrix, rounds: int | None) -> dict[str, int]:
    """Each cell's group -> the rounds of its full runs (or ``rounds`` for every cell)."""
    return {run.group: run.rounds for run in expand(matrix, None, rounds, [])}


def read_runs(matrix: Matrix, results: Path, rounds: int | None) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The matrix's run files of the expected length, and why the others were skipped (reason -> count)."""
    directory = results / matrix.name
    wanted = expected_rounds(matrix, rounds)
    records, skipped, other = [], {}, set()

    def skip(reason: str) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1

    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            skip("unreadable")
            continue
        if not isinstance(record, dict) or "group" not in record or "seed" not in record:
            skip("not a run file")
        elif record.get("subset"):
            skip("marked subset")
        elif not isinstance(record.get("rows"), list) or not record["rows"]:
            skip("no rows")
        elif record["group"] not in wanted:
            skip("not a cell of the matrix")
        elif record.get("rounds") != wanted[record["group"]]:
            skip("other round counts")
            other.add(record.get("rounds"))
        else:
            records.append(record)
    if not records:
        found = f" ({sum(skipped.values())} other files skipped: {_reasons(skipped)})" if skipped else ""
        what = f"runs of {rounds} rounds" if rounds is not None else "full-length runs"
        raise PlotError(f"no {what} of matrix {matrix.name!r} in {directory}{found}; run them with: "
                        f"python bench/run_matrix.py {_shown(matrix.path)} --skip-existing"
                        + (f" --rounds {rounds}" if rounds is not None else "")
                        + (f", or plot the runs of {_listed(other)} rounds present with --rounds N" if other else ""))
    return records, skipped


def _reasons(skipped: dict[str, int]) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in skipped.items())


def _listed(values: set[Any]) -> str:
    return ", ".join(str(v) for v in sorted(v for v in values if isinstance(v, int)))


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def figures(matrix: Matrix, axis: str, records: list[dict[str, Any]],
            metric: str, x: str = "round") -> list[tuple[tuple[str, ...], list[Series]]]:
    """(fixed labels, lines) per combination of the other axes' labels with runs, in the matrix's order;
    the lines in the compared axis's order, the baseline first."""
    position = list(matrix.axes).index(axis)
    order = list(dict.fromkeys(str(e["label"]) for e in matrix.axes[axis]))
    if matrix.baseline and matrix.baseline[0] == axis:
        order.remove(matrix.baseline[1])
        order.insert(0, matrix.baseline[1])
    cells = [tuple(run.group.split("/")) for run in expand(matrix, None, None, [])]
    fixed_order = list(dict.fromkeys(labels[:position] + labels[position + 1:] for labels in cells))
    lines: dict[tuple[str, ...], dict[str, Series]] = {}
    for record in sorted(records, key=lambda r: r["seed"]):
        labels = tuple(record.get("labels") or record["group"].split("/"))
        fixed, label = labels[:position] + labels[position + 1:], labels[position]
        series = lines.setdefault(fixed, {}).setdefault(label, Series(label, X_AXES.get(x, X_AXES["bytes"])[1]))
        series.add(int(record["seed"]), record["rows"], metric)
    out = []
    for fixed in fixed_order:
        found = [lines.get(fixed, {}).get(label) for label in order]
        found = [s for s in found if s is not None and s.seeds]
        if found:
            out.append((fixed, found))
    return out


def draw(matrix: Matrix, fixed: tuple[str, ...], lines: list[Series], metric: str, x: str,
         baseline: str | None, path: Path) -> None:
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    ylabel, scale, _ = METRICS[metric]
    colors = iter(plt.get_cmap("tab10").colors)
    for series in lines:
        a = series.arrays()
        xs = a["round"] if x == "round" else a["bytes"]
        keep = np.ones_like(xs, dtype=bool) if x == "round" else xs > 0   # round 0 has no bytes: off a log axis
        if not keep.any():
            continue
        color = "black" if series.label == baseline else next(colors)
        n = len(series.seeds)
        ax.plot(xs[keep], scale * a["mean"][keep], color=color, linewidth=1.8 if series.label == baseline else 1.4,
                marker="o" if keep.sum() <= 12 else None, markersize=3.5,
                label=f"{series.label} ({n} seed{'s' if n != 1 else ''})")
        if n > 1:
            ax.fill_between(xs[keep], scale * a["min"][keep], scale * a["max"][keep], color=color, alpha=0.2,
                            linewidth=0)
    if x != "round":
        ax.set_xscale("log")
        ax.set_xlabel(X_AXES[x][0])
    else:
        ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{matrix.name}: {' / '.join(fixed)}" if fixed else matrix.name)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=DPI)
    plt.close(fig)


def plot_matrix(matrix_path: Path, axis: str | None = None, metric: str = "test_accuracy", x: str = "round",
                out_dir: Path = OUT_DIR, results: Path = RESULTS,
                rounds: int | None = None) -> tuple[list[Path], dict[str, int]]:
    """Write the matrix's figures; the files written and the skipped run files (reason -> count)."""
    if metric not in METRICS:
        raise PlotError(f"unknown metric {metric!r}; one of {', '.join(METRICS)}")
    if x not in ("round", *X_AXES):
        raise PlotError(f"unknown x axis {x!r}; round, {' or '.join(X_AXES)}")
    try:
        matrix = load_matrix(matrix_path)
    except ConfigError as exc:
        raise PlotError(str(exc)) from None
    if not matrix.axes:
        raise PlotError(f"{matrix_path}: the matrix has no axes")
    axis = compared_axis(matrix, axis)
    records, skipped = read_runs(matrix, results, rounds)
    baseline = matrix.baseline[1] if matrix.baseline and matrix.baseline[0] == axis else None
    groups = figures(matrix, axis, records, metric, x)
    if not groups:
        raise PlotError(f"none of the {len(records)} runs of {matrix.name!r} in {results / matrix.name} "
                        f"has {metric}; try --metric "
                        + " or --metric ".join(m for m in METRICS if m != metric))
    written = []
    suffix = METRICS[metric][2] + ("" if x == "round" else f"-{x}")
    for fixed, lines in groups:
        name = "-".join([matrix.name, "_".join(fixed)]) if fixed else matrix.name
        path = out_dir / f"{name}{suffix}.png"
        draw(matrix, fixed, lines, metric, x, baseline, path)
        written.append(path)
    return written, skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("matrix", type=Path, help="matrix file, e.g. bench/matrices/pans.toml")
    parser.add_argument("--axis", help="the compared axis, one line per label (default: the baseline's axis)")
    parser.add_argument("--metric", default="test_accuracy", choices=list(METRICS), help="default test_accuracy")
    parser.add_argument("--x", default="round", choices=["round", *X_AXES],
                        help="x axis: round, cumulative bytes down + up (bytes) or up only (upload), on a log scale")
    parser.add_argument("--rounds", type=int, help="read the runs of N rounds instead of the full-length runs")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR, help="where the PNGs go (default docs/images)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="results directory (default bench/results)")
    args = parser.parse_args(argv)
    try:
        written, skipped = plot_matrix(args.matrix, args.axis, args.metric, args.x, args.out_dir, args.results,
                                       args.rounds)
    except PlotError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(_shown(path))
    if skipped:
        print(f"skipped {sum(skipped.values())} run files: {_reasons(skipped)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
