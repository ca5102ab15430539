"""What profiling costs: a local epoch with the profiler against the same epoch with a null one.

Setting: the `cnn` model, one torch thread, one local epoch of SGD (batch 32, lr
0.05, momentum 0.9) on the first --samples images of Fashion-MNIST's train split
(digits with --data digits), through `edge_client.objectives.train`, the loop the
client runs. Each repetition trains the same initial weights twice, once with
`profiling.profiler.Profiler` (created, used for every step, summarized: what a
client does per task) and once with `NullProfiler` (the same calls doing nothing),
alternating which goes first to cancel drift. Reported: the median epoch time of
each (wall clock, and the process's CPU time, which other programs on a shared
machine disturb much less), their ratios, the medians of the per-repetition ratios, and, independent of
machine noise, the profiler's own costs measured in tight loops: per step (begin,
four laps, end) and per task (creating it and summarizing: psutil, sensors), giving
the overhead of one epoch as (per task + steps x per step) / epoch + the USS budget
(USS reads are allowed only while they take at most that share of the task). The
target is an overhead under 2%.

    python bench/profiler_overhead.py [--repeats 11] [--samples 8192] [--data fashion-mnist]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from edge_client.data import load_dataset
from edge_client.registry import build_model
from edge_client.objectives import LocalData, TaskContext, train
from profiling.profiler import USS_BUDGET, NullProfiler, Profiler

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = 0.02
HYPER = {"epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.9}


def epoch_seconds(model: torch.nn.Module, initial: dict[str, torch.Tensor], data: LocalData,
                  profiler_class: type[Profiler]) -> tuple[float, float, dict]:
    """Wall and CPU seconds of one local epoch from ``initial``, profiler creation and summary included."""
    model.load_state_dict(initial)
    start, cpu = time.perf_counter(), time.process_time()
    profiler = profiler_class()
    train(model, data, HYPER, TaskContext(seed=1, round=1, client_id="bench", state_dir=None, profiler=profiler))
    summary = profiler.summary()
    return time.perf_counter() - start, time.process_time() - cpu, summary


def per_step_cost(profiler_class: type[Profiler], steps: int = 20_000) -> float:
    """Seconds the profiler's per-step calls take (begin, four laps, end), in a tight loop."""
    profiler = profiler_class()
    start = time.perf_counter()
    for _ in range(steps):
        profiler.begin_step()
        profiler.lap("data")
        profiler.lap("forward")
        profiler.lap("backward")
        profiler.lap("optimizer")
        profiler.end_step(32)
    return (time.perf_counter() - start) / steps


