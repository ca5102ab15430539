"""Poisoned updates against the aggregation rules: what 2 hostile clients of 10 do to each rule.

The hostile clients train like the others and then send ``factor`` times their update
(20 and 1,000: scaled; -1: sign-flipped; -4: sign-flipped and scaled). Every rule runs
with its shipped defaults (``aggregate.trim`` included) the same seeded run on
scikit-learn's digits (10 clients, all of them every round, IID split), clean and under
each attack; the norm bound (``aggregate.norm_bound``) runs with the mean, and the trimmed
mean runs again with trim 0.1 (one value of 10 per side, the default before 0.2). Each run
evaluates every round, so the JSON has the accuracy curve beside the last round's.

    python bench/poisoning.py [--rounds 15] [--seeds 0,1,2] [--skip-existing]

Prints a line per rule and attack and writes ``bench/results/poisoning.json`` after each
of them; ``--skip-existing`` keeps the cells that file already holds for the same rounds,
seeds, rule settings and attack, so an interrupted measurement resumes where it stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench_io import RESULTS, write_result
from coordinator.aggregation import tolerance
from coordinator.config import RunConfig, load_config
from coordinator.runtime.engine import RunError
from coordinator.runtime.run import run_federated
from edge_client.objectives import LocalData, ObjectiveOutput, TaskContext, train

ATTACKS = {"clean": 1.0, "scaled x20": 20.0, "scaled x1000": 1000.0, "sign-flipped x-1": -1.0,
           "sign-flipped x-4": -4.0}
DEFENCES = {"mean": {}, "median": {"rule": "median"}, "trimmed_mean": {"rule": "trimmed_mean"},
            "clipped_mean": {"rule": "clipped_mean"}, "mean + norm bound 3": {"norm_bound": 3.0},
            "trimmed_mean, trim 0.1": {"rule": "trimmed_mean", "trim": 0.1}}   # the default before 0.2
HOSTILE = ("sim-000", "sim-001")
# A round takes about a second here, on a busy machine; one that waits this long has a client whose result was
# rejected (non-finite, after an attack broke the model), so the run stops instead of waiting 3 x 300 s.
ROUND_TIMEOUT = 30.0


def hostile_train(factor: float):
    """The ``train`` objective, except that the client sends ``factor`` times its update."""
    def objective(model: nn.Module, data: LocalData, hyper: Mapping[str, Any], ctx: TaskContext) -> ObjectiveOutput:
        start = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}
        out = train(model, data, hyper, ctx)
        with torch.no_grad():
            for k, v in model.state_dict().items():
                if k in start:
                    v.copy_(start[k] + factor * (v - start[k]))
        return out
    return objective


def attack(factor: float, hostile: tuple[str, ...] = HOSTILE):
    """The objectives each client runs instead of the registry's: ``hostile`` ones the scaled ``train``."""
    scaled = {"train": hostile_train(factor)}
    return lambda client_id: scaled if client_id in hostile else {}


def run_config(out: Path, *, defence: Mapping[str, Any], rounds: int, seed: int) -> RunConfig:
    """The in-process run on digits that every rule and attack shares, evaluated every round."""
    sets = {("run", "rounds"): rounds, ("run", "seed"): seed, ("run", "out"): str(out), ("model", "name"): "cnn",
            ("data", "eval"): "digits", ("data", "partition"): "iid", ("clients", "expected"): 10,
            ("clients", "spawn"): 10, ("transport", "kind"): "inproc", ("export", "enabled"): False,
            ("clients", "round_timeout"): ROUND_TIMEOUT, ("clients", "max_attempts"): 1,
            **{("aggregate", k): v for k, v in defence.items()}}
    return load_config(None, [(*k, v) for k, v in sets.items()])


