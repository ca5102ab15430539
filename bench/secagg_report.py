"""What secure aggregation costs against plain FedAvg: the table of a ``bench/fleet.py --secagg`` sweep.

Why a report of its own: the fleet table answers "what do N devices cost the coordinator and the
broker"; the question here is the *multiple* a secure round costs over a plain one of the same N,
in bytes and CPU seconds, with and without dropouts, and where its time goes (the four stages).

Reads the cells of ``bench/results/secagg_cost.json`` (written by
``python bench/fleet.py --fleet 10,50,100,300 --per-round all --secagg off,on --secagg-drop 0,0.1
--out bench/results/secagg_cost.json``) and prints, per N and mode (plain, secure, secure with a
share of devices failing at the mask stage):

- coordinator CPU seconds per round, and its multiple of the plain cell's;
- device CPU seconds per round, all device processes together, and per device;
- bytes per round as the coordinator counts them (``bytes_down + bytes_up`` of its rows) and as the
  devices count every MQTT publish they send or receive, and the coordinator's multiple of plain;
- the secure round's seconds and each stage's seconds (``secagg_STAGE_seconds`` of the rows);
- the devices dropped (summed over rounds).

Writes the rows to ``bench/results/secagg_report.json``.

    python bench/secagg_report.py [--results bench/results/secagg_cost.json]
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

STAGES = ("advertise", "share", "mask", "unmask")


def _mode(cell: dict[str, Any]) -> str:
    if not cell.get("secagg"):
        return "plain"
    return "secure" + (f", {cell['drop']:.0%} fail at mask" if cell.get("drop") else "")


def _stage_seconds(cell: dict[str, Any]) -> dict[str, float | None]:
    detail = cell.get("per_round_detail", [])
    out: dict[str, float | None] = {}
    for stage in STAGES:
        values = [r[f"secagg_{stage}_seconds"] for r in detail if f"secagg_{stage}_seconds" in r]
        out[stage] = statistics.fmean(values) if values else None
    return out


def rows_of(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per complete cell, with its multiples of the plain cell of the same N."""
    done = [c for c in cells if c.get("complete") and not c.get("failure")]
    plain = {c["fleet"]: c for c in done if not c.get("secagg")}
    rows = []
    for c in sorted(done, key=lambda c: (c["fleet"], bool(c.get("secagg")), c.get("drop", 0.0))):
        base = plain.get(c["fleet"])
        coordinator_mb = c["coordinator_mb_per_round"]
        row = {"devices": c["fleet"], "per_round": c["per_round"], "mode": _mode(c),
               "coordinator_cpu_s": c["coordinator_cpu_s_per_round"],
               "device_cpu_s": c["device_cpu_s_per_round"],
               "device_cpu_s_each": c["device_cpu_s_per_round"] / c["per_round"],
               "coordinator_mb": coordinator_mb, "device_mb": c["mb_per_round"],
               "seconds": c["seconds_per_round"], "secagg_seconds": c.get("secagg_seconds_per_round"),
               "stage_seconds": _stage_seconds(c), "dropped": c.get("secagg_dropped", 0), "lost": c["lost"]}
        if base is not None:
            row["bytes_multiple"] = coordinator_mb / base["coordinator_mb_per_round"]
            row["coordinator_cpu_multiple"] = c["coordinator_cpu_s_per_round"] / base["coordinator_cpu_s_per_round"]
            row["device_cpu_multiple"] = c["device_cpu_s_per_round"] / base["device_cpu_s_per_round"]
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)   # noqa: E731
    lines = ["| devices a round | mode | coordinator CPU s/round (x plain) | device CPU s/round, all (each) "
             "| MB/round, coordinator (x plain); devices | round s | stages s: advertise / share / mask / unmask "
             "| dropped |", "|" + "---|" * 7]
    for r in rows:
        st = r["stage_seconds"]
        stages = " / ".join(fmt(st[s], ".2f") for s in STAGES) if r["secagg_seconds"] is not None else "-"
        lines.append(f"| {r['per_round']} | {r['mode']} | {fmt(r['coordinator_cpu_s'], '.2f')} "
                     f"({fmt(r.get('coordinator_cpu_multiple'), '.2f')}) | {fmt(r['device_cpu_s'], '.2f')} "
                     f"({fmt(r['device_cpu_s_each'], '.3f')}) | {fmt(r['coordinator_mb'], ',.1f')} "
                     f"({fmt(r.get('bytes_multiple'), '.3f')}); {fmt(r['device_mb'], ',.1f')} | "
                     f"{fmt(r['seconds'], '.1f')} | {stages} | {r['dropped']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS / "secagg_cost.json",
                        help="the fleet sweep's JSON (default bench/results/secagg_cost.json)")
    parser.add_argument("--out", type=Path, default=RESULTS / "secagg_report.json", help="where the rows go")
    args = parser.parse_args()
    if not args.results.exists():
        parser.error(f"{args.results} does not exist: run bench/fleet.py with --secagg off,on --out {args.results}")
    rows = rows_of(json.loads(args.results.read_text())["cells"])
    if not rows:
        print(f"no complete cells in {args.results}", file=sys.stderr)
        return 1
    print(markdown(rows))
    write_result(args.out, {"source": str(args.results), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
