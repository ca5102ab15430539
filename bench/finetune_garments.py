"""What federated fine-tuning saves: the garments example (examples/garments) trained from scratch and fine-tuned.

Setting: Fashion-MNIST's classes 5-9 as coloured 3x48x48 pictures, a MobileNetV3-Small-class network (1.52 M
parameters), 3 devices in this process (inproc transport), each with its own pictures, FedAvg, 1 local epoch,
batch 32, SGD lr 0.05 momentum 0.9, 10 rounds. ``garments`` trains all of the network from the coordinator's
initial weights; ``garments-ft`` loads a feature extractor pretrained on classes 0-4 on every party and trains
and sends only the classifier. Prints, for each, bytes down and up per device per round, device seconds per
round (the devices' task times), accuracy round by round and at equal rounds, and writes them to
bench/results/finetune_garments.json.

    PYTHONPATH=$PWD python bench/finetune_garments.py [--rounds 10] [--clients 3] [--per-device 500]
        [--eval 1000] [--weights pretrained.safetensors]

Without ``--weights`` it first pretrains (``python -m garments_app.pretrain``'s defaults) in a copy of the
package, as a user would once before a fleet fine-tunes; its seconds are reported too.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.bench_io import RESULTS, write_result
from coordinator.config import load_config
from coordinator.runtime.run import run_federated
from storage.checkpoint import latest_checkpoint, load_checkpoint
from storage.files import read_jsonl

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "garments"
APPS = {"scratch": "garments_app:app", "finetune": "garments_app:finetune"}


def device_seconds(out: Path) -> dict[int, float]:
    """Round -> the median over devices of a training task's seconds, from the run's clients/ID.jsonl."""
    by_round: dict[int, list[float]] = {}
    for history in (out / "clients").glob("*.jsonl"):
        for line in read_jsonl(history):
            profile = line.get("profile") or {}
            if profile.get("steps") and isinstance(profile.get("seconds"), (int, float)):
                by_round.setdefault(int(line["round"]), []).append(float(profile["seconds"]))
    return {r: statistics.median(v) for r, v in sorted(by_round.items())}


def exchanged_parameters(out: Path) -> int:
    """How many numbers the run's model exchanges: those in its last checkpoint (the trainable part alone)."""
    state, _ = load_checkpoint(latest_checkpoint(out / "checkpoints"))
    return sum(int(t.numel()) for t in state.params.values())


def run(kind: str, data: Path, out: Path, args: argparse.Namespace, console: Console) -> dict[str, Any]:
    overrides = [("run", "rounds", args.rounds), ("run", "seed", 0), ("run", "out", str(out)),
                 ("app", "module", APPS[kind]), ("data", "eval", str(data)), ("clients", "expected", args.clients),
                 ("clients", "spawn", args.clients), ("clients", "round_timeout", 1800.0),
                 ("transport", "kind", "inproc"), ("train", "epochs", 1), ("train", "batch_size", 32),
                 ("train", "lr", args.lr), ("train", "momentum", 0.9), ("aggregate", "order", "sorted")]
    started = time.monotonic()
    result = run_federated(load_config(None, overrides), say=lambda s: console.print(f"[dim]{kind}: {s}[/dim]"))
    wall = time.monotonic() - started
    rows = read_jsonl(result.out_dir / "metrics.jsonl")
    trained = [r for r in rows if r["round"] > 0]
    seconds = device_seconds(result.out_dir)
    return {
        "app": APPS[kind],
        "exchanged_parameters": exchanged_parameters(result.out_dir),
        "accuracy_per_round": [r.get("test_accuracy") for r in rows],   # round 0: the initial model
        "bytes_down_per_device_per_round": statistics.median(r["bytes_down_per_client"] for r in trained),
        "bytes_up_per_device_per_round": statistics.median(r["bytes_up_per_client"] for r in trained),
        "device_seconds_per_round": statistics.median(seconds.values()) if seconds else None,
        "device_seconds_by_round": list(seconds.values()),
        "round_seconds": statistics.median(r["seconds"] for r in trained),
        "wall_seconds": wall,
        "run_dir": str(result.out_dir),
    }


