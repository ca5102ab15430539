"""DFL against FedAvg, partition by partition, and the held-out shift's pre-stated check.

Why: the matrix report (``bench/run_matrix.py bench/matrices/dfl.toml --report``) gives each row's
mean over seeds; the paper's claim is about the *difference* to FedAvg, and the held-out partition
(``invert5``, docs/evidence/dfl.md "The held-out shift") was given a criterion before any of its runs:
DFL's personalized accuracy on ``invert5`` at least as far above FedAvg's as on *each* of the other
partitions, and its worst client no further below its mean than on each of them. This script
computes both from the run files, pairing each seed's run with FedAvg's run of the same seed and
partition (same clients, same data), so the seed-to-seed noise they share cancels.

Per partition and row, from ``bench/results/dfl/*-r100.json`` (runs of the full length only):

- ``personalized``: the mean over clients of each one's held-out accuracy, mean of the last 5
  evaluations, per seed, then mean and population std over seeds;
- ``gain``: that minus FedAvg's of the same seed, mean and std over seeds;
- ``over_dfl``: for DFL's variants (rows ``dfl-*``: diversity, the refreshed evaluation), the same
  difference to plain DFL's run of the same seed: what the variant adds to the method;
- ``worst`` and ``worst_gap``: the worst client (same averaging) and how far below the row's mean.

Prints one table per partition and the check, writes ``bench/results/dfl_verdict.json``.

    python bench/dfl_verdict.py [--results bench/results] [--rows dfl,dfl-div2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench_io import RESULTS, write_result
from paired import paired_difference
from run_matrix import expand, final_mean, load_matrix

BENCH = Path(__file__).resolve().parent
MATRIX = BENCH / "matrices" / "dfl.toml"
BASELINE = "fedavg"
METHOD = "dfl"
HELD_OUT = "invert5"


def _stats(values: list[float]) -> dict[str, Any]:
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values), "per_seed": values}


def per_seed(records: list[dict[str, Any]]) -> dict[tuple[str, str], dict[int, dict[str, float]]]:
    """(partition, row) -> seed -> the run's personalized mean and worst client over its last evaluations."""
    cells: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    for rec in records:
        mean = final_mean(rec["rows"], "personalized_accuracy_mean")
        worst = final_mean(rec["rows"], "personalized_accuracy_min")
        if mean is None or worst is None:
            continue
        partition, row = rec["labels"]
        cells.setdefault((partition, row), {})[rec["seed"]] = {"mean": mean, "worst": worst}
    return cells


def _paired(seeds: dict[int, dict[str, float]], reference: dict[int, dict[str, float]]) -> dict[str, Any]:
    """A row's personalized mean minus ``reference``'s, seed by seed, over the seeds both ran (the shared
    pairing of bench/paired.py), shown as mean and population std like the table's other figures; the
    95 % intervals are bench/paired_report.py's (run it on bench/matrices/dfl.toml)."""
    diff = paired_difference({s: v["mean"] for s, v in seeds.items()}, {s: v["mean"] for s, v in reference.items()})
    assert diff is not None, "callers pair only rows that share a seed"
    return _stats(list(diff.differences))


def compare(cells: dict[tuple[str, str], dict[int, dict[str, float]]], order: list[str]) -> dict[str, dict[str, Any]]:
    """Per partition and row (in ``order``, the matrix's "partition/row" groups): accuracy, paired gain
    over FedAvg and worst-client gap, over the seeds both the row and FedAvg ran."""
    table: dict[str, dict[str, Any]] = {}
    rank = {group: i for i, group in enumerate(order)}
    for (partition, row), seeds in sorted(cells.items(), key=lambda c: rank.get("/".join(c[0]), len(rank))):
        base = cells.get((partition, BASELINE), {})
        paired = sorted(set(seeds) & set(base))
        if not paired:
            continue
        table.setdefault(partition, {})[row] = {
            "seeds": paired,
            "personalized": _stats([seeds[s]["mean"] for s in paired]),
            "gain": _paired(seeds, base),
            "worst": _stats([seeds[s]["worst"] for s in paired]),
            "worst_gap": _stats([seeds[s]["mean"] - seeds[s]["worst"] for s in paired]),
        }
        method = cells.get((partition, METHOD), {})
        if row.startswith(f"{METHOD}-") and set(seeds) & set(method):
            table[partition][row]["over_dfl"] = _paired(seeds, method)
    return table


