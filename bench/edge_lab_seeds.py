"""The edge lab's policies over several seeds: each against synchronous random selection, paired seed by seed.

One lab run (``bench/edge_lab.py --seed S --out DIR/seedS.json``) is one measurement per policy: the
fleet's link and throttle schedule, the partition and the draws all follow its seed, so two policies of
one seed share the fleet's luck and their difference is what to average (bench/paired.py says why). Only the
evaluations within the run's ``--wall-clock-budget`` of training count (a coordinator may train a little
longer while it stops). Per policy and seed this reads, against that seed's ``sync-random``:

- the **time to target** (``sync-random``'s last accuracy within the budget; bench/edge_lab.py) as a
  ratio to ``sync-random``'s own (a policy that never reached it has no ratio: the count says how many);
- the **final accuracy** (last evaluation, and the mean of the last 3) as a difference in points;
- **participation**: results counted per device class, the distinct devices of each class counted at
  least once, and who was drawn each round (from the run directory's ``clients/ID.jsonl``, when the run
  directories are still on this machine; the output keeps what was read).

Prints the table, writes ``bench/results/edge_lab_seeds.json`` and draws ``docs/images/edge_lab_seeds.png``
(one panel per policy, one line per seed).

    python bench/edge_lab_seeds.py [bench/results/edge_lab_seeds] [--root DIR] [--markdown] [--out FILE] [--plot PNG]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import RESULTS, write_result  # noqa: E402
from lab.results import read_jsonl, time_to_target  # noqa: E402
from paired import paired  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "sync-random"

__all__ = ["load_seeds", "participation", "within_budget", "figures", "summarize", "main"]


def load_seeds(directory: Path) -> dict[int, dict[str, Any]]:
    """Every ``seedS.json`` the lab wrote in ``directory``, by the seed its options name."""
    runs = {}
    for path in sorted(directory.glob("seed*.json")):
        data = json.loads(path.read_text())
        runs[int(data["options"]["seed"])] = data
    return runs


def _counted(record: dict[str, Any]) -> bool:
    return (record.get("objective") == "train" and not record.get("late") and not record.get("missed")
            and record.get("error") is None)


def participation(run_dir: Path, device_class: dict[str, str], last: int) -> dict[str, Any] | None:
    """Results counted per class and per device, distinct devices counted per class, and the devices drawn each round
    (a device is drawn in a round when the coordinator kept a training record of it for that round), up to
    round (or version) ``last``, the last one with a row: the answers of a round the budget's stop cut short
    went into no model. None when the run directory is gone."""
    clients = run_dir / "clients"
    if not clients.is_dir():
        return None
    counted = dict.fromkeys(dict.fromkeys(device_class.values()), 0)
    per_device = dict.fromkeys(device_class, 0)
    devices: dict[str, set[str]] = {klass: set() for klass in counted}
    draws: dict[int, list[str]] = {}
    for device, klass in device_class.items():
        for record in read_jsonl(clients / f"{device}.jsonl"):
            if (record.get("objective") != "train" or not isinstance(record.get("round"), int)
                    or record["round"] > last):
                continue
            draws.setdefault(record["round"], []).append(device)
            if _counted(record):
                counted[klass] += 1
                per_device[device] += 1
                devices[klass].add(device)
    return {"counted_per_class": counted, "devices_counted_per_class": {k: len(v) for k, v in devices.items()},
            "counted_per_device": per_device,
            "draws": {str(r): sorted(set(ids)) for r, ids in sorted(draws.items())}}


def _interval(values: list[float], seeds: list[int]) -> dict[str, Any] | None:
    return paired(values, seeds).as_dict() if values else None


def within_budget(result: dict[str, Any], budget: float | None) -> list[dict[str, Any]]:
    """The policy's evaluations made within ``budget`` seconds of training: a coordinator that took a while to
    stop after the budget's signal trained on, and those rounds must not count for it."""
    return [p for p in result.get("accuracy_vs_time", [])
            if p.get("t_train") is not None and (budget is None or p["t_train"] <= budget)]


def figures(curve: list[dict[str, Any]], target: float | None) -> dict[str, Any]:
    """Last accuracy, the mean of the last 3, and the times to ``target`` (first evaluation at or above it, and
    first 3-evaluation mean at or above it), from one curve."""
    last3 = [p["test_accuracy"] for p in curve[-3:]]
    return {"rounds": curve[-1]["round"] if curve else 0,
            "final_accuracy": curve[-1]["test_accuracy"] if curve else None,
            "final_accuracy_mean3": round(sum(last3) / 3, 4) if len(last3) == 3 else None,
            "time_to_target_s": time_to_target(curve, target)}


