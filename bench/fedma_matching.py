"""How long FedMA's matching of one layer takes on the coordinator, for vgg9's hidden layers.

FedMA matches every hidden layer across all clients at once, on the coordinator, and
the Hungarian solve per client grows with the cube of the layer's width, so this is
the step that decides whether FedMA is practical for a model and a client count.

Clients are stand-ins for trained ones: one shared random initialization of vgg9
(28x28x1 input, no normalization), and for each client every hidden layer's neurons
(incoming weights and bias) plus Gaussian noise of std ``--noise`` x the layer's
weight std, rows randomly permuted. Each layer is matched with the reference's
defaults (sigma = sigma0 = 1, gamma = 7), ``--sweeps`` sweeps and max_width twice the
layer's width. "recovered" is the share of the shared neurons that every client's
copy was assigned to one and the same global neuron.

A client count's layers are skipped when their estimated time (the previous client
count's time for the layer, scaled by the clients and by how far that scaling was
off on the layers already measured) would take the total past ``--budget`` seconds;
the JSON says which and why.

Prints a table and writes ``bench/results/fedma_matching.json``.

    nice -n 10 python bench/fedma_matching.py [--clients 10 50] [--sweeps 5] [--budget 600]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import scipy
import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from methods.fedma.matching import match_layer, neuron_vectors
from edge_client.registry import build_model

RESULTS = Path(__file__).resolve().parent / "results"
SPEC = {"name": "vgg9", "num_classes": 10, "in_channels": 1, "image_size": 28, "norm": "none"}


def hidden_layers() -> list[nn.Linear | nn.Conv2d]:
    torch.manual_seed(0)
    model = build_model(SPEC)
    return [m for m in model.features if isinstance(m, (nn.Linear, nn.Conv2d))]


def client_copies(layer: nn.Linear | nn.Conv2d, clients: int, noise: float,
                  seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Noisy, row-permuted copies of one layer's neurons, and each copy's permutation."""
    base = neuron_vectors(layer.weight, layer.bias).double()
    std = noise * layer.weight.detach().double().std().item()
    gen = torch.Generator().manual_seed(seed)
    perms = [torch.randperm(len(base), generator=gen) for _ in range(clients)]
    return [base[p] + std * torch.randn(base.shape, generator=gen, dtype=torch.float64) for p in perms], perms


def recovered(assignments: list[torch.Tensor], perms: list[torch.Tensor]) -> float:
    """Share of the shared neurons whose copies all went to one global neuron."""
    mapped = []
    for assignment, perm in zip(assignments, perms):
        out = torch.empty_like(assignment)
        out[perm] = assignment
        mapped.append(out)
    agree = torch.stack(mapped).eq(mapped[0]).all(dim=0)
    return agree.double().mean().item()


def measure(index: int, layer: nn.Linear | nn.Conv2d, clients: int, sweeps: int, noise: float) -> dict[str, Any]:
    width = layer.weight.shape[0]
    vectors, perms = client_copies(layer, clients, noise, seed=index)
    started = time.perf_counter()
    matching = match_layer(vectors, sweeps=sweeps, max_width=2 * width, seed=index)
    seconds = time.perf_counter() - started
    return {"layer": index, "kind": type(layer).__name__, "width": width, "d": vectors[0].shape[1],
            "clients": clients, "seconds": round(seconds, 3), "global_width": matching.width,
            "recovered": round(recovered(matching.assignments, perms), 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--sweeps", type=int, default=5)
    parser.add_argument("--noise", type=float, default=0.05, help="client noise std, times the layer's weight std")
    parser.add_argument("--budget", type=float, default=600.0, help="seconds allowed per client count")
    args = parser.parse_args(argv)

    layers = hidden_layers()
    console = Console()
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    previous: dict[int, dict[str, Any]] = {}
    for clients in sorted(args.clients):
        spent, scale_error = 0.0, 1.0
        current: dict[int, dict[str, Any]] = {}
        for index, layer in enumerate(layers, start=1):
            before = previous.get(index)
            estimate = None
            if before is not None:
                estimate = before["seconds"] * clients / before["clients"] * scale_error
                if spent + estimate > args.budget:
                    reason = (f"estimated {estimate:.0f} s (from {before['clients']} clients' "
                              f"{before['seconds']:.1f} s) would take this client count past the "
                              f"{args.budget:.0f} s budget")
                    skipped.append({"layer": index, "clients": clients, "reason": reason})
                    console.print(f"layer {index}, {clients} clients: skipped, {reason}")
                    continue
            row = measure(index, layer, clients, args.sweeps, args.noise)
            spent += row["seconds"]
            if estimate:
                scale_error = max(scale_error, row["seconds"] / (estimate / scale_error))
            console.print(f"layer {index}, {clients} clients: {row['seconds']:.1f} s, "
                          f"global width {row['global_width']}")
            rows.append(row)
            current[index] = row
        previous = current

    table = Table(title=f"FedMA matching, vgg9 hidden layers, {args.sweeps} sweeps, max_width 2x width")
    for column in ("layer", "kind", "width", "D", "clients", "seconds", "global width", "recovered"):
        table.add_column(column, justify="left" if column == "kind" else "right")
    for row in rows:
        table.add_row(str(row["layer"]), row["kind"], str(row["width"]), str(row["d"]), str(row["clients"]),
                      f"{row['seconds']:.2f}", str(row["global_width"]), f"{row['recovered']:.1%}")
    console.print(table)

    figures = {
        "machine": {"python": platform.python_version(), "arch": platform.machine(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "numpy": np.__version__, "scipy": scipy.__version__,
                    "load_average_1min_before": round(load_before[0], 2),
                    "load_average_1min_after": round(os.getloadavg()[0], 2),
                    "under_load": "taken while another benchmark ran on this 2-core machine, under nice -n 10: "
                                  "the times are upper bounds for a quiet machine"},
        "settings": {"model": SPEC, "sweeps": args.sweeps, "sigma": 1.0, "sigma0": 1.0, "gamma": 7.0,
                     "max_width": "2 x layer width", "noise": f"{args.noise} x layer weight std",
                     "clients": sorted(args.clients), "budget_seconds": args.budget},
        "rows": rows,
        "skipped": skipped,
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "fedma_matching.json"
    out.write_text(json.dumps(figures, indent=2) + "\n")
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