def run(out: Path, *, factor: float, defence: Mapping[str, Any], rounds: int, seed: int) -> dict[str, Any]:
    """One run; its last test accuracy, the accuracy after each round and how many updates the bound rejected.

    A model an attack drove to non-finite weights makes the clients' results non-finite, which the
    coordinator rejects, and the run stops: then ``stopped`` says why and the accuracy is the last
    one evaluated."""
    stopped = ""
    try:
        run_federated(run_config(out, defence=defence, rounds=rounds, seed=seed), say=lambda s: None,
                      client_objectives=attack(factor))
    except RunError as exc:
        stopped = str(exc)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"accuracy": rows[-1]["test_accuracy"], "by_round": [r["test_accuracy"] for r in rows],
            "norm_rejected": sum(r.get("norm_rejected", 0) for r in rows), "stopped": stopped}


def _finished(path: Path, rounds: int, seeds: list[int]) -> dict[str, dict[str, Any]]:
    """The cells of an earlier ``path`` measured with the same rounds, seeds, rule settings and attacks."""
    if not path.exists():
        return {}
    old = json.loads(path.read_text())
    if old.get("rounds") != rounds or old.get("seeds") != seeds:
        return {}
    return {defence: {attack: cell for attack, cell in cells.items()
                      if old.get("attacks", {}).get(attack) == ATTACKS.get(attack)}
            for defence, cells in old.get("test_accuracy", {}).items()
            if old.get("defences", {}).get(defence) == DEFENCES.get(defence)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", type=Path, default=RESULTS / "poisoning.json")
    parser.add_argument("--skip-existing", action="store_true",
                        help="keep the cells --out already holds for the same rounds, seeds and settings")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    table = _finished(args.out, args.rounds, seeds) if args.skip_existing else {}
    settings_used: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for defence, settings in DEFENCES.items():
            a = run_config(Path(scratch), defence=settings, rounds=args.rounds, seed=0).aggregate
            said = tolerance(a.rule, trim=a.trim, norm_bound=a.norm_bound, per_round=10)
            settings_used[defence] = {**dataclasses.asdict(a), "tolerance": said.message}
            print(said.message, flush=True)
            for attack, factor in ATTACKS.items():
                cell = table.get(defence, {}).get(attack)
                if cell is None:
                    cell_started = time.monotonic()
                    runs = [run(Path(scratch) / f"{defence}-{attack}-{seed}", factor=factor, defence=settings,
                                rounds=args.rounds, seed=seed) for seed in seeds]
                    accs = [100 * r["accuracy"] for r in runs]
                    cell = {"mean": statistics.mean(accs), "std": statistics.pstdev(accs), "runs": accs,
                            "by_round": [[100 * a for a in r["by_round"]] for r in runs],
                            "norm_rejected": sum(r["norm_rejected"] for r in runs),
                            "stopped": [r["stopped"] for r in runs], "seconds": time.monotonic() - cell_started}
                    table.setdefault(defence, {})[attack] = cell
                    write_result(args.out, _result(table, settings_used, args.rounds, seeds))
                rejected = f"  ({cell['norm_rejected']} rejected)" if cell["norm_rejected"] else ""
                stops = sum(1 for why in cell["stopped"] if why)
                stopped = f"  ({stops} of {len(seeds)} runs stopped early)" if stops else ""
                print(f"{defence:22s} {attack:18s} {cell['mean']:6.2f} ± {cell['std']:.2f}{rejected}{stopped}",
                      flush=True)
    write_result(args.out, _result(table, settings_used, args.rounds, seeds))
    return 0


def _result(table: dict[str, dict[str, Any]], settings: dict[str, dict[str, Any]], rounds: int,
            seeds: list[int]) -> dict[str, Any]:
    """The JSON written: cells in the order of DEFENCES and ATTACKS, and the seconds they took together
    (over every invocation that measured them, with --skip-existing)."""
    return {"data": "digits", "clients": 10, "hostile": list(HOSTILE), "rounds": rounds, "seeds": seeds,
            "attacks": ATTACKS, "defences": DEFENCES, "settings": settings,
            "test_accuracy": {d: {a: table[d][a] for a in ATTACKS if a in table[d]} for d in DEFENCES if d in table},
            "seconds": sum(c.get("seconds", 0.0) for cells in table.values() for c in cells.values())}


if __name__ == "__main__":
    raise SystemExit(main())
