"""FedMA against FedAvg (and FedAvg + PANs) at equal traffic and at equal rounds, from a FedMA matrix's runs.

FedMA's claim is communication efficiency: better accuracy than FedAvg at fewer bytes. For every
FedMA run (one pass, three passes) this reads its final test accuracy, its total traffic (every
round's ``bytes_down + bytes_up``) and its phases, and the same seed's FedAvg run at

* **equal bytes**: FedAvg's test accuracy when its cumulative traffic reached FedMA's total,
  interpolated linearly between FedAvg's evaluations (every 5 rounds, and round 0), with the
  evaluations just before and just after that point: a learning curve is concave, so the
  interpolation is about a lower bound and the evaluation after an upper one;
* **equal rounds**: FedAvg's test accuracy after as many rounds as FedMA had phases, interpolated
  the same way;
* the bytes FedAvg needed to first reach FedMA's final accuracy (first evaluation at or above it).

The same equal-bytes and equal-rounds figures are read at each of FedMA's evaluations before its end
(``evaluations``; in the paper-regime matrix each pass's end), since the claim is about the whole curve
and not only its last point.

Where the matrix has the baseline's first rounds tested after every round (``fedavg-early``, same
seed, same trajectory) and FedMA's traffic falls within them, those evaluations are read instead,
so the bounds are one round apart.

Prints a table and writes ``bench/results/NAME_compare.json``: per (cell, method) the mean and
population std over seeds, every seed's figures, and FedMA minus the baseline at equal bytes and at
equal rounds paired per seed with its 95 % t-interval (``bench/paired.py``). A cell is a run's group
without its last axis, the method (``a0.5/cnn`` in the protocol's matrix).

    python bench/fedma_compare.py [--matrix fedma] [--results bench/results] [--baselines fedavg,fedavg+pan]
    python bench/fedma_compare.py --matrix fedma_paper --each-evaluation     # the paper's regime, per pass
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import mean, pstdev
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import RESULTS, write_result  # noqa: E402
from paired import paired  # noqa: E402


def _curve(rows: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(round, cumulative bytes, test accuracy) at each evaluated round."""
    total, points = 0, []
    for row in rows:
        total += int(row.get("bytes_down", 0)) + int(row.get("bytes_up", 0))
        if row.get("test_accuracy") is not None:
            points.append((row["round"], total, row["test_accuracy"]))
    r, b, a = (np.array(v, dtype=float) for v in zip(*points))
    return r, b, a


def _baseline_at(spent: float, phases: int, full: tuple[np.ndarray, ...],
                 fine: tuple[np.ndarray, ...] | None) -> dict[str, float | None]:
    """The baseline at FedMA's traffic ``spent`` and after as many rounds as FedMA's ``phases``, read from
    the finer curve (tested every round) where it reaches that far, else from the full run."""
    rounds_b, bytes_b, acc_b = fine if fine is not None and spent <= fine[1][-1] else full
    rounds_p, _, acc_p = fine if fine is not None and phases <= fine[0][-1] else full
    before, after = np.flatnonzero(bytes_b <= spent)[-1], np.flatnonzero(bytes_b >= spent)
    return {
        "baseline_accuracy_at_equal_bytes": float(np.interp(spent, bytes_b, acc_b)),
        "baseline_accuracy_before_equal_bytes": float(acc_b[before]),
        "baseline_accuracy_after_equal_bytes": float(acc_b[after[0]]) if len(after) else None,
        "baseline_accuracy_at_equal_rounds": float(np.interp(phases, rounds_p, acc_p)),
    }


def compare(fedma: dict[str, Any], base: dict[str, Any], early: dict[str, Any] | None = None) -> dict[str, Any]:
    """One FedMA run against its seed's baseline run, at its end and at each of its evaluations (a
    pass's end, when the matrix tests only those); ``early``: the same baseline's first rounds tested
    after every round, read instead where FedMA's traffic falls within them."""
    rounds_m, bytes_m, acc_m = _curve(fedma["rows"])
    final, spent, phases = float(acc_m[-1]), float(bytes_m[-1]), int(fedma["rounds"])
    full = _curve(base["rows"])
    fine = _curve(early["rows"]) if early is not None else None
    # where the baseline first reaches FedMA's accuracy: in the finer curve when it gets there
    rounds_r, bytes_r, acc_r = fine if fine is not None and (fine[2] >= final).any() else full
    reached = np.flatnonzero(acc_r >= final)
    return {
        "seed": fedma["seed"], "fedma_accuracy": final, "fedma_bytes": spent, "fedma_phases": phases,
        **_baseline_at(spent, phases, full, fine),
        "baseline_final_accuracy": float(full[2][-1]),
        "baseline_bytes_to_fedma_accuracy": float(bytes_r[reached[0]]) if len(reached) else None,
        "baseline_rounds_to_fedma_accuracy": int(rounds_r[reached[0]]) if len(reached) else None,
        "widths": (fedma.get("summary") or {}).get("fedma_final_widths"),
        "match_seconds": (fedma.get("summary") or {}).get("fedma_match_seconds"),
        "evaluations": [{"phase": int(r), "fedma_accuracy": float(a), "fedma_bytes": float(b),
                         **_baseline_at(float(b), int(r), full, fine)}
                        for r, b, a in zip(rounds_m, bytes_m, acc_m) if r > 0],
    }


def _stats(values: list[float | None]) -> dict[str, float] | None:
    kept = [v for v in values if v is not None]
    return {"mean": mean(kept), "std": pstdev(kept), "n": len(kept)} if kept else None


def _gain(result: dict[str, Any]) -> str:
    """A paired difference in points with its interval (none from one seed)."""
    interval = result["interval"]
    return f"{result['mean'] * 100:+.2f}" + ("" if interval is None else
                                             f" [{interval[0] * 100:+.2f}, {interval[1] * 100:+.2f}]")