def summarize(runs: dict[int, dict[str, Any]], previous: dict[str, Any] | None = None,
              root: Path = ROOT) -> dict[str, Any]:
    """Per policy: the per-seed figures within the budget, and their paired comparison to ``sync-random``
    (whose last accuracy within the budget is each seed's target). ``previous``: an earlier summary whose
    participation is kept where a run directory is gone; ``root``: where the lab ran (a relative run
    directory is under it)."""
    policies = list(dict.fromkeys(name for run in runs.values() for name in run["policies"]))
    out: dict[str, Any] = {"seeds": sorted(runs), "baseline": BASELINE, "policies": {},
                           "budget_s": sorted({run["options"].get("budget") for run in runs.values()}, key=str)}
    base_figures = {}
    for seed, run in runs.items():
        if BASELINE in run["policies"]:
            base_curve = within_budget(run["policies"][BASELINE], run["options"].get("budget"))
            base_figures[seed] = figures(base_curve, base_curve[-1]["test_accuracy"] if base_curve else None)
    for name in policies:
        per_seed, ratios, ratio_seeds, final, final3, seeds, seeds3 = {}, [], [], [], [], [], []
        for seed, run in sorted(runs.items()):
            result, base = run["policies"].get(name), base_figures.get(seed)
            if result is None or base is None:
                continue
            classes = {d: row["class"] for d, row in result.get("devices", {}).items()}
            kept = ((previous or {}).get("policies", {}).get(name, {}).get("per_seed", {})
                    .get(str(seed), {}).get("participation"))
            mine = figures(within_budget(result, run["options"].get("budget")), base["final_accuracy"])
            t, t_base = mine["time_to_target_s"], base["time_to_target_s"]
            per_seed[str(seed)] = {
                "target": base["final_accuracy"], **mine,
                "time_to_target_ratio": round(t / t_base, 4) if t is not None and t_base else None,
                "results": result.get("results"), "status": result.get("status"),
                "participation": participation(root / result["run_dir"], classes, mine["rounds"]) or kept,
            }
            if t is not None and t_base:
                ratios.append(t / t_base)
                ratio_seeds.append(seed)
            if mine["final_accuracy"] is not None and base["final_accuracy"] is not None:
                final.append(100.0 * (mine["final_accuracy"] - base["final_accuracy"]))
                seeds.append(seed)
            if mine["final_accuracy_mean3"] is not None and base["final_accuracy_mean3"] is not None:
                final3.append(100.0 * (mine["final_accuracy_mean3"] - base["final_accuracy_mean3"]))
                seeds3.append(seed)
        out["policies"][name] = {
            "per_seed": per_seed,
            "time_to_target_ratio": _interval(ratios, ratio_seeds),
            "reached_target": f"{len(ratios)} of {len(per_seed)}",
            "final_accuracy_points": _interval(final, seeds),
            "final_accuracy_mean3_points": _interval(final3, seeds3),
        }
    return out


def _fmt(stat: dict[str, Any] | None, scale: str = "") -> str:
    if not stat:
        return "-"
    per_seed = ", ".join(f"{v:.2f}" for v in stat["per_seed"])
    if stat["interval"] is None:
        return f"{stat['mean']:.2f}{scale} ({per_seed})"
    low, high = stat["interval"]
    return f"{stat['mean']:.2f}{scale} [{low:.2f}, {high:.2f}] ({per_seed})"


