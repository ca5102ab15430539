"""Accuracy against epsilon: the privacy matrix's table, paired with the non-private run, and its plot.

Why: the matrix report (``bench/run_matrix.py bench/matrices/privacy.toml --report``) gives each
cell's mean over seeds; what a fleet owner asks is what a given epsilon *costs*, and the run without
noise of the same seed (same partition, initialization and selection) is the reference whose
seed-to-seed noise cancels in the difference.

Per fleet, partition and epsilon, from ``bench/results/privacy/*-r100.json`` (full-length runs only):

- ``accuracy``: mean test accuracy of the last 5 evaluations, per seed, then mean and population std; a run
  that stopped (every device it drew diverged on the noisy model, a RunError) has no figure: it is listed
  under ``failed`` with the last round it finished;
- ``cost``: that minus the non-private run of the same seed, mean and a 95 % Student-t interval over
  the paired seeds (no interval from one seed);
- ``epsilon``: the account's final ``dp_epsilon`` (largest over seeds; every seed has the same
  schedule), ``noise_std``: the noise on the mean per coordinate, ``clipped``: the mean share of
  updates the clip norm cut;
- ``accounts``: what epsilon the runs really have (bench/privacy_draws.py, largest over seeds): their draws were
  seeded by the run's seed, which every device knows, so the quoted Poisson account does not hold against the
  devices; ``seeded`` is the most-drawn device's (no amplification), ``fixed`` what a secret draw of the same size
  would give (replace-one), ``poisson`` what Poisson sampling gives, each by PLD and RDP.

Prints the table, writes ``bench/results/privacy_epsilon.json`` and one figure,
``docs/images/privacy-epsilon.png`` (accuracy against epsilon, one line per fleet and partition, the
non-private accuracy as a dashed line of the same colour).

    python bench/privacy_report.py [--results bench/results] [--out-dir docs/images] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import RESULTS, write_result  # noqa: E402
from paired import paired_difference  # noqa: E402
from privacy_draws import run_accounts  # noqa: E402
from run_matrix import final_mean, load_matrix  # noqa: E402

BENCH = Path(__file__).resolve().parent
MATRIX = BENCH / "matrices" / "privacy.toml"
OUT_DIR = BENCH.parent / "docs" / "images"
REFERENCE = "none"


def _last(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return values[-1] if values else None


def _mean_of(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def read_cells(results: Path, rounds: int) -> dict[tuple[str, str, str], dict[int, dict[str, Any]]]:
    """(fleet, partition, epsilon label) -> seed -> the run's final accuracy and privacy figures."""
    cells: dict[tuple[str, str, str], dict[int, dict[str, Any]]] = {}
    for path in sorted((results / "privacy").glob(f"*-r{rounds}.json")):
        rec = json.loads(path.read_text())
        accuracy = None if rec.get("failure") else final_mean(rec["rows"], "test_accuracy")
        if rec.get("rounds") != rounds or (accuracy is None and not rec.get("failure")):
            continue
        fleet, alpha, eps = rec["labels"]
        trained = [r["round"] for r in rec["rows"] if r["round"] > 0]
        cells.setdefault((fleet, alpha, eps), {})[rec["seed"]] = {
            "accuracy": accuracy, "failure": rec.get("failure"), "last_round": max(trained, default=0),
            "epsilon": _last(rec["rows"], "dp_epsilon"),
            "noise_std": _last(rec["rows"], "dp_noise_std"), "clipped": _mean_of(rec["rows"], "dp_clipped_fraction"),
            "seconds": rec.get("seconds"), "accounts": None if rec.get("failure") else run_accounts(rec)}
    return cells