SUMMARY_KEYS = ("fedma_accuracy", "fedma_bytes", "baseline_accuracy_at_equal_bytes",
                "baseline_accuracy_before_equal_bytes", "baseline_accuracy_after_equal_bytes",
                "baseline_accuracy_at_equal_rounds", "baseline_bytes_to_fedma_accuracy")


def _summary(figures: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """Each figure's mean and spread over seeds, and FedMA minus the baseline at equal bytes and at equal
    rounds paired per seed: the same for a run's end as for one of its evaluations."""
    return {"summary": {k: _stats([f.get(k) for f in figures]) for k in SUMMARY_KEYS},
            **{f"paired_at_equal_{at}": paired([f["fedma_accuracy"] - f[f"baseline_accuracy_at_equal_{at}"]
                                                for f in figures], seeds).as_dict() for at in ("bytes", "rounds")}}


def _table_row(cell: str, method: str, baseline: str, phase: int, n: int, result: dict[str, Any]) -> str:
    summary = result["summary"]

    def figure(key: str, scale: float, fmt: str) -> str:
        stats = summary[key]
        return "-" if stats is None else f"{stats['mean'] * scale:{fmt}} ± {stats['std'] * scale:{fmt}}"

    return (f"| {cell} | {method} | {baseline} | {phase} | {n} | {figure('fedma_accuracy', 100, '.2f')} "
            f"| {figure('fedma_bytes', 1e-6, '.1f')} | {figure('baseline_accuracy_at_equal_bytes', 100, '.2f')} "
            f"({figure('baseline_accuracy_before_equal_bytes', 100, '.2f')}; "
            f"{figure('baseline_accuracy_after_equal_bytes', 100, '.2f')}) "
            f"| {figure('baseline_accuracy_at_equal_rounds', 100, '.2f')} "
            f"| {figure('baseline_bytes_to_fedma_accuracy', 1e-6, '.1f')} "
            f"| {_gain(result['paired_at_equal_bytes'])} | {_gain(result['paired_at_equal_rounds'])} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--matrix", default="fedma",
                        help="the matrix whose runs to read, RESULTS/MATRIX/*.json (default fedma; fedma_paper "
                             "for the paper's regime)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the matrix's run directory is")
    parser.add_argument("--baselines", default="fedavg,fedavg+pan",
                        help="method labels to compare with, comma-separated (default fedavg,fedavg+pan)")
    parser.add_argument("--each-evaluation", action="store_true",
                        help="also print a row for each of FedMA's evaluations before its end (a pass's end "
                             "when the matrix tests only those); the JSON always holds them")
    args = parser.parse_args(argv)
    runs_dir = args.results / args.matrix
    runs: dict[tuple[str, str, int], dict[str, Any]] = {}
    for path in sorted(runs_dir.glob("*.json")):
        record = json.loads(path.read_text())
        cell, _, method = record["group"].rpartition("/")   # the method is the matrix's last axis
        runs[(cell, method, record["seed"])] = record
    if not runs:
        parser.error(f"no run files in {runs_dir}: run bench/run_matrix.py bench/matrices/{args.matrix}.toml first")
    out: list[dict[str, Any]] = []
    print("| cell | FedMA | vs | phase | seeds | FedMA accuracy | its total MB | baseline at equal bytes "
          "(evaluations before; after) | baseline at equal rounds | baseline MB to FedMA's accuracy "
          "| FedMA minus baseline at equal bytes, paired (95 % interval) | same at equal rounds |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (cell, method, seed), record in sorted(runs.items()):
        if not method.startswith("fedma") or seed != min(s for c, k, s in runs if (c, k) == (cell, method)):
            continue
        for baseline in args.baselines.split(","):
            pairs = [compare(runs[(cell, method, s)], runs[(cell, baseline, s)],
                             runs.get((cell, f"{baseline}-early", s)))
                     for c, k, s in sorted(runs) if (c, k) == (cell, method) and (cell, baseline, s) in runs]
            if not pairs:
                continue
            seeds = [p["seed"] for p in pairs]
            # every seed of a FedMA row is tested at the same phases: pair them evaluation by evaluation
            evaluations = [{"phase": each[0]["phase"], **_summary(list(each), seeds)}
                           for each in zip(*(p["evaluations"] for p in pairs))]
            result = {"cell": cell, "method": method, "baseline": baseline, "seeds": seeds,
                      **_summary(pairs, seeds), "evaluations": evaluations, "per_seed": pairs}
            out.append(result)
            for evaluation in evaluations[:-1] if args.each_evaluation else []:
                print(_table_row(cell, method, baseline, evaluation["phase"], len(pairs), evaluation))
            print(_table_row(cell, method, baseline, pairs[0]["fedma_phases"], len(pairs), result))
    write_result(args.results / f"{args.matrix}_compare.json", {
        "definitions": {
            "fedma_bytes": "bytes_down + bytes_up over all of the FedMA run's phases",
            "baseline_accuracy_at_equal_bytes": "the baseline's test accuracy at the same cumulative traffic, "
                                                "linear between its evaluations (every 5 rounds and round 0)",
            "baseline_accuracy_before_equal_bytes": "the baseline's last evaluation at or below that traffic",
            "baseline_accuracy_after_equal_bytes": "the baseline's first evaluation at or above that traffic",
            "baseline_accuracy_at_equal_rounds": "the baseline's test accuracy after as many rounds as FedMA had "
                                                 "phases, linear between its evaluations",
            "baseline_bytes_to_fedma_accuracy": "cumulative traffic at the baseline's first evaluation at or "
                                                "above FedMA's final accuracy",
        },
        "cells": out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
