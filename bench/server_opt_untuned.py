"""Server optimizers against FedAvg on the seeds their rates were not tuned on.

The server learning rates of ``bench/matrices/server_opt.toml`` were chosen on seed 0, which is also one of that
matrix's evaluation seeds, so its verdict's intervals include the seed the choice was fitted to. This report
leaves seed 0 out: it pairs each chosen rate with FedAvg of the same cell and seed over every other seed that has
both runs, seeds 1 and 2 from ``server_opt`` and 3, 4 and 5 from ``server_opt_heldout.toml``, on the protocol's
figure (the mean of the last 5 evaluations), and gives the mean paired difference with its 95 % t-interval, for
the held-out seeds 3 to 5 alone too.

    python bench/server_opt_untuned.py      # prints the table, writes bench/results/server_opt_untuned_seeds.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import RESULTS, write_result  # noqa: E402
from paired import paired_difference  # noqa: E402
from run_matrix import final_mean  # noqa: E402

CHOSEN = ("fedadam-lr0.01", "fedyogi-lr0.01", "fedadagrad-lr0.01", "fedavgm-lr0.3")
ALPHAS = ("a0.1", "a0.5")
TUNED_ON = 0
HELD_OUT = (3, 4, 5)


def figures(results: Path, label: str, alpha: str) -> dict[int, float]:
    """Seed -> the protocol's figure of every 100-round run of ``alpha``/``label`` in either matrix."""
    out: dict[int, float] = {}
    for matrix in ("server_opt", "server_opt_heldout"):
        for path in sorted((results / matrix).glob(f"{alpha}-{label}-s*-r100.json")):
            record = json.loads(path.read_text())
            value = None if record.get("failure") else final_mean(record["rows"], "test_accuracy")
            if value is not None:
                out[int(record["seed"])] = value
    return out


def _pair(rows: dict[int, float], base: dict[int, float], seeds: set[int]) -> dict[str, Any] | None:
    result = paired_difference({s: v for s, v in rows.items() if s in seeds},
                               {s: v for s, v in base.items() if s in seeds})
    if result is None:
        return None
    return {"seeds": list(result.seeds), "mean": result.mean, "per_seed": list(result.differences),
            "interval": None if result.interval is None else list(result.interval)}


def report(results: Path) -> list[dict[str, Any]]:
    rows = []
    for alpha in ALPHAS:
        base = figures(results, "fedavg", alpha)
        for label in CHOSEN:
            mine = figures(results, label, alpha)
            untuned = {s for s in mine if s != TUNED_ON}
            rows.append({"alpha": alpha, "row": label, "vs": "fedavg",
                         "untuned": _pair(mine, base, untuned), "held_out": _pair(mine, base, set(HELD_OUT)),
                         "all": _pair(mine, base, set(mine))})
    return rows


def _text(pair: dict[str, Any] | None) -> str:
    if pair is None:
        return "-"
    ci = "" if pair["interval"] is None else f" [{100 * pair['interval'][0]:+.2f}, {100 * pair['interval'][1]:+.2f}]"
    return f"{100 * pair['mean']:+.2f}{ci} (seeds {','.join(map(str, pair['seeds']))})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="results directory (default bench/results)")
    args = parser.parse_args()
    rows = report(args.results)
    print("paired difference to FedAvg, points (mean of the last 5 evaluations), 95 % t-interval")
    print(f"{'cell':5} {'row':18} {'seeds other than 0':40} {'held-out seeds 3-5':40} {'every seed':40}")
    for r in rows:
        print(f"{r['alpha']:5} {r['row']:18} {_text(r['untuned']):40} {_text(r['held_out']):40} {_text(r['all']):40}")
    write_result(args.results / "server_opt_untuned_seeds.json",
                 {"tuned_on": TUNED_ON, "held_out": list(HELD_OUT), "figure": "last5", "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
