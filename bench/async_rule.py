"""Async mode's two aggregation rules side by side: FedBuff as published against the normalized rule.

``async.weighting = "fedbuff"`` (the default) divides the sum of the staleness-discounted deltas by
the buffer's K, every result counting equally; ``"normalized"`` (async mode's rule before it) takes
the sample-weighted mean over the total weight, where the discount cancels among equally stale
results. This runs both on the same seeds, in-process (clients as threads, as ``--transport inproc``
does), and reports each run's final accuracy, the mean of its last 3 evaluations, the staleness
its versions applied, and the per-seed paired difference of fedbuff to every other arm with its
95 % t-interval (bench/paired.py). Everything else is the defaults: server_lr 1, staleness exponent
0.5, no staleness limit.

Two control arms say where a difference comes from. FedBuff's discount shortens every step (by
about 0.6 when most results are 2 versions stale), and its equal weights change which results
lead: ``normalized@0.6`` is the normalized rule at ``server_lr`` 0.6 (FedBuff's step length, sample
weights), ``fedbuff@1.6`` FedBuff's rule at ``server_lr`` 1.6 (the normalized rule's step length,
equal weights). An arm is ``RULE`` or ``RULE@SERVER_LR``.

The setting is small on purpose (a 2-core machine, under 25 minutes for both rules and 3 seeds):
scikit-learn's digits, 16 clients on Dirichlet(0.5) label partitions (their sample counts differ,
which is where the rules' weights differ), 8 training at once, K = 4 (the default, half the
concurrency), the ``cnn``, 80 versions, an evaluation every version. Devices are equally fast here:
a result's staleness comes from the concurrency (about concurrency / K - 1 versions) and from the
larger partitions training longer. Results: bench/results/async_rule.json.

    nice -n 10 .venv/bin/python bench/async_rule.py                 # runs, prints, writes the JSON
    .venv/bin/python bench/async_rule.py --table                    # prints the JSON written before
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_io import RESULTS, write_result  # noqa: E402
from paired import paired  # noqa: E402

from coordinator.config import load_config  # noqa: E402
from coordinator.runtime.run import run_federated  # noqa: E402

ARMS = ("fedbuff", "normalized", "normalized@0.6", "fedbuff@1.6")
PATH = RESULTS / "async_rule.json"


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration every run shares (its seed and rule aside), as ``section.key`` -> value."""
    return {"run.mode": "async", "run.rounds": args.versions, "model.name": args.model, "data.eval": args.data,
            "data.partition": args.partition, "clients.expected": args.clients, "clients.spawn": args.clients,
            "transport.kind": "inproc", "async.concurrency": args.concurrency, "async.buffer_size": args.buffer_size,
            "eval.every": 1, "export.enabled": False, "clients.presence_timeout": 120.0}


def one_run(shared: dict[str, Any], arm: str, seed: int, out: Path) -> dict[str, Any]:
    """One run of ``arm`` (``RULE`` or ``RULE@SERVER_LR``) on ``seed``: its accuracies and the staleness its
    versions applied."""
    rule, _, server_lr = arm.partition("@")
    sets = {**shared, "async.weighting": rule, "async.server_lr": float(server_lr or 1.0), "run.seed": seed,
            "run.out": str(out)}
    config = load_config(None, [(*key.split(".", 1), value) for key, value in sets.items()])
    started = time.monotonic()
    run_federated(config, say=lambda s: None)
    seconds = time.monotonic() - started
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["test_accuracy"] for r in rows if r.get("test_accuracy") is not None]
    staleness: dict[str, int] = {}
    for row in rows[1:]:
        for s, n in row.get("staleness", {}).items():
            staleness[s] = staleness.get(s, 0) + n
    return {"rule": arm, "seed": seed, "final_accuracy": accuracy[-1],
            "last3_accuracy": statistics.fmean(accuracy[-3:]), "accuracy": accuracy, "versions": rows[-1]["round"],
            "results_per_version": sorted({r["results"] for r in rows[1:]}),
            "staleness": dict(sorted(staleness.items(), key=lambda kv: int(kv[0]))), "seconds": round(seconds, 1)}


def compare(runs: list[dict[str, Any]], key: str, arm: str, other: str) -> dict[str, Any]:
    """The per-seed difference ``arm`` - ``other`` of ``key``, paired."""
    by = {(r["rule"], r["seed"]): r[key] for r in runs}
    seeds = sorted({r["seed"] for r in runs if (arm, r["seed"]) in by and (other, r["seed"]) in by})
    return paired([by[arm, s] - by[other, s] for s in seeds], seeds).as_dict()


def show(record: dict[str, Any]) -> None:
    print(f"async rule comparison ({record['command']})")
    print(f"{'arm':<16}{'seed':>5}{'final':>9}{'last 3':>9}{'seconds':>9}  staleness applied")
    for r in record["runs"]:
        print(f"{r['rule']:<16}{r['seed']:>5}{r['final_accuracy']:>9.4f}{r['last3_accuracy']:>9.4f}"
              f"{r['seconds']:>9.0f}  {r['staleness']}")
    for name, p in record["paired"].items():
        interval = "" if p["interval"] is None else f" [{p['interval'][0]:+.4f}, {p['interval'][1]:+.4f}]"
        print(f"{name}: mean {p['mean']:+.4f}{interval} over seeds {p['seeds']} "
              f"(per seed {', '.join(f'{d:+.4f}' for d in p['per_seed'])})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), help="RULE or RULE@SERVER_LR; the first is "
                        "compared with every other (default: %(default)s)")
    parser.add_argument("--versions", type=int, default=80)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--buffer-size", type=int, default=4)
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--data", default="digits")
    parser.add_argument("--partition", default="dirichlet:0.5")
    parser.add_argument("--table", action="store_true", help=f"print {PATH.name} as written, run nothing")
    args = parser.parse_args(argv)
    if args.table:
        if not PATH.is_file():
            print(f"{PATH} does not exist yet: run bench/async_rule.py without --table first", file=sys.stderr)
            return 2
        show(json.loads(PATH.read_text()))
        return 0
    shared, runs = settings(args), []
    with tempfile.TemporaryDirectory(prefix="fedge-async-rule-") as tmp:
        for seed in args.seeds:
            for arm in args.arms:
                runs.append(one_run(shared, arm, seed, Path(tmp) / f"{arm}-s{seed}"))
                r = runs[-1]
                print(f"  {arm} seed {seed}: final {r['final_accuracy']:.4f}, last 3 {r['last3_accuracy']:.4f}, "
                      f"{r['seconds']:.0f} s", flush=True)
    first = args.arms[0]
    record = {"command": " ".join(["python bench/async_rule.py", *(argv if argv is not None else sys.argv[1:])]),
              "settings": shared, "seeds": args.seeds, "arms": args.arms, "runs": runs,
              "paired": {f"{first} - {other}, {key}": compare(runs, key, first, other)
                         for other in args.arms[1:] for key in ("final_accuracy", "last3_accuracy")}}
    show(record)
    write_result(PATH, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
