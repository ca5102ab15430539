"""Downlink bytes per device per round, and final accuracy, with and without delta broadcasts.

Setting: FedAvg, `cnn`, 10 simulated clients in process (the device's own client code on the in-process
transport), every client every round, Dirichlet(0.5) label skew, 1 local epoch, batch 32, 20 rounds, seed 0.
Variants: the full fp32 broadcast every round (today's default); `codec.down = "int8"` (the model itself
quantized, for comparison); and delta broadcasts (`codec.down_delta`) in int8 and top-k (25 %, 10 %) + int8, each
with zstd.

Per device per round: the broadcast each device fetched (the full one, or the delta when it held the model
before; the round row's `bytes_fetched`, or the full broadcast per selected device without deltas) plus its
own task message. Prints a table and writes bench/results/downlink_ratio.json.

    python bench/downlink_ratio.py [--rounds 20] [--clients 10] [--data digits]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench_io import RESULTS, write_result
from provenance import machine, source_state
from coordinator.config import load_config
from coordinator.runtime.run import run_federated
from storage.files import read_jsonl

VARIANTS: dict[str, dict[str, str]] = {
    "fp32 broadcast": {},
    "int8 broadcast (model quantized)": {"down": "int8"},
    "delta int8+zstd": {"down_delta": "int8+zstd"},
    "delta topk:0.25+int8+zstd": {"down_delta": "topk:0.25+int8+zstd"},
    "delta topk:0.1+int8+zstd": {"down_delta": "topk:0.1+int8+zstd"},
}


def per_device_down(row: dict[str, Any]) -> float:
    """Bytes one device received in the round: its broadcast fetch (the mean over devices) plus its task."""
    selected = max(row["selected"], 1)
    tasks = row["bytes_down"] - row["bytes_broadcast"]
    if "bytes_fetched" in row:   # delta broadcasts: what each device fetched, as it reported
        answered = max(sum(v for k, v in row.items() if k.startswith("model_from_")), 1)
        return row["bytes_fetched"] / answered + tasks / selected
    return row["bytes_broadcast"] + tasks / selected   # every selected device fetches the full broadcast


def run(name: str, codec: dict[str, str], args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    out = directory / "".join(c if c.isalnum() else "-" for c in name)
    overrides = [("run", "strategy", "fedavg"), ("run", "rounds", args.rounds), ("run", "seed", 0),
                 ("run", "out", str(out)), ("model", "name", "cnn"), ("data", "eval", args.data),
                 ("data", "partition", "dirichlet:0.5"), ("clients", "expected", args.clients),
                 ("clients", "spawn", args.clients), ("clients", "round_timeout", 900.0),
                 ("clients", "presence_timeout", 300.0), ("transport", "kind", "inproc"),
                 ("train", "epochs", 1), ("train", "batch_size", 32), ("export", "enabled", False),
                 *(("codec", key, value) for key, value in codec.items())]
    config = load_config(None, overrides)
    started = time.monotonic()
    run_federated(config, say=lambda s: None)
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if r["round"] >= 1]
    down = [per_device_down(r) for r in rows]
    taken = {k[len("model_from_"):]: sum(r.get(k, 0) for r in rows) for k in
             ("model_from_full", "model_from_delta", "model_from_no_base", "model_from_bad_delta",
              "model_from_held")}
    return {"codec": codec, "final_accuracy": rows[-1]["test_accuracy"],
            "best_accuracy": max(r["test_accuracy"] for r in rows if "test_accuracy" in r),
            "down_bytes_per_device_round": statistics.mean(down),
            "down_bytes_per_device_round_after_round_1": statistics.mean(down[1:]) if len(down) > 1 else None,
            "full_broadcast_bytes": rows[0]["bytes_broadcast"],
            "model_from": {k: v for k, v in taken.items() if v} if "bytes_fetched" in rows[0] else None,
            "accuracy_per_round": [r.get("test_accuracy") for r in rows],
            "down_bytes_per_round": [round(d) for d in down], "seconds": time.monotonic() - started}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="federated rounds (default 20)")
    parser.add_argument("--clients", type=int, default=10, help="simulated clients (default 10)")
    parser.add_argument("--data", default="digits", help="data spec (default digits; fashion-mnist is ~30x the work)")
    parser.add_argument("--out", type=Path, default=RESULTS / "downlink_ratio.json", help="JSON result file")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="fedge-downlink-"))
    results = {name: run(name, codec, args, directory) for name, codec in VARIANTS.items()}
    base = results["fp32 broadcast"]["down_bytes_per_device_round"]
    table = Table(title=f"FedAvg cnn on {args.data}, {args.clients} clients, {args.rounds} rounds: downlink per device")
    for column in ("variant", "bytes down / device / round", "vs fp32", "final accuracy", "how devices took it"):
        table.add_column(column)
    for name, r in results.items():
        r["ratio_vs_fp32"] = base / r["down_bytes_per_device_round"]
        table.add_row(name, f"{r['down_bytes_per_device_round']:,.0f}", f"{r['ratio_vs_fp32']:.2f}x smaller",
                      f"{r['final_accuracy']:.4f}", str(r["model_from"] or "full, every round"))
    Console().print(table)
    write_result(args.out, {"setting": {"strategy": "fedavg", "model": "cnn", "data": args.data,
                                        "partition": "dirichlet:0.5", "clients": args.clients,
                                        "rounds": args.rounds, "epochs": 1, "batch_size": 32, "seed": 0,
                                        "transport": "inproc"},
                            "command": f"python bench/downlink_ratio.py --rounds {args.rounds} --clients "
                                       f"{args.clients} --data {args.data}",
                            "variants": results, "source": source_state(), "machine": machine()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
