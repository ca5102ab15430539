"""A codec matrix's bytes and accuracy against its baseline row, paired seed by seed.

Why a report of its own: a codec is worth what it saves per device at what it costs in accuracy, and
the two are read off different places (the run files' per-round bytes, their evaluations, and
``bench/codec_speed.py``'s encode time and memory on one real update). For each cell and codec row of
``bench/matrices/compression.toml`` (or ``downlink.toml``), over the seeds run so far:

- bytes up and down per device per round: a result's bytes per device that answered, and what one
  selected device fetched (``bench/downlink_ratio.py``'s ``per_device_down``: the full broadcast, or
  the delta where it held the model before, plus its task message), and how many times fewer than the
  baseline row's;
- accuracy at round 100 (the protocol's figure: mean of the last 5 evaluations) and its paired
  difference to the baseline row with a 95 % t-interval (``bench/paired.py``);
- accuracy at equal bytes: each row's last evaluation whose cumulative upload stays within a share
  of the baseline's upload over its whole run, in the same cell and seed (``--budget``, default 1 %:
  the issue of a hundred times fewer bytes asked as "what does each row reach on that budget"; a row
  that never evaluated within it shows its initial accuracy, round 0);
- the first round each seed reached the baseline's final accuracy of the same seed;
- the device's encode time and memory for the row's upload codec, from ``bench/results/codec_speed.json``.

Reads committed run files only. Prints the table (``--markdown`` for docs) and writes
``bench/results/NAME_report.json``.

    python bench/compression_report.py [bench/matrices/compression.toml] [--budget 0.01] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import RESULTS, write_result  # noqa: E402
from downlink_ratio import per_device_down  # noqa: E402
from paired import paired_difference  # noqa: E402
from run_matrix import Matrix, expand, final_mean, load_matrix  # noqa: E402

__all__ = ["bytes_per_device", "accuracy_within", "reached", "report", "main"]

ROOT = Path(__file__).resolve().parents[1]


def bytes_per_device(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """(up, down) bytes per device per round over a run's training rounds."""
    trained = [r for r in rows if r["round"] > 0]
    up = sum(r["bytes_up"] for r in trained) / max(sum(r["returned"] for r in trained), 1)
    return up, statistics.fmean(per_device_down(r) for r in trained)


def accuracy_within(rows: list[dict[str, Any]], budget: float) -> tuple[int, float] | None:
    """(round, accuracy) of the last evaluation whose cumulative upload is at most ``budget`` bytes."""
    spent, found = 0, None
    for r in rows:
        spent += r.get("bytes_up", 0) if r["round"] > 0 else 0
        if spent <= budget and r.get("test_accuracy") is not None:
            found = (r["round"], r["test_accuracy"])
    return found


def reached(rows: list[dict[str, Any]], target: float | None) -> int | None:
    """The first evaluated round at or above ``target``; None if never."""
    if target is None:
        return None
    return next((r["round"] for r in rows if r["round"] > 0 and (r.get("test_accuracy") or 0) >= target), None)


def _runs(matrix: Matrix, results: Path) -> dict[tuple[str, str], dict[int, dict[str, Any]]]:
    """(cell, row) -> seed -> run record, for the runs whose file exists and that did not stop."""
    axis = matrix.baseline[0] if matrix.baseline else list(matrix.axes)[-1]
    position = list(matrix.axes).index(axis)
    out: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for run in expand(matrix, None, None, []):
        path = results / matrix.name / run.file_name
        if not path.exists():
            continue
        record = json.loads(path.read_text())
        if record.get("failure"):
            continue
        cell = "/".join(run.labels[:position] + run.labels[position + 1:]) or "-"
        out.setdefault((cell, run.labels[position]), {})[run.seed] = record
    return out


