"""Inference latency of exported models: torch eager against ONNX Runtime float32 and int8.

For `cnn` and `vgg9` on Fashion-MNIST (28x28): the median latency at batch 1 and
batch 32 of torch eager, ONNX Runtime float32 and ONNX Runtime int8, each on one
thread and on all cores; the file sizes; and the test accuracy of each on the
whole test split.

The models come from short federated runs that this script starts (FedAvg,
in-process clients, iid partitions, 1 local epoch, batch 64, SGD lr 0.05 momentum
0.9; see TRAINING below), and the runs' automatic export writes the float32 ONNX
files, parity-checked against torch; ``--run NAME=RUN_DIR`` takes an existing run's
last checkpoint instead (exported again here). The int8 files come from
``export.pipeline.export_int8`` (static QDQ, 512 calibration samples from the
training split).

Timing: a warm-up, then the median of ``--runs`` single timed calls at batch 1
(a quarter as many at batch 32), torch under ``inference_mode`` with
``torch.set_num_threads(T)``, ONNX Runtime with ``intra_op_num_threads = T`` and
its default spin-waiting, for T = 1 and T = all cores. Run it on a quiet machine.

Goals checked and reported (never enforced by changing the numbers): ONNX Runtime
float32 at most half of torch eager's batch-1 latency; int8 at most 30% of the
float32 file size and at most 1 point less accurate.

    python bench/export_latency.py [--runs 300] [--models cnn,vgg9] [--run cnn=DIR] [--run vgg9=DIR] [--out FILE]
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
from rich.console import Console
from rich.table import Table

from coordinator.config import load_config
from coordinator.runtime.run import run_federated
from export.onnx_graph import session
from export.pipeline import ExportOptions, Exported, export_global, export_int8
from export.quantize import QuantSettings
from export.source import global_model, open_run

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("cnn", "vgg9")
BATCHES = (1, 32)
# Brief training: enough for a meaningful int8 accuracy comparison, not a tuned model.
# vgg9 without normalization sits on its initial plateau for a few hundred SGD steps:
# split four ways, 3 rounds of 235 steps each (fresh momentum every round) did not
# leave it (test accuracy 0.10), so it trains as one client for 2 rounds of a whole epoch.
TRAINING = {
    "cnn": {"clients": 4, "per_round": 4, "rounds": 2},
    "vgg9": {"clients": 1, "per_round": 1, "rounds": 2},
}


def train_run(name: str, out: Path, say: Callable[[str], None]) -> Path:
    """A short FedAvg run on Fashion-MNIST; returns its directory (export/model.onnx included)."""
    t = TRAINING[name]
    sets = {"run__strategy": "fedavg", "run__rounds": t["rounds"], "run__seed": 0, "run__out": str(out),
            "model__name": name, "data__eval": "fashion-mnist", "data__partition": "iid",
            "clients__expected": t["clients"], "clients__per_round": t["per_round"], "clients__spawn": t["clients"],
            "clients__round_timeout": 7200.0, "transport__kind": "inproc", "train__epochs": 1,
            "train__batch_size": 64, "train__lr": 0.05, "train__momentum": 0.9}
    config = load_config(None, [(*k.split("__", 1), v) for k, v in sets.items()])
    result = run_federated(config, say=say)
    return result.out_dir


def median_seconds(call: Callable[[], Any], runs: int, warmup: int) -> float:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def latencies(model: torch.nn.Module, fp32: Path, int8: Path, x: np.ndarray, runs: int) -> list[dict[str, Any]]:
    """Median latency of every engine x thread setting x batch size."""
    cores = os.cpu_count() or 1
    rows = []
    for threads in dict.fromkeys((1, cores)):
        engines: dict[str, Callable[[np.ndarray], Any]] = {}
        torch.set_num_threads(threads)

        def eager(batch: np.ndarray) -> Any:
            with torch.inference_mode():
                return model(torch.from_numpy(batch))

        engines["torch eager"] = eager
        for label, path in (("ORT float32", fp32), ("ORT int8", int8)):
            # ONNX Runtime's default spin-waiting, as torch's OpenMP threads do (no other work here)
            sess = session(path, threads, spinning=True)
            engines[label] = lambda batch, s=sess: s.run(None, {"input": batch})
        for label, run in engines.items():
            for size in BATCHES:
                batch = np.ascontiguousarray(x[:size])
                n = runs if size == 1 else max(runs // 4, 20)
                seconds = median_seconds(lambda: run(batch), n, warmup=max(n // 10, 5))
                rows.append({"engine": label, "threads": threads, "batch": size, "runs": n,
                             "median_ms": seconds * 1e3})
    return rows


def measure(name: str, run_dir: Path, out: Path, trained_here: bool, runs: int,
            say: Callable[[str], None]) -> dict[str, Any]:
    # Parity-checked again; for a run trained here, the same bytes as its automatic export.
    fp32: Exported = export_global(run_dir, options=ExportOptions(out=out))
    int8 = export_int8(fp32, QuantSettings(calibration_samples=512))
    source = open_run(run_dir)
    model = global_model(source.checkpoint)
    x_test, y_test = fp32.data.x_test, fp32.data.y_test
    with torch.inference_mode():
        torch_acc = float(np.mean([(model(torch.from_numpy(x_test[i:i + 1000])).argmax(1).numpy()
                                    == y_test[i:i + 1000]).mean() for i in range(0, len(y_test), 1000)]))
    say(f"{name}: timing ({runs} runs at batch 1)")
    load_before = os.getloadavg()[0]
    rows = latencies(model, fp32.path, int8.path, x_test, runs)
    load_after = os.getloadavg()[0]   # a busy machine shows here: latency needs a quiet one
    q = int8.card["quantization"]
    return {
        "model": name, "run_dir": str(run_dir), "source": "trained here" if trained_here else "existing run",
        "run_id": source.checkpoint.run_id, "round": source.checkpoint.round,
        "training": TRAINING[name] if trained_here else None,
        "parameters": sum(p.numel() for p in model.parameters()),
        "bytes": {"torch_state": sum(v.numel() * v.element_size() for v in model.state_dict().values()),
                  "onnx_float32": q["float32_bytes"], "onnx_int8": q["int8_bytes"]},
        "accuracy": {"torch": torch_acc, "onnx_float32": q["float32_accuracy"], "onnx_int8": q["int8_accuracy"]},
        "parity": fp32.card["parity"], "test_samples": q["test_samples"], "latency": rows,
        "load_average_1min": {"before_timing": load_before, "after_timing": load_after},
    }


def goals(result: dict[str, Any]) -> dict[str, Any]:
    lat = {(r["engine"], r["threads"], r["batch"]): r["median_ms"] for r in result["latency"]}
    ratios = {str(t): lat[("ORT float32", t, 1)] / lat[("torch eager", t, 1)]
              for (e, t, b) in lat if e == "torch eager" and b == 1}
    size_ratio = result["bytes"]["onnx_int8"] / result["bytes"]["onnx_float32"]
    drop = 100 * (result["accuracy"]["onnx_float32"] - result["accuracy"]["onnx_int8"])
    return {"ort_fp32_over_torch_batch1": ratios,
            "ort_fp32_at_most_half_of_torch": all(r <= 0.5 for r in ratios.values()),
            "int8_size_ratio": size_ratio, "int8_size_at_most_30_percent": size_ratio <= 0.30,
            "int8_accuracy_drop_points": drop, "int8_drop_at_most_1_point": drop <= 1.0}


def print_tables(console: Console, results: list[dict[str, Any]]) -> None:
    table = Table(title="median latency (ms)")
    for column in ("model", "engine", "threads", "batch 1", "batch 32"):
        table.add_column(column, justify="left" if column in ("model", "engine") else "right")
    for res in results:
        lat = {(r["engine"], r["threads"], r["batch"]): r["median_ms"] for r in res["latency"]}
        for engine, threads in dict.fromkeys((e, t) for e, t, _ in lat):
            table.add_row(res["model"], engine, str(threads), f"{lat[(engine, threads, 1)]:.3f}",
                          f"{lat[(engine, threads, 32)]:.3f}")
    console.print(table)
    sizes = Table(title="size, accuracy and goals")
    for column in ("model", "fp32 bytes", "int8 bytes", "int8/fp32", "acc torch", "acc fp32", "acc int8",
                   "fp32/torch b1, 1 thread", "fp32/torch b1, all", "goals met"):
        sizes.add_column(column, justify="right")
    for res in results:
        g, b, a = res["goals"], res["bytes"], res["accuracy"]
        met = all(g[k] for k in ("ort_fp32_at_most_half_of_torch", "int8_size_at_most_30_percent",
                                 "int8_drop_at_most_1_point"))
        ratios = list(g["ort_fp32_over_torch_batch1"].values())
        sizes.add_row(res["model"], f"{b['onnx_float32']:,}", f"{b['onnx_int8']:,}", f"{g['int8_size_ratio']:.1%}",
                      f"{a['torch']:.4f}", f"{a['onnx_float32']:.4f}", f"{a['onnx_int8']:.4f}",
                      f"{ratios[0]:.2f}", f"{ratios[-1]:.2f}", "yes" if met else "NO")
    console.print(sizes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300, help="timed runs at batch 1 (a quarter at batch 32)")
    parser.add_argument("--run", action="append", default=[], metavar="NAME=RUN_DIR",
                        help="use this run's last checkpoint for model NAME instead of training it here")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of cnn,vgg9")
    parser.add_argument("--out", type=Path, default=RESULTS / "export_latency.json", help="JSON result file")
    args = parser.parse_args()
    console = Console(width=150)
    say = lambda s: console.print(f"[dim]{s}[/dim]")  # noqa: E731
    given = dict(item.split("=", 1) for item in args.run)
    names = [n for n in args.models.split(",") if n]
    unknown = (set(given) | set(names)) - set(MODELS)
    if unknown:
        parser.error(f"models are {', '.join(MODELS)}, got {', '.join(sorted(unknown))}")
    workdir = Path(tempfile.mkdtemp(prefix="fedge-export-bench-"))
    results = []
    started = time.monotonic()
    for name in names:
        if name in given:   # export into the work directory, not into someone's run
            run_dir, trained_here, out = Path(given[name]), False, workdir / name / "model.onnx"
        else:
            say(f"{name}: training {TRAINING[name]} on Fashion-MNIST in {workdir / name}")
            run_dir, trained_here = train_run(name, workdir / name, say), True
            out = run_dir / "export" / "model.onnx"
        result = measure(name, run_dir, out, trained_here, args.runs, say)
        result["goals"] = goals(result)
        results.append(result)
    report = {"models": results, "runs_batch1": args.runs, "wall_seconds": time.monotonic() - started,
              "machine": {"python": platform.python_version(), "arch": platform.machine(), "cpus": os.cpu_count(),
                          "torch": torch.__version__, "onnxruntime": ort.__version__}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_tables(console, results)
    console.print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
