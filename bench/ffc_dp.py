"""FFC's calibration pass under central DP: what the noise costs in accuracy and what the pass costs in epsilon.

1. Train SphereFed without DP by a short in-process run (``--rounds`` rounds, 100 spawned clients, 10 a
   round, Fashion-MNIST, the protocol's local training), ending in the plain (non-private) FFC pass; or
   reuse such a run's directory (``--run DIR``).
2. On its final extractor, every device's FFC statistics with the device's own objective (``ffc_stats``),
   once; their norms (what ``ffc.clip`` bounds).
3. For each bound in ``--clips`` and each z_ffc in ``--z``, ``--repeats`` times: the devices' statistics held
   to the bound (``clip_stats``, as the device does), the strategy's private pass (``aggregate("ffc")`` with
   central DP: noise on the sums, the eigenvalue floor, the solve) and the calibrated head's test accuracy;
   and the epsilon the pass alone costs at ``--delta`` (one unsampled Gaussian mechanism).

Prints a table and writes ``bench/results/ffc_dp.json``.

    python bench/ffc_dp.py [--rounds 10] [--model cnn] [--partition dirichlet:0.1] [--run DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coordinator.config import load_config
from coordinator.privacy import CentralPrivacy, release_epsilon
from coordinator.runtime.run import run_federated
from coordinator.strategies.base import ClientResult
from edge_client.data import client_split, load_dataset
from edge_client.objectives import LocalData, TaskContext
from edge_client.privacy import update_norm
from edge_client.registry import build_model
from methods.spherefed.device import BOUNDED_NAMES, clip_stats, ffc_stats, sphere_accuracies
from methods.spherefed.model import CLASSIFIER
from methods.spherefed.strategy import FfcSection, SphereFed
from profiling.profiler import Profiler
from storage.checkpoint import latest_checkpoint, load_checkpoint

RESULTS = Path(__file__).resolve().parent / "results"
CLIENTS, PER_ROUND, SEED = 100, 10, 0


def train(out: Path, rounds: int, model: str, partition: str) -> dict[str, Any]:
    """The non-private SphereFed + FFC run the private passes start from; its last row."""
    sets = {"run.strategy": "spherefed", "run.rounds": rounds, "run.out": str(out), "run.seed": SEED,
            "model.name": model, "model.head": "sphere", "data.eval": "fashion-mnist", "data.partition": partition,
            "clients.expected": CLIENTS, "clients.spawn": CLIENTS, "clients.per_round": PER_ROUND,
            "train.epochs": 1, "train.batch_size": 64, "train.lr": 0.02, "train.momentum": 0.9, "eval.every": 5,
            "transport.kind": "inproc", "export.enabled": False}
    run_federated(load_config(None, [(*k.split(".", 1), v) for k, v in sets.items()]), say=print)
    return last_row(out)


def last_row(out: Path) -> dict[str, Any]:
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])


def device_results(model: torch.nn.Module, partition: str) -> list[ClientResult]:
    """Every device's unbounded FFC statistics, by the device's own objective on its own partition."""
    data = load_dataset("fashion-mnist")
    out = []
    for i in range(CLIENTS):
        x, y = client_split(data, partition, i, CLIENTS, SEED)
        ctx = TaskContext(seed=SEED, round=0, client_id=f"sim-{i:03d}", state_dir=None, profiler=Profiler())
        o = ffc_stats(model, LocalData(torch.from_numpy(x), torch.from_numpy(y)), {"dtype": "float64"}, ctx)
        out.append(ClientResult(f"sim-{i:03d}", o.num_samples, o.tensors, o.metrics))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--partition", default="dirichlet:0.1")
    ap.add_argument("--run", type=Path, help="a finished non-private spherefed run directory to start from")
    ap.add_argument("--out", type=Path, default=Path("/tmp/fedge-ffc-dp-run"))
    ap.add_argument("--z", default="0,0.5,1,2,4", help="z_ffc values")
    ap.add_argument("--clips", default="30,100,300,1000", help="ffc.clip values")
    ap.add_argument("--repeats", type=int, default=3, help="noise draws per cell")
    ap.add_argument("--delta", type=float, default=1e-5)
    args = ap.parse_args(argv)
    started = time.process_time()

    run_dir = args.run
    if run_dir is None:
        run_dir = args.out
        train(run_dir, args.rounds, args.model, args.partition)
    row = last_row(run_dir)
    train_cpu = time.process_time() - started
    state, _ = load_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    model = build_model(state.spec)
    model.load_state_dict(state.params, strict=False)
    test = load_dataset("fashion-mnist")
    xt, yt = torch.from_numpy(test.x_test), torch.from_numpy(test.y_test)

    results = device_results(model, args.partition)
    norms = sorted(update_norm({k: r.tensors[k] for k in BOUNDED_NAMES}) for r in results)
    sizes = sorted(r.num_samples for r in results)
    print(f"devices: {len(results)}, samples median {statistics.median(sizes)} (min {sizes[0]}, max {sizes[-1]}); "
          f"statistics' L2 norm median {statistics.median(norms):.1f} (min {norms[0]:.1f}, max {norms[-1]:.1f})")

    strategy = SphereFed({}, sphere_seed=state.spec["sphere_seed"], ffc=FfcSection())
    fixed = strategy.fixed(state)
    base = dataclasses.replace(state, params={**state.params, CLASSIFIER: fixed})   # the extractor, uncalibrated
    plain, _ = strategy.aggregate("ffc", state.round, base, results)
    before, plain_acc = sphere_accuracies(model, xt, yt, [fixed, plain.params[CLASSIFIER]])
    print(f"fixed classifier {before:.4f}, plain FFC {plain_acc:.4f} (the run's row: {row.get('ffc_accuracy_after')})")

    zs = [float(v) for v in args.z.split(",")]
    clips = [float(v) for v in args.clips.split(",")]
    cells, heads = [], []
    for clip in clips:
        bounded = [ClientResult(r.client_id, r.num_samples, clip_stats(r.tensors, clip)[0], r.metrics)
                   for r in results]
        clipped = sum(1 for n in norms if n > clip) / len(norms)
        for z in zs:
            strategy.privacy = CentralPrivacy(1.0, 1.0, args.delta, 0.0, PER_ROUND, PER_ROUND / CLIENTS)
            strategy.ffc = FfcSection(clip=clip, noise_multiplier=z)
            first = len(heads)
            for _ in range(args.repeats if z > 0 else 1):   # the noise comes from the OS's entropy, as in a run
                new, metrics = strategy.aggregate("ffc", state.round, base, bounded)
                heads.append(new.params[CLASSIFIER])
            eps = release_epsilon([z], delta=args.delta) if z > 0 else float("inf")
            cells.append({"ffc_clip": clip, "z_ffc": z, "epsilon_pass": eps, "clipped_fraction": clipped,
                          "noise_std": z * clip, "eigenvalue_floor": metrics.get("dp_ffc_eigenvalue_floor"),
                          "heads": (first, len(heads))})
    accuracies = sphere_accuracies(model, xt, yt, heads)   # one pass over the test set for every head
    for cell in cells:
        accs = accuracies[slice(*cell.pop("heads"))]
        cell.update(accuracies=accs, accuracy_mean=statistics.fmean(accs), accuracy_std=statistics.pstdev(accs))
        print(f"ffc_clip {cell['ffc_clip']:>6g}  z_ffc {cell['z_ffc']:>4g}  eps(pass) {cell['epsilon_pass']:>8.3f}  "
              f"clipped {cell['clipped_fraction']:5.2f}  accuracy {cell['accuracy_mean']:.4f} ± {cell['accuracy_std']:.4f}")
    out = {"command": "python bench/ffc_dp.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "data": "fashion-mnist", "clients": CLIENTS, "per_round": PER_ROUND, "rounds": row["round"],
           "model": args.model, "partition": args.partition, "delta": args.delta, "seed": SEED,
           "device_samples": {"median": statistics.median(sizes), "min": sizes[0], "max": sizes[-1]},
           "stat_norms": {"median": statistics.median(norms), "p10": float(np.percentile(norms, 10)),
                          "p90": float(np.percentile(norms, 90)), "min": norms[0], "max": norms[-1]},
           "accuracy_fixed": before, "accuracy_plain_ffc": plain_acc, "cells": cells,
           "cpu_seconds": time.process_time() - started, "train_cpu_seconds": train_cpu,
           "machine": platform.machine(), "torch": torch.__version__}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ffc_dp.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {RESULTS / 'ffc_dp.json'} ({out['cpu_seconds']:.0f} CPU s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