def table(cells: dict[tuple[str, str, str], dict[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per cell, in the matrix's order, with its cost against the non-private run of each seed."""
    matrix = load_matrix(MATRIX)
    order = {axis: [str(e["label"]) for e in entries] for axis, entries in matrix.axes.items()}
    rows = []
    for key in sorted(cells, key=lambda k: (order["fleet"].index(k[0]), order["alpha"].index(k[1]),
                                            order["eps"].index(k[2]))):
        every = cells[key]
        failed = {s: {"after_round": every[s]["last_round"], "why": every[s]["failure"]}
                  for s in sorted(every) if every[s]["failure"]}
        seeds = {s: v for s, v in every.items() if v["accuracy"] is not None}
        reference = {s: v for s, v in cells.get((key[0], key[1], REFERENCE), {}).items() if v["accuracy"] is not None}
        accuracy = [seeds[s]["accuracy"] for s in sorted(seeds)]
        row: dict[str, Any] = {"fleet": key[0], "partition": key[1], "eps": key[2], "seeds": sorted(seeds),
                               "failed": failed,
                               "accuracy": {"mean": statistics.fmean(accuracy), "std": statistics.pstdev(accuracy),
                                            "per_seed": accuracy} if accuracy else None}
        cost = paired_difference({s: v["accuracy"] for s, v in seeds.items()},
                                 {s: v["accuracy"] for s, v in reference.items()})
        if key[2] != REFERENCE and cost is not None:
            row["cost"] = {"mean": cost.mean, "per_seed": list(cost.differences),
                           "interval": None if cost.interval is None else list(cost.interval),
                           "seeds": list(cost.seeds)}
        for field in ("epsilon", "noise_std"):
            values = [every[s][field] for s in every if every[s][field] is not None]
            row[field] = max(values) if values else None
        clipped = [seeds[s]["clipped"] for s in seeds if seeds[s]["clipped"] is not None]
        row["clipped"] = statistics.fmean(clipped) if clipped else None
        row["accounts"] = _worst_accounts([v["accounts"] for v in every.values() if v["accounts"]])
        rows.append(row)
    return rows


def _worst_accounts(per_seed: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The largest figure of each account over a cell's seeds, and the range of its most-drawn device's rounds."""
    if not per_seed:
        return None
    out: dict[str, Any] = {"max_participations": [min(a["max_participations"] for a in per_seed),
                                                  max(a["max_participations"] for a in per_seed)]}
    for draw in ("seeded", "fixed", "poisson"):
        out[draw] = {acc: max(a[draw][acc] for a in per_seed) for acc in ("pld", "rdp")}
        out[draw + "_range"] = {acc: [min(a[draw][acc] for a in per_seed), max(a[draw][acc] for a in per_seed)]
                                for acc in ("pld", "rdp")}
    return out


def epsilon_markdown(rows: list[dict[str, Any]]) -> str:
    """The table of what each private cell's epsilon is by the draw that ran, for docs/privacy.md."""
    lines = ["| fleet | partition | quoted (Poisson, RDP) | most-drawn device's rounds | as drawn: seeded, public "
             "(PLD) | had the draw been secret: fixed size, replace-one (PLD) | Poisson sampling (PLD) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        a = r.get("accounts")
        if r["eps"] == REFERENCE or not a:
            continue
        lo, hi = a["seeded_range"]["pld"]
        k_lo, k_hi = a["max_participations"]
        lines.append(f"| {FLEETS.get(r['fleet'], r['fleet'])} | Dirichlet {r['partition'].lstrip('a')} | "
                     f"{r['epsilon']:.2f} | {k_lo} to {k_hi} of 100 | {lo:.2f} to {hi:.2f} | "
                     f"{a['fixed']['pld']:.2f} | {a['poisson']['pld']:.2f} |")
    return "\n".join(lines)


def _pct(value: float | None, signed: bool = False) -> str:
    return "-" if value is None else f"{100 * value:{'+' if signed else ''}.2f}"


def show(rows: list[dict[str, Any]]) -> None:
    t = Table(title="Central DP: accuracy against epsilon (delta 1e-5)")
    for name in ("fleet", "partition", "eps", "seeds", "accuracy %", "cost (points, 95 % CI)", "epsilon",
                 "noise std", "clipped"):
        t.add_column(name)
    for r in rows:
        cost = r.get("cost")
        ci = "" if not cost or cost["interval"] is None else \
            f" [{_pct(cost['interval'][0], True)}, {_pct(cost['interval'][1], True)}]"
        accuracy = "-" if r["accuracy"] is None else f"{_pct(r['accuracy']['mean'])} ± {_pct(r['accuracy']['std'])}"
        if r["failed"]:
            accuracy += f" ({len(r['failed'])} stopped: " + "; ".join(
                f"s{s} after round {f['after_round']}" for s, f in r["failed"].items()) + ")"
        t.add_row(r["fleet"], r["partition"], r["eps"], ",".join(map(str, r["seeds"])), accuracy,
                  "-" if not cost else _pct(cost["mean"], True) + ci,
                  "-" if r["epsilon"] is None else f"{r['epsilon']:.3f}",
                  "-" if r["noise_std"] is None else f"{r['noise_std']:.4f}",
                  "-" if r["clipped"] is None else f"{r['clipped']:.2f}")
    Console(width=160).print(t)


FLEETS = {"f100": "100 devices, 10 a round", "f1000": "1,000 devices, 100 a round"}


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table docs/privacy.md shows, one line per fleet and partition and a column per epsilon: accuracy
    (mean ± std over seeds) and the paired cost with its interval, so the page is pasted, not retyped."""
    groups: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["fleet"], r["partition"]), {})[r["eps"]] = r
    epsilons = [e for e in dict.fromkeys(r["eps"] for r in rows) if e != REFERENCE]

    def cell(r: dict[str, Any] | None) -> str:
        if r is None or r["accuracy"] is None:
            return "-"
        acc = f"{_pct(r['accuracy']['mean'])} ± {_pct(r['accuracy']['std'])}"
        cost = r.get("cost")
        if not cost:
            return acc
        ci = "" if cost["interval"] is None else \
            f" [{_pct(cost['interval'][0], True)}, {_pct(cost['interval'][1], True)}]"
        return f"{acc}: {_pct(cost['mean'], True)}{ci}".replace("-", "−")

    head = ["fleet", "partition", "without DP", *(f"ε = {e.lstrip('e')}" for e in epsilons)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (fleet, alpha), cells in groups.items():
        seeds = len(cells[REFERENCE]["seeds"]) if REFERENCE in cells else 0
        lines.append(f"| {FLEETS.get(fleet, fleet)} | Dirichlet {alpha.lstrip('a')} | {cell(cells.get(REFERENCE))} "
                     f"({seeds} seeds) | " + " | ".join(cell(cells.get(e)) for e in epsilons) + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out: Path) -> Path:
    """Accuracy against the epsilon the runs really have (their seeded draw, its most-drawn device, PLD; largest over
    seeds) per fleet and partition; the non-private level dashed."""

    def epsilon(r: dict[str, Any]) -> float | None:
        return r["accounts"]["seeded"]["pld"] if r.get("accounts") else None

    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["fleet"], r["partition"]), []).append(r)
    for i, ((fleet, alpha), members) in enumerate(groups.items()):
        colour = f"C{i}"
        private = sorted((r for r in members if r["eps"] != REFERENCE and epsilon(r) and r["accuracy"]),
                         key=lambda r: epsilon(r))
        label = f"{fleet} {alpha}"
        if private:
            ax.errorbar([epsilon(r) for r in private], [100 * r["accuracy"]["mean"] for r in private],
                        yerr=[100 * r["accuracy"]["std"] for r in private], marker="o", capsize=3, color=colour,
                        label=f"{label} ({', '.join(str(len(r['seeds'])) for r in private)} seeds)")
        for r in members:
            if r["eps"] == REFERENCE and r["accuracy"]:
                ax.axhline(100 * r["accuracy"]["mean"], color=colour, linestyle="--", linewidth=1,
                           label=f"{label} without DP ({len(r['seeds'])} seeds)")
    ax.set_xscale("log")
    epsilons: list[int] = []
    for e in sorted({round(epsilon(r)) for r in rows if r["eps"] != REFERENCE and epsilon(r)}):
        if not epsilons or e > 1.2 * epsilons[-1]:   # one tick for close figures, so labels do not overlap
            epsilons.append(e)
    ax.set_xticks(epsilons, [f"{e:g}" for e in epsilons])   # the matrix's epsilons, not powers of ten
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("epsilon after 100 rounds as drawn (most-drawn device, PLD, delta 1e-5)")
    ax.set_ylabel("test accuracy, mean of last 5 evaluations (%)")
    ax.set_title("Central DP, FedAvg, cnn on Fashion-MNIST")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "privacy-epsilon.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="results directory (default bench/results)")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR, help="where the PNG goes (default docs/images)")
    parser.add_argument("--rounds", type=int, default=100, help="read runs of this length (default 100)")
    parser.add_argument("--markdown", action="store_true",
                        help="also print the table of docs/privacy.md (accuracy and paired cost per epsilon)")
    args = parser.parse_args()
    cells = read_cells(args.results, args.rounds)
    if not cells:
        print(f"no full-length runs of the privacy matrix under {args.results / 'privacy'}; run "
              "python bench/run_matrix.py bench/matrices/privacy.toml --skip-existing", file=sys.stderr)
        return 1
    rows = table(cells)
    show(rows)
    if args.markdown:
        print(markdown(rows))
        print()
        print(epsilon_markdown(rows))
    figure = plot(rows, args.out_dir)
    write_result(args.results / "privacy_epsilon.json",
                 {"matrix": "privacy", "rounds": args.rounds, "reference": REFERENCE, "rows": rows,
                  "figure": str(figure.relative_to(BENCH.parent)) if figure.is_relative_to(BENCH.parent)
                  else str(figure)})
    print(f"figure: {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
