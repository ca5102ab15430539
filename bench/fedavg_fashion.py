"""FedAvg on Fashion-MNIST with 10 client processes over a local Mosquitto.

Setting: Dirichlet(0.5) label skew (seed 0), all clients every round, `cnn`,
1 local epoch, batch 64, SGD lr 0.05 momentum 0.9 (fresh optimizer each round),
20 rounds. Prints accuracy per round, the median round time, bytes down and up per
client per round and the peak RSS of a client process, and writes them to
bench/results/fedavg_fashion.json.

    python bench/fedavg_fashion.py [--rounds 20] [--clients 10] [--data fashion-mnist]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from coordinator.config import load_config
from coordinator.ops.mosquitto import LocalMosquitto
from coordinator.ui.report import RoundTable
from coordinator.runtime.run import run_federated
from storage.files import read_jsonl

RESULTS = Path(__file__).resolve().parent / "results"


def client_peak_rss(out: Path) -> int | None:
    """Largest RSS any client process reported over the run (from its profile history)."""
    peaks = []
    for history in (out / "clients").glob("*/profile.jsonl"):
        for row in read_jsonl(history):
            value = row.get("peak_rss_bytes")
            if value:
                peaks.append(value)
    return max(peaks) if peaks else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="federated rounds (default 20)")
    parser.add_argument("--clients", type=int, default=10, help="client processes (default 10)")
    parser.add_argument("--data", default="fashion-mnist", help="data spec (default fashion-mnist)")
    parser.add_argument("--out", type=Path, default=RESULTS / "fedavg_fashion.json", help="JSON result file")
    args = parser.parse_args()
    console = Console()
    run_dir = Path(tempfile.mkdtemp(prefix="fedge-bench-")) / "run"
    overrides = [("run", "strategy", "fedavg"), ("run", "rounds", args.rounds), ("run", "seed", 0),
                 ("run", "out", str(run_dir)), ("model", "name", "cnn"), ("data", "eval", args.data),
                 ("data", "partition", "dirichlet:0.5"), ("clients", "expected", args.clients),
                 ("clients", "spawn", args.clients), ("clients", "round_timeout", 900.0),
                 ("train", "epochs", 1), ("train", "batch_size", 64), ("train", "lr", 0.05),
                 ("train", "momentum", 0.9)]
    with LocalMosquitto() as broker:
        config = load_config(None, overrides + [("transport", "broker", broker.url)])
        started = time.monotonic()
        with RoundTable(console, title="FedAvg, Fashion-MNIST, Dirichlet 0.5, 10 processes over Mosquitto") as t:
            result = run_federated(config, say=lambda s: console.print(f"[dim]{s}[/dim]"), on_round=t.add)
        wall = time.monotonic() - started
    rows = read_jsonl(result.out_dir / "metrics.jsonl")
    trained = [r for r in rows if r["round"] > 0]
    evaluated = [r for r in rows if r.get("test_accuracy") is not None]
    figures = {
        "setting": {"data": args.data, "partition": "dirichlet:0.5", "seed": 0, "clients": args.clients,
                    "rounds": args.rounds, "model": "cnn", "epochs": 1, "batch_size": 64, "lr": 0.05,
                    "momentum": 0.9, "transport": "mqtt (mosquitto, separate client processes)"},
        "machine": {"python": platform.python_version(), "arch": platform.machine(),
                    "cpus": os.cpu_count()},
        # the evaluated rounds (every round with the default eval.every = 1)
        "accuracy_per_round": [r["test_accuracy"] for r in evaluated],
        "final_accuracy": evaluated[-1]["test_accuracy"],
        "best_accuracy": max(r["test_accuracy"] for r in evaluated),
        "median_round_seconds": statistics.median(r["seconds"] for r in trained),
        "bytes_down_per_client_per_round": statistics.median(r["bytes_down_per_client"] for r in trained),
        "bytes_up_per_client_per_round": statistics.median(r["bytes_up_per_client"] for r in trained),
        "client_peak_rss_bytes": client_peak_rss(result.out_dir),
        "wall_seconds": wall,
        "run_dir": str(result.out_dir),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2) + "\n")
    table = Table(title="fedavg_fashion")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key in ("final_accuracy", "best_accuracy", "median_round_seconds", "bytes_down_per_client_per_round",
                "bytes_up_per_client_per_round", "client_peak_rss_bytes", "wall_seconds"):
        value = figures[key]
        table.add_row(key, f"{value:,.4f}" if isinstance(value, float) else f"{value:,}")
    console.print(table)
    console.print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