def tables(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """The report's tables as (title, columns, rows): the paired comparison, and participation per class."""
    seeds = ", ".join(map(str, summary["seeds"]))
    paired_rows = []
    for name, entry in summary["policies"].items():
        per_seed = entry["per_seed"].values()
        paired_rows.append([name, ", ".join(str(f["rounds"]) for f in per_seed),
                            ", ".join(f"{100 * f['final_accuracy']:.2f}" if f["final_accuracy"] is not None else "-"
                                      for f in per_seed),
                            entry["reached_target"], _fmt(entry["time_to_target_ratio"], "x"),
                            _fmt(entry["final_accuracy_points"])])
    out = [(f"seeds {seeds}, paired against {BASELINE} (95 % t-interval; per seed in brackets)",
            ["policy", "rounds / versions", "last accuracy (%)", "reached target", "time to target / sync-random's",
             "last accuracy, points"], paired_rows)]
    classes: list[str] = []
    part_rows = []
    for name, entry in summary["policies"].items():
        for seed, figures in entry["per_seed"].items():
            part = figures.get("participation")
            if part:
                classes = classes or list(part["counted_per_class"])
                part_rows.append([name, seed, *(f"{part['counted_per_class'][c]} ({part['devices_counted_per_class'][c]})"
                                                for c in classes)])
    if part_rows:
        out.append(("results counted per device class (devices counted at least once)", ["policy", "seed", *classes],
                    part_rows))
    return out


def show(console: Console, summary: dict[str, Any], markdown: bool = False) -> None:
    """The tables on the terminal, or as Markdown for the docs."""
    for title, columns, rows in tables(summary):
        if markdown:
            print(f"\n{title}\n\n| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
            for row in rows:
                print("| " + " | ".join(row) + " |")
            continue
        table = Table(title=title)
        for column in columns:
            table.add_column(column)
        for row in rows:
            table.add_row(*row)
        console.print(table)


def plot(runs: dict[int, dict[str, Any]], summary: dict[str, Any], out: Path) -> None:
    """One panel per policy, test accuracy against training time, one line per seed; each seed's target
    dotted in its line's colour. A last panel: results counted per class, as shares, mean over seeds."""
    names = list(summary["policies"])
    columns = 3
    rows = -(-(len(names) + 1) // columns)
    fig, grid = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.4 * rows), dpi=100, squeeze=False)
    axes = list(grid.flat)
    for spare in axes[len(names) + 1:]:
        fig.delaxes(spare)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, name in zip(axes, names):
        for k, (seed, run) in enumerate(sorted(runs.items())):
            points = within_budget(run["policies"].get(name, {}), run["options"].get("budget"))
            ax.plot([p["t_train"] for p in points], [100 * p["test_accuracy"] for p in points], marker=".",
                    color=colours[k % len(colours)], label=f"seed {seed}")
            target = summary["policies"].get(BASELINE, {}).get("per_seed", {}).get(str(seed), {}).get("target")
            if target is not None:
                ax.axhline(100 * target, color=colours[k % len(colours)], linestyle=":", linewidth=1)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("seconds of training")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy (%) (dotted: target)")
    axes[0].legend(fontsize=8)
    share = axes[len(names)]
    classes: list[str] = []
    for i, name in enumerate(names):
        parts = [f["participation"] for f in summary["policies"][name]["per_seed"].values() if f.get("participation")]
        if not parts:
            continue
        classes = list(parts[0]["counted_per_class"])
        totals = [statistics.fmean(p["counted_per_class"][c] / max(1, sum(p["counted_per_class"].values()))
                                   for p in parts) for c in classes]
        width = 0.8 / len(names)
        share.bar([k + i * width for k in range(len(classes))], [100 * t for t in totals], width, label=name)
    if classes:
        share.set_xticks([k + 0.4 for k in range(len(classes))], classes, rotation=30, fontsize=7)
        share.set_ylabel("share of counted results (%)")
        share.set_title("results counted per class", fontsize=10)
        share.legend(fontsize=7)
    else:
        fig.delaxes(share)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory", nargs="?", type=Path, default=RESULTS / "edge_lab_seeds",
                   help="where the lab's seedS.json files are (default bench/results/edge_lab_seeds)")
    p.add_argument("--out", type=Path, default=RESULTS / "edge_lab_seeds.json", help="summary JSON to write")
    p.add_argument("--root", type=Path, default=ROOT,
                   help="the directory the lab ran in: relative run directories are under it (default: this checkout)")
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown (for docs/heterogeneous-fleets.md)")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "images" / "edge_lab_seeds.png", help="PNG to write")
    args = p.parse_args(argv)
    runs = load_seeds(args.directory)
    if not runs:
        print(f"edge_lab_seeds.py: no seedS.json in {args.directory}; run bench/edge_lab.py --seed S "
              f"--out {args.directory}/seedS.json first", file=sys.stderr)
        return 2
    previous = json.loads(args.out.read_text()) if args.out.exists() else None
    summary = summarize(runs, previous, args.root)
    show(Console(), summary, args.markdown)
    write_result(args.out, summary)
    plot(runs, summary, args.plot)
    print(f"written to {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
