"""Poisoned updates against the aggregation rules: what 2 hostile clients of 10 do to each rule.

The hostile clients train like the others and then send ``factor`` times their update
(20: scaled, -4: sign-flipped and scaled). Every rule runs the same seeded run on
scikit-learn's digits (10 clients, all of them every round, IID split), clean and
under each attack; the norm bound (``aggregate.norm_bound``) runs with the mean.

    python bench/poisoning.py [--rounds 15] [--seeds 0,1,2]

Prints the table and writes ``bench/results/poisoning.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench_io import RESULTS, write_result
from coordinator.config import load_config
from coordinator.run import run_federated
from edge_client import registry
from edge_client.objectives import LocalData, ObjectiveOutput, TaskContext, train

ATTACKS = {"clean": 1.0, "scaled x20": 20.0, "sign-flipped x-4": -4.0}
DEFENCES = {"mean": {}, "median": {"rule": "median"}, "trimmed_mean": {"rule": "trimmed_mean", "trim": 0.2},
            "clipped_mean": {"rule": "clipped_mean"}, "mean + norm bound 3": {"norm_bound": 3.0}}
HOSTILE = ("sim-000", "sim-001")


def hostile_train(factor: float, hostile: tuple[str, ...] = HOSTILE):
    """The ``train`` objective, except that ``hostile`` clients send ``factor`` times their update."""
    def objective(model: nn.Module, data: LocalData, hyper: Mapping[str, Any], ctx: TaskContext) -> ObjectiveOutput:
        start = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}
        out = train(model, data, hyper, ctx)
        if ctx.client_id in hostile:
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    if k in start:
                        v.copy_(start[k] + factor * (v - start[k]))
        return out
    return objective


@contextlib.contextmanager
def attacked(factor: float) -> Iterator[None]:
    """Clients in this process run the hostile objective while the block runs."""
    original = registry.OBJECTIVES["train"]
    registry.OBJECTIVES["train"] = hostile_train(factor)
    try:
        yield
    finally:
        registry.OBJECTIVES["train"] = original


def run(out: Path, *, factor: float, defence: Mapping[str, Any], rounds: int, seed: int) -> dict[str, Any]:
    """One in-process run on digits; its last test accuracy and how many updates the bound rejected."""
    sets = {("run", "rounds"): rounds, ("run", "seed"): seed, ("run", "out"): str(out), ("model", "name"): "cnn",
            ("data", "eval"): "digits", ("data", "partition"): "iid", ("clients", "expected"): 10,
            ("clients", "spawn"): 10, ("transport", "kind"): "inproc", ("export", "enabled"): False,
            ("eval", "every"): rounds, **{("aggregate", k): v for k, v in defence.items()}}
    config = load_config(None, [(*k, v) for k, v in sets.items()])
    with attacked(factor):
        run_federated(config, say=lambda s: None)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"accuracy": rows[-1]["test_accuracy"], "norm_rejected": sum(r.get("norm_rejected", 0) for r in rows)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", type=Path, default=RESULTS / "poisoning.json")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    table: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:
        for defence, settings in DEFENCES.items():
            for attack, factor in ATTACKS.items():
                runs = [run(Path(scratch) / f"{defence}-{attack}-{seed}", factor=factor, defence=settings,
                            rounds=args.rounds, seed=seed) for seed in seeds]
                accs = [100 * r["accuracy"] for r in runs]
                cell = {"mean": statistics.mean(accs), "std": statistics.pstdev(accs), "runs": accs,
                        "norm_rejected": sum(r["norm_rejected"] for r in runs)}
                table.setdefault(defence, {})[attack] = cell
                rejected = f"  ({cell['norm_rejected']} rejected)" if cell["norm_rejected"] else ""
                print(f"{defence:22s} {attack:18s} {cell['mean']:6.2f} ± {cell['std']:.2f}{rejected}", flush=True)
    result = {"data": "digits", "clients": 10, "hostile": list(HOSTILE), "rounds": args.rounds, "seeds": seeds,
              "attacks": ATTACKS, "defences": DEFENCES, "test_accuracy": table,
              "seconds": time.monotonic() - started}
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
