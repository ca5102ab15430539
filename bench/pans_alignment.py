"""Do clients' hidden neurons drift into other orders? The measurement behind the PANs verdict.

PANs exist to keep neuron j of every client doing what neuron j of the others does, so that
averaging coordinates averages like with like. If the clients of a round never permute their
neurons in the first place, PANs have nothing to fix. This measures it in the drift cell of
``bench/matrices/pans_drift.toml`` (Fashion-MNIST, Dirichlet 0.1 over 100 clients, ``cnn``,
5 local epochs, batch 64, SGD lr 0.02 momentum 0.9), with PANs off and ``mul``:

1. FedAvg runs ``--rounds`` rounds through the in-process transport, keeping every round's
   checkpoint (the global models).
2. From the global model of each round in ``--at``, ``--clients`` clients (the first ones of the
   run's partition) each train their 5 local epochs with the device's own training code.
3. On 512 fixed test images, ``coordinator.diagnostics.neuron_matching`` (Hungarian matching on
   the correlation of activations) gives, per hidden layer, the fraction of neurons matched to
   the same index: each client against the global model it started from, and every pair of
   clients (what averaging combines). 1.0: nothing permuted; a shuffled layer scores about 1/J.
   Neurons dead on the batch correlate with nothing and are matched anywhere, so the table also
   gives the same-index correlation (neuron j against neuron j, over the neurons active in both)
   and the fraction of neurons active.

Prints the table and writes ``bench/results/pans_alignment.json``.

    python bench/pans_alignment.py [--rounds 20] [--at 1,10,20] [--clients 10] [--seed 0]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from coordinator.config import load_config  # noqa: E402
from coordinator.diagnostics import hidden_activations, neuron_matching, unit_rows  # noqa: E402
from coordinator.runtime.run import run_federated  # noqa: E402
from edge_client.data import load_client_split, load_dataset  # noqa: E402
from edge_client.objectives import TaskContext, local_data, shuffle_seed, train  # noqa: E402
from edge_client.registry import build_model  # noqa: E402
from profiling.profiler import Profiler  # noqa: E402
from storage.checkpoint import checkpoint_rounds, load_checkpoint  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PARTITION, CLIENTS_IN_ALL = "dirichlet:0.1", 100
HYPER = {"epochs": 5, "batch_size": 64, "lr": 0.02, "momentum": 0.9}
PANS = {"off": [("model", "pan", "none")], "mul": [("model", "pan", "mul"), ("model", "pan_amplitude", 0.1)]}


def global_models(pan: str, rounds: int, seed: int, data: str, scratch: Path) -> dict[int, Path]:
    """FedAvg in the drift cell's setting for ``rounds`` rounds; every round's checkpoint by round."""
    overrides = [("run", "strategy", "fedavg"), ("run", "rounds", rounds), ("run", "seed", seed),
                 ("run", "out", str(scratch / pan)), ("checkpoint", "keep", "all"), ("export", "enabled", False),
                 ("model", "name", "cnn"), *PANS[pan], ("data", "eval", data), ("data", "partition", PARTITION),
                 ("clients", "expected", CLIENTS_IN_ALL), ("clients", "per_round", 10),
                 ("clients", "spawn", CLIENTS_IN_ALL), ("transport", "kind", "inproc"),
                 *[("train", k, v) for k, v in HYPER.items()], ("eval", "every", rounds)]
    result = run_federated(load_config(None, overrides), say=lambda s: None)
    found: dict[int, Path] = {}
    for directory in {p.parent for p in result.out_dir.rglob("round_*.safetensors")}:
        found.update(checkpoint_rounds(directory))
    return found


def local_models(checkpoint: Path, clients: list[int], seed: int, data: str) -> tuple[torch.nn.Module,
                                                                                         list[torch.nn.Module]]:
    """The global model of a checkpoint, and each client's model after its local epochs from it."""
    state, _ = load_checkpoint(checkpoint)
    start = build_model(state.spec)
    start.load_state_dict(state.params, strict=False)
    trained = []
    for index in clients:
        client_id = f"sim-{index:03d}"
        x, y = load_client_split(data, PARTITION, index, CLIENTS_IN_ALL, seed)
        model = build_model(state.spec)
        model.load_state_dict(start.state_dict())
        ctx = TaskContext(seed=shuffle_seed(seed, state.round + 1, client_id), round=state.round + 1,
                          client_id=client_id, state_dir=None, profiler=Profiler())
        train(model, local_data(x, y, 0.0, seed=seed, client_id=client_id), HYPER, ctx)
        trained.append(model.eval())
    return start.eval(), trained