def first_reaching(accuracies: list[float | None], level: float) -> int | None:
    """The first round whose accuracy is at least ``level``; None when none is."""
    return next((i for i, a in enumerate(accuracies) if a is not None and a >= level), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=3, help="devices (default 3)")
    parser.add_argument("--per-device", type=int, default=500, help="target-task pictures per device (default 500)")
    parser.add_argument("--eval", type=int, default=1000, help="test pictures the coordinator evaluates on")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--weights", type=Path, help="a pretrained.safetensors to use instead of pretraining")
    parser.add_argument("--out", type=Path, default=RESULTS / "finetune_garments.json", help="JSON result file")
    args = parser.parse_args()
    console = Console()
    root = Path(tempfile.mkdtemp(prefix="fedge-garments-"))
    shutil.copytree(EXAMPLE / "garments_app", root / "garments_app",
                    ignore=shutil.ignore_patterns("__pycache__", "*.safetensors"))
    sys.path.insert(0, str(root))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])
    importlib.invalidate_caches()
    from garments_app.pretrain import pretrain
    from garments_app.split import split

    weights = root / "garments_app" / "pretrained.safetensors"
    pretrain_figures: dict[str, Any] = {"from": str(args.weights)} if args.weights else {}
    if args.weights:
        shutil.copyfile(args.weights, weights)
    else:
        pretrain_figures = pretrain(weights, say=lambda s: console.print(f"[dim]pretrain: {s}[/dim]"))
    pretrain_figures["sha256"] = hashlib.sha256(weights.read_bytes()).hexdigest()
    split(root / "data", args.clients, args.per_device, evaluation=args.eval)
    results = {kind: run(kind, root / "data", root / kind, args, console) for kind in APPS}
    scratch, tuned = results["scratch"]["accuracy_per_round"], results["finetune"]["accuracy_per_round"]
    figures = {
        "setting": {"data": "fashion-mnist classes 5-9, 3x48x48 tinted", "devices": args.clients,
                    "per_device": args.per_device, "eval_pictures": args.eval, "rounds": args.rounds,
                    "epochs": 1, "batch_size": 32, "lr": args.lr, "momentum": 0.9, "transport": "inproc",
                    "network": "MobileNetV3-Small (examples/garments/garments_app/network.py)"},
        "machine": {"python": platform.python_version(), "arch": platform.machine(), "cpus": os.cpu_count()},
        "pretrain": pretrain_figures,
        **results,
        "at_equal_rounds": {str(r): {"scratch": scratch[r], "finetune": tuned[r]}
                            for r in sorted({1, 2, 5, args.rounds} & set(range(1, args.rounds + 1)))},
        "scratch_round_reaching_finetune_round_1": first_reaching(scratch, tuned[1]) if len(tuned) > 1 else None,
        "up_ratio": results["finetune"]["bytes_up_per_device_per_round"]
        / results["scratch"]["bytes_up_per_device_per_round"],
        "down_ratio": results["finetune"]["bytes_down_per_device_per_round"]
        / results["scratch"]["bytes_down_per_device_per_round"],
    }
    if results["scratch"]["device_seconds_per_round"] and results["finetune"]["device_seconds_per_round"]:
        figures["device_seconds_ratio"] = (results["finetune"]["device_seconds_per_round"]
                                           / results["scratch"]["device_seconds_per_round"])
    table = Table(title=f"garments: scratch vs fine-tuned, {args.clients} devices, {args.rounds} rounds")
    table.add_column("figure")
    table.add_column("scratch", justify="right")
    table.add_column("fine-tune", justify="right")
    for key in ("exchanged_parameters", "bytes_down_per_device_per_round", "bytes_up_per_device_per_round",
                "device_seconds_per_round", "round_seconds"):
        cells = [results[k][key] for k in APPS]
        table.add_row(key, *(f"{v:,.2f}" if isinstance(v, float) else f"{v:,}" if v is not None else "-"
                             for v in cells))
    for r in range(args.rounds + 1):
        table.add_row(f"accuracy, round {r}", f"{scratch[r]:.4f}", f"{tuned[r]:.4f}")
    console.print(table)
    write_result(args.out, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
