"""Simulation speed: fedge's round time against the pure compute it does, on this machine.

Three settings (FedAvg, Fashion-MNIST, Dirichlet 0.5, `cnn`, 1 local epoch, batch 64):

  a  in-process, 100 clients, 10 sampled per round
  b  in-process, 500 clients, 50 sampled per round
  c  10 client processes over a local Mosquitto, all 60,000 images every round

Each setting runs in a child process of its own (so its peak RSS is its own). The pure
compute is the same number of images through the same model, loss and optimizer in
one plain loop with all cores' threads; the ratio is fedge's seconds per round (rounds
2 and later: round 1 pays one-time costs) over that. Startup is from the call to
``run_federated`` to the first task sent. Prints a table and writes
bench/results/sim_speed.json.

    python bench/sim_speed.py [--only a,b,c] [--rounds-inproc 10] [--rounds-mqtt 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
GOALS = {"a": 1.3, "b": 1.3, "c": 1.1}


@dataclass(frozen=True)
class Setting:
    key: str
    title: str
    transport: str
    clients: int
    per_round: int


SETTINGS = {s.key: s for s in (
    Setting("a", "in-process, 100 clients, 10 per round", "inproc", 100, 10),
    Setting("b", "in-process, 500 clients, 50 per round", "inproc", 500, 50),
    Setting("c", "10 client processes over Mosquitto, all data", "mqtt", 10, 10),
)}


def _peak_rss(who: int) -> int:
    return resource.getrusage(who).ru_maxrss * 1024   # Linux reports KiB


def pure_compute_seconds_per_image(images: int = 6000) -> float:
    """Seconds per image of the same local training in one plain loop, all cores' threads."""
    import torch
    import torch.nn.functional as F

    from edge_client.data import load_dataset
    from edge_client.registry import build_model

    torch.set_num_threads(os.cpu_count() or 1)
    data = load_dataset("fashion-mnist")
    x, y = torch.from_numpy(data.x_train[:images]), torch.from_numpy(data.y_train[:images])
    spec = {"name": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 28}
    model = build_model(spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for start in range(0, 640, 64):   # warm up: lazy imports and allocator
        loss = F.cross_entropy(model(x[start:start + 64]), y[start:start + 64])
        opt.zero_grad()
        loss.backward()
        opt.step()
    began = time.perf_counter()
    order = torch.randperm(images)
    for start in range(0, images, 64):
        idx = order[start:start + 64]
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return (time.perf_counter() - began) / images


def run_setting(setting: Setting, rounds: int) -> dict[str, Any]:
    """One setting, in this process: the run, its startup, round times, peak RSS and the pure compute."""
    from coordinator.config import load_config
    from coordinator.ops.mosquitto import LocalMosquitto
    from coordinator.runtime.run import run_federated

    out = Path(tempfile.mkdtemp(prefix="fedge-simspeed-")) / "run"
    overrides = [("run", "strategy", "fedavg"), ("run", "rounds", rounds), ("run", "seed", 0), ("run", "out", str(out)),
                 ("model", "name", "cnn"), ("data", "eval", "fashion-mnist"), ("data", "partition", "dirichlet:0.5"),
                 ("clients", "expected", setting.clients), ("clients", "per_round", setting.per_round),
                 ("clients", "spawn", setting.clients), ("clients", "round_timeout", 3600.0),
                 ("clients", "presence_timeout", 600.0), ("train", "epochs", 1), ("train", "batch_size", 64),
                 ("train", "lr", 0.05), ("train", "momentum", 0.9), ("eval", "every", 5),
                 ("export", "enabled", False), ("transport", "kind", setting.transport)]
    first_task: list[float] = []

    def on_progress(info: dict[str, Any]) -> None:
        if info.get("kind") == "exchange" and not first_task:
            first_task.append(time.monotonic())

    broker = LocalMosquitto() if setting.transport == "mqtt" else None
    try:
        if broker is not None:
            overrides.append(("transport", "broker", broker.start()))
        started = time.monotonic()
        result = run_federated(load_config(None, overrides), say=lambda s: None, on_progress=on_progress)
    finally:
        if broker is not None:
            broker.stop()
    rows = [json.loads(line) for line in (result.out_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["round"] > 1]
    per_image = pure_compute_seconds_per_image()
    seconds = [r["seconds"] for r in trained]
    pure = [r["train_samples"] * per_image for r in trained]
    return {
        **asdict(setting), "rounds": rounds,
        "startup_seconds": first_task[0] - started if first_task else None,
        "seconds_per_round": statistics.fmean(seconds), "seconds_per_round_each": seconds,
        "pure_compute_seconds_per_round": statistics.fmean(pure),
        "ratio": sum(seconds) / sum(pure),
        "images_per_round": statistics.fmean(r["train_samples"] for r in trained),
        "pure_compute_images_per_second": 1.0 / per_image,
        "peak_rss_bytes": _peak_rss(resource.RUSAGE_SELF),
        "peak_rss_client_process_bytes": _peak_rss(resource.RUSAGE_CHILDREN) if setting.transport == "mqtt" else None,
        "final_accuracy": result.summary.get("final_accuracy"),
        "goal_ratio": GOALS[setting.key],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="a,b,c", help="settings to run, e.g. a,c (default a,b,c)")
    parser.add_argument("--rounds-inproc", type=int, default=10, help="rounds of settings a and b (default 10)")
    parser.add_argument("--rounds-mqtt", type=int, default=3, help="rounds of setting c (default 3)")
    parser.add_argument("--out", type=Path, default=RESULTS / "sim_speed.json", help="JSON result file")
    parser.add_argument("--child", help=argparse.SUPPRESS)      # run one setting here, print its JSON
    args = parser.parse_args()
    if args.child:
        setting = SETTINGS[args.child]
        rounds = args.rounds_mqtt if setting.transport == "mqtt" else args.rounds_inproc
        print(json.dumps(run_setting(setting, rounds)))
        return 0

    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 140)
    results = []
    for key in args.only.split(","):
        setting = SETTINGS[key.strip()]
        console.print(f"[bold]{setting.key}: {setting.title}[/bold]")
        child = subprocess.run([sys.executable, __file__, "--child", setting.key,
                                "--rounds-inproc", str(args.rounds_inproc), "--rounds-mqtt", str(args.rounds_mqtt)],
                               capture_output=True, text=True)
        if child.returncode != 0:
            console.print(f"[red]setting {setting.key} failed:[/red]\n{child.stderr[-3000:]}")
            return 1
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
        r = results[-1]
        console.print(f"  {r['seconds_per_round']:.2f} s per round, "
                      f"pure compute {r['pure_compute_seconds_per_round']:.2f} s,"
                      f" ratio {r['ratio']:.2f} (goal {r['goal_ratio']}), startup {r['startup_seconds']:.1f} s, "
                      f"peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MB", highlight=False)
    table = Table(title="fedge round time against the pure compute (rounds 2 and later)")
    for name in ("setting", "s/round", "pure s/round", "ratio (goal)", "startup s", "peak RSS", "client RSS"):
        table.add_column(name, justify="left" if name == "setting" else "right", no_wrap=True)
    for r in results:
        client = r["peak_rss_client_process_bytes"]
        table.add_row(f"{r['key']}: {r['title']}", f"{r['seconds_per_round']:.2f}",
                      f"{r['pure_compute_seconds_per_round']:.2f}", f"{r['ratio']:.2f} ({r['goal_ratio']})",
                      f"{r['startup_seconds']:.1f}", f"{r['peak_rss_bytes'] / 2**20:.0f} MB",
                      "" if client is None else f"{client / 2**20:.0f} MB")
    console.print(table)
    report = {"machine": {"python": platform.python_version(), "arch": platform.machine(), "cpus": os.cpu_count()},
              "settings": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    console.print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