def same_index_correlation(a: torch.nn.Module, b: torch.nn.Module, x: torch.Tensor) -> dict[str, tuple[float, float]]:
    """Per hidden layer: the mean correlation of neuron j of ``a`` with neuron j of ``b`` over the neurons
    active in both, and the fraction active in both. Dead neurons (no variance on the batch) correlate
    with nothing, so the Hungarian matching places them anywhere; this figure leaves them out."""
    out = {}
    acts_a, acts_b = hidden_activations(a, x), hidden_activations(b, x)
    for layer, u in acts_a.items():
        (ua, live_a), (ub, live_b) = unit_rows(u), unit_rows(acts_b[layer])
        live = live_a & live_b
        corr = (ua[live] * ub[live]).sum(1)
        out[layer] = (float(corr.mean()) if live.any() else 0.0, float(live.double().mean()))
    return out


def alignment(start: torch.nn.Module, trained: list[torch.nn.Module], x: torch.Tensor) -> dict[str, dict[str, float]]:
    """Per hidden layer, mean over clients (or pairs of clients): the fraction matched to the same index,
    client vs the global model it started from and client vs client, and the same-index correlation."""
    to_start = [neuron_matching(m, start, x) for m in trained]
    pair_list = list(itertools.combinations(trained, 2))
    pairs = [neuron_matching(a, b, x) for a, b in pair_list]
    corr_start = [same_index_correlation(m, start, x) for m in trained]
    corr_pairs = [same_index_correlation(a, b, x) for a, b in pair_list]
    return {layer: {"client_vs_global": statistics.fmean(r[layer] for r in to_start),
                    "client_vs_client": statistics.fmean(r[layer] for r in pairs),
                    "client_vs_client_min": min(r[layer] for r in pairs),
                    "corr_vs_global": statistics.fmean(r[layer][0] for r in corr_start),
                    "corr_client_vs_client": statistics.fmean(r[layer][0] for r in corr_pairs),
                    "live_fraction": statistics.fmean(r[layer][1] for r in corr_start)}
            for layer in to_start[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="FedAvg rounds that make the global models")
    parser.add_argument("--at", default="1,10,20", help="rounds whose global model (checkpoint) the clients start from")
    parser.add_argument("--clients", type=int, default=10, help="clients that train from each global model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default="fashion-mnist", help="dataset spec (fashion-mnist or fashion-mnist:DIR)")
    parser.add_argument("--out", type=Path, default=RESULTS / "pans_alignment.json")
    args = parser.parse_args(argv)
    at = [int(r) for r in args.at.split(",")]
    if any(r < 1 or r > args.rounds for r in at) or args.clients < 2:
        parser.error("--at rounds must lie in 1..--rounds (round 0 has no checkpoint), and --clients must be at least 2 (pairs are compared)")
    console = Console()
    test = load_dataset(args.data, train=False)
    x = torch.from_numpy(test.x_test[:512])
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fedge-pans-alignment-") as scratch:
        for pan in PANS:
            console.print(f"[bold]PANs {pan}[/bold]: {args.rounds} FedAvg rounds (5 local epochs, Dirichlet 0.1)")
            checkpoints = global_models(pan, args.rounds, args.seed, args.data, Path(scratch))
            missing = [r for r in at if r not in checkpoints]
            if missing:
                console.print(f"[red]no checkpoint of rounds {missing} (found {sorted(checkpoints)})[/red]")
                return 1
            for rnd in at:
                start, trained = local_models(checkpoints[rnd], list(range(args.clients)), args.seed, args.data)
                for layer, figures in alignment(start, trained, x).items():
                    rows.append({"pan": pan, "from_round": rnd, "layer": layer, **figures})
                    console.print(f"  from round {rnd:>3}  {layer:<14} vs global {figures['client_vs_global']:.3f}"
                                  f"  client pairs {figures['client_vs_client']:.3f}"
                                  f" (min {figures['client_vs_client_min']:.3f}); same-index correlation"
                                  f" vs global {figures['corr_vs_global']:.3f}, pairs {figures['corr_client_vs_client']:.3f}"
                                  f"; live {figures['live_fraction']:.2f}", highlight=False)
    table = Table(title=f"Fraction of hidden neurons matched to the same index ({args.clients} clients, "
                        f"5 local epochs, Dirichlet 0.1, cnn, seed {args.seed})")
    for name in ("PANs", "from round", "layer", "matched same index: vs global", "client pairs (mean)",
                 "client pairs (min)", "same-index corr: vs global", "client pairs", "live neurons"):
        table.add_column(name, justify="left" if name in ("PANs", "layer") else "right")
    for r in rows:
        table.add_row(r["pan"], str(r["from_round"]), r["layer"], f"{r['client_vs_global']:.3f}",
                      f"{r['client_vs_client']:.3f}", f"{r['client_vs_client_min']:.3f}", f"{r['corr_vs_global']:.3f}",
                      f"{r['corr_client_vs_client']:.3f}", f"{r['live_fraction']:.2f}")
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"setting": {"partition": PARTITION, "clients_in_all": CLIENTS_IN_ALL,
                                                "clients_measured": args.clients, "hyper": HYPER, "model": "cnn",
                                                "rounds": args.rounds, "at": at, "seed": args.seed,
                                                "batch": "the first 512 test images"},
                                    "seconds": time.monotonic() - started, "rows": rows}, indent=1) + "\n")
    console.print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