def per_task_cost(repeats: int = 50) -> float:
    """Seconds to create a profiler and summarize it: the fixed cost of each task."""
    start = time.perf_counter()
    for _ in range(repeats):
        Profiler().summary()
    return (time.perf_counter() - start) / repeats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11, help="epochs with and without the profiler (default 11)")
    parser.add_argument("--samples", type=int, default=8192, help="training images (default 8192)")
    parser.add_argument("--data", default="fashion-mnist", help="data spec (default fashion-mnist)")
    parser.add_argument("--out", type=Path, default=RESULTS / "profiler_overhead.json", help="JSON result file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    console = Console()
    dataset = load_dataset(args.data)
    data = LocalData(torch.from_numpy(dataset.x_train[:args.samples]), torch.from_numpy(dataset.y_train[:args.samples]))
    torch.manual_seed(0)
    model = build_model({"name": "cnn", "num_classes": dataset.num_classes, "in_channels": dataset.in_channels,
                         "image_size": dataset.image_size})
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    epoch_seconds(model, initial, data, Profiler)   # warm-up: torch's lazy initialization is not profiling
    on, off, cpu_on, cpu_off, step_p50 = [], [], [], [], []
    for i in range(args.repeats):
        order = (Profiler, NullProfiler) if i % 2 == 0 else (NullProfiler, Profiler)
        for cls in order:
            seconds, cpu, summary = epoch_seconds(model, initial, data, cls)
            (on if cls is Profiler else off).append(seconds)
            (cpu_on if cls is Profiler else cpu_off).append(cpu)
            if summary:
                step_p50.append(summary["step_p50"])
        console.print(f"[dim]repeat {i + 1}/{args.repeats}: with {on[-1]:.3f} s ({cpu_on[-1]:.3f} s CPU), "
                      f"without {off[-1]:.3f} s ({cpu_off[-1]:.3f} s CPU)[/dim]")
    cost_on, cost_off = per_step_cost(Profiler), per_step_cost(NullProfiler)
    task_cost = per_task_cost()
    median_on, median_off = statistics.median(on), statistics.median(off)
    step = statistics.median(step_p50)
    steps = -(-len(data) // HYPER["batch_size"])
    figures = {
        "setting": {"data": args.data, "samples": len(data), "model": "cnn", "torch_threads": 1, **HYPER,
                    "repeats": args.repeats, "steps_per_epoch": steps},
        "machine": {"python": platform.python_version(), "arch": platform.machine(), "cpus": os.cpu_count(),
                    "load_average_1min": os.getloadavg()[0]},
        "epoch_seconds_with": on,
        "epoch_seconds_without": off,
        "median_epoch_seconds_with": median_on,
        "median_epoch_seconds_without": median_off,
        "ratio_of_medians": median_on / median_off,
        "median_paired_ratio": statistics.median(a / b for a, b in zip(on, off)),
        "cpu_seconds_with": cpu_on,
        "cpu_seconds_without": cpu_off,
        "cpu_ratio_of_medians": statistics.median(cpu_on) / statistics.median(cpu_off),
        "cpu_median_paired_ratio": statistics.median(a / b for a, b in zip(cpu_on, cpu_off)),
        "profiler_seconds_per_step": cost_on - cost_off,
        "median_step_seconds": step,
        "per_step_overhead_fraction": (cost_on - cost_off) / step,
        "profiler_seconds_per_task": task_cost,
        "uss_budget_fraction": USS_BUDGET,
        "estimated_epoch_overhead_fraction": (task_cost + steps * (cost_on - cost_off)) / median_off + USS_BUDGET,
        "target_overhead_fraction": TARGET,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2) + "\n")
    table = Table(title=f"profiler overhead: cnn, {len(data)} {args.data} images, 1 thread, {args.repeats} repeats")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("median epoch, with profiler", f"{median_on:.4f} s")
    table.add_row("median epoch, null profiler", f"{median_off:.4f} s")
    table.add_row("ratio of medians", f"{figures['ratio_of_medians']:.4f}")
    table.add_row("median of paired ratios", f"{figures['median_paired_ratio']:.4f}")
    table.add_row("CPU time: ratio of medians", f"{figures['cpu_ratio_of_medians']:.4f}")
    table.add_row("CPU time: median of paired ratios", f"{figures['cpu_median_paired_ratio']:.4f}")
    table.add_row("profiler calls per step", f"{1e6 * figures['profiler_seconds_per_step']:.2f} µs")
    table.add_row("median step", f"{1e3 * step:.2f} ms")
    table.add_row("per-step overhead", f"{100 * figures['per_step_overhead_fraction']:.3f} %")
    table.add_row("profiler per task (create + summary)", f"{1e3 * task_cost:.2f} ms")
    table.add_row("USS reads, at most", f"{100 * USS_BUDGET:.1f} %")
    table.add_row("estimated epoch overhead", f"{100 * figures['estimated_epoch_overhead_fraction']:.3f} %")
    table.add_row("load average (1 min) at the end", f"{figures['machine']['load_average_1min']:.1f}")
    console.print(table)
    wall, cpu = figures["median_paired_ratio"] - 1, figures["cpu_median_paired_ratio"] - 1
    estimated = figures["estimated_epoch_overhead_fraction"]
    console.print(f"overhead (medians of paired ratios): wall {100 * wall:+.2f} %, CPU time {100 * cpu:+.2f} %; "
                  f"estimated from the profiler's own costs {100 * estimated:.3f} %. Target: under "
                  f"{100 * TARGET:.0f} %: CPU time {'met' if cpu < TARGET else 'NOT met'}, estimate "
                  f"{'met' if estimated < TARGET else 'NOT met'}. Written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