def _codec_costs(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    return {r["codec"]: r for r in json.loads(path.read_text())["rows"]}


def _total_upload(record: dict[str, Any]) -> int:
    return sum(r["bytes_up"] for r in record["rows"] if r["round"] > 0)


def report(matrix: Matrix, results: Path, speed: Path, budget: float = 0.01) -> list[dict[str, Any]]:
    """One entry per (cell, row), in the matrix's order; ``budget``: the share of the baseline's whole upload
    that accuracy at equal bytes is read at."""
    if matrix.baseline is None:
        raise SystemExit(f"{matrix.path} names no baseline row (baseline = \"AXIS=LABEL\")")
    base_label = matrix.baseline[1]
    runs = _runs(matrix, results)
    costs = _codec_costs(speed)
    budgets = {(cell, seed): budget * _total_upload(rec)   # (cell, seed) -> bytes, from the baseline's run
               for (cell, row), seeds in runs.items() if row == base_label for seed, rec in seeds.items()}
    out = []
    for (cell, row), seeds in runs.items():
        base = runs.get((cell, base_label), {})
        finals = {s: final_mean(rec["rows"], "test_accuracy") for s, rec in seeds.items()}
        base_finals = {s: final_mean(rec["rows"], "test_accuracy") for s, rec in base.items()}
        per_seed_bytes = {s: bytes_per_device(rec["rows"]) for s, rec in seeds.items()}
        base_bytes = {s: bytes_per_device(rec["rows"]) for s, rec in base.items()}
        common = sorted(set(per_seed_bytes) & set(base_bytes))
        diff = paired_difference({s: v for s, v in finals.items() if v is not None},
                                 {s: v for s, v in base_finals.items() if v is not None}) if row != base_label else None
        config = next(iter(seeds.values()))["config"]
        codec_up = config.get("codec", {}).get("up")
        cost = costs.get(codec_up, {})
        equal = {s: accuracy_within(rec["rows"], budgets[(cell, s)]) if (cell, s) in budgets else None
                 for s, rec in seeds.items()}
        out.append({
            "cell": cell, "row": row, "seeds": sorted(seeds), "codec_up": codec_up,
            "codec_down": config.get("codec", {}).get("down"), "down_delta": config.get("codec", {}).get("down_delta"),
            "up_bytes_per_device": statistics.fmean(b[0] for b in per_seed_bytes.values()),
            "down_bytes_per_device": statistics.fmean(b[1] for b in per_seed_bytes.values()),
            "up_times_fewer": statistics.fmean(base_bytes[s][0] / per_seed_bytes[s][0] for s in common)
            if common else None,
            "down_times_fewer": statistics.fmean(base_bytes[s][1] / per_seed_bytes[s][1] for s in common)
            if common else None,
            "accuracy": {"per_seed": [finals[s] for s in sorted(seeds)],
                         "mean": statistics.fmean(v for v in finals.values() if v is not None)},
            "paired_vs_baseline": None if diff is None else diff.as_dict(),
            "equal_bytes": {"share_of_baseline_upload": budget,
                            "budget_bytes_per_seed": [budgets.get((cell, s)) for s in sorted(seeds)],
                            "round_accuracy_per_seed": [equal[s] for s in sorted(seeds)]},
            "rounds_to_baseline_final": [reached(seeds[s]["rows"], base_finals.get(s)) for s in sorted(seeds)],
            "encode_ms": cost.get("encode_ms"), "encode_memory_kib": cost.get("encode_memory_kib"),
        })
    return out


def _pts(value: float | None, signed: bool = False) -> str:
    return "–" if value is None else f"{100 * value:{'+' if signed else ''}.2f}"


def _difference(d: dict[str, Any] | None) -> str:
    if d is None:
        return "baseline"
    per_seed = ", ".join(_pts(v, True) for v in d["per_seed"])
    if d["interval"] is None:
        return f"{_pts(d['mean'], True)} (n = {d['n']}: {per_seed})"
    low, high = d["interval"]
    return f"{_pts(d['mean'], True)} [{_pts(low, True)}, {_pts(high, True)}] ({per_seed})"


def lines(entries: list[dict[str, Any]]) -> list[str]:
    """The report as a markdown table; the download's columns only where the rows download differently."""
    same_down = all(e["down_times_fewer"] is not None and abs(e["down_times_fewer"] - 1) < 0.01 for e in entries)
    head = ["cell", "row", "seeds", "up B/device/round", "x fewer up", "down B/device/round", "x fewer down",
            "accuracy %", "vs baseline, points [95 %] (per seed)", "on the baseline's upload share (round: %)",
            "reached baseline at round", "encode ms", "encode KiB"]
    if same_down:
        head = [h for h in head if "down" not in h]
    out = ([f"Every row downloads the same, about {entries[0]['down_bytes_per_device']:,.0f} bytes per device per "
            "round.", ""] if same_down else [])
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in entries:
        equal = ", ".join("–" if v is None else f"{v[0]}: {_pts(v[1])}"
                          for v in e["equal_bytes"]["round_accuracy_per_seed"])
        reach = ", ".join("–" if v is None else str(v) for v in e["rounds_to_baseline_final"])
        fewer = [("–" if v is None else f"{v:.1f}") for v in (e["up_times_fewer"], e["down_times_fewer"])]
        down = [] if same_down else [f"{e['down_bytes_per_device']:,.0f}", fewer[1]]
        cells = [e["cell"], e["row"], ",".join(map(str, e["seeds"])), f"{e['up_bytes_per_device']:,.0f}", fewer[0],
                 *down, _pts(e["accuracy"]["mean"]), _difference(e["paired_vs_baseline"]), equal, reach,
                 "–" if e["encode_ms"] is None else format(e["encode_ms"], ".1f"),
                 "–" if e["encode_memory_kib"] is None else format(e["encode_memory_kib"], ",.0f")]
        out.append("| " + " | ".join(cells) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("matrix", nargs="?", type=Path, default=ROOT / "bench/matrices/compression.toml",
                        help="the codec matrix (default bench/matrices/compression.toml)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where its run files are (default "
                        "bench/results)")
    parser.add_argument("--speed", type=Path, default=RESULTS / "codec_speed.json",
                        help="encode time and memory per codec (bench/codec_speed.py's file)")
    parser.add_argument("--budget", type=float, default=0.01,
                        help="accuracy at equal bytes: read within this share of the baseline's whole upload "
                             "(default 0.01)")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown only")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/NAME_report.json")
    args = parser.parse_args(argv)
    matrix = load_matrix(args.matrix)
    if not 0 < args.budget <= 1:
        parser.error(f"--budget is a share of the baseline's upload in (0, 1], got {args.budget}")
    entries = report(matrix, args.results, args.speed, args.budget)
    if not entries:
        raise SystemExit(f"no finished run files of {matrix.name} in {args.results / matrix.name}: run "
                         f"python bench/run_matrix.py {args.matrix}")
    print("\n".join(lines(entries)))
    if not args.markdown:
        out = args.out or args.results / f"{matrix.name}_report.json"
        write_result(out, {"matrix": str(args.matrix), "baseline": "=".join(matrix.baseline or ()),
                           "entries": entries})
    return 0


if __name__ == "__main__":
    sys.exit(main())