def held_out_check(table: dict[str, dict[str, Any]], row: str) -> dict[str, Any] | None:
    """The pre-stated criterion for ``row`` on the held-out partition, or None until every partition has it."""
    others = [p for p in table if p != HELD_OUT]
    if HELD_OUT not in table or not others or any(row not in table[p] for p in [HELD_OUT, *others]):
        return None
    held = table[HELD_OUT][row]
    gain_ok = all(held["gain"]["mean"] >= table[p][row]["gain"]["mean"] for p in others)
    gap_ok = all(held["worst_gap"]["mean"] <= table[p][row]["worst_gap"]["mean"] for p in others)
    return {"row": row, "gain": {p: table[p][row]["gain"]["mean"] for p in [*others, HELD_OUT]},
            "worst_gap": {p: table[p][row]["worst_gap"]["mean"] for p in [*others, HELD_OUT]},
            "gain_at_least_as_large": gain_ok, "worst_gap_no_larger": gap_ok, "generalizes": gain_ok and gap_ok}


def _pm(stats: dict[str, Any], signed: bool = False) -> str:
    sign = "+" if signed else ""
    return f"{100 * stats['mean']:{sign}.2f} ± {100 * stats['std']:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="results directory (default bench/results)")
    parser.add_argument("--rows", default="dfl,dfl-div2", help="rows the held-out check judges (comma-separated)")
    args = parser.parse_args()
    console = Console(width=None if sys.stdout.isatty() else 130)
    matrix = load_matrix(MATRIX)
    run_dir = args.results / matrix.name
    records = [json.loads(p.read_text()) for p in sorted(run_dir.glob(f"*-r{matrix.full_rounds}.json"))]
    if not records:
        console.print(f"[red]no full-length run files in {run_dir}: run bench/run_matrix.py {MATRIX} first[/red]")
        return 1
    table = compare(per_seed(records), [run.group for run in expand(matrix, None, None, [])])
    for partition, rows in table.items():
        out = Table(title=f"{partition}: personalized accuracy (last 5 evaluations), vs {BASELINE} of the same seed")
        for column in ("row", "seeds", "personalized", "gain over FedAvg", "over DFL", "worst client",
                       "mean - worst"):
            out.add_column(column, justify="left" if column == "row" else "right")
        for row, fig in rows.items():
            out.add_row(row, ",".join(map(str, fig["seeds"])), _pm(fig["personalized"]), _pm(fig["gain"], True),
                        _pm(fig["over_dfl"], True) if "over_dfl" in fig else "", _pm(fig["worst"]),
                        _pm(fig["worst_gap"]))
        console.print(out)
    checks = {row: held_out_check(table, row) for row in args.rows.split(",")}
    for row, check in checks.items():
        if check is None:
            console.print(f"held-out check for {row}: not yet (needs {HELD_OUT} and every other partition)")
            continue
        gains = ", ".join(f"{p} {100 * g:+.2f}" for p, g in check["gain"].items())
        gaps = ", ".join(f"{p} {100 * g:.2f}" for p, g in check["worst_gap"].items())
        console.print(f"held-out check for {row}: gain over FedAvg {gains} -> "
                      f"{'at least as large' if check['gain_at_least_as_large'] else 'smaller'}; "
                      f"mean - worst {gaps} -> {'no larger' if check['worst_gap_no_larger'] else 'larger'}; "
                      f"[bold]{'generalizes' if check['generalizes'] else 'does not generalize'}[/bold]",
                      highlight=False)
    write_result(args.results / "dfl_verdict.json", {
        "matrix": str(MATRIX.relative_to(BENCH.parent)), "baseline": BASELINE, "held_out": HELD_OUT,
        "runs": len(records), "partitions": table, "held_out_check": checks,
        "figures": "fractions; per seed the last 5 evaluations' mean, then mean and population std over seeds; "
                   "gain paired with FedAvg's run of the same partition and seed"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
