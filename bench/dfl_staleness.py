"""Is DFL's personalized accuracy under partial participation held back by a stale device predictor?

Why: under the benchmark protocol 100 clients exist and 10 train per round, so a device's
specific extractor and predictor last learned about 10 rounds before an evaluation, against the
invariant extractor of that round. ``dfl_evaluate`` pairs them with the *current* global invariant
extractor, whose features have moved on since. If that mismatch is what keeps DFL below FedAvg
(docs/evidence/dfl.md, "Stale devices"), a device's accuracy falls with the rounds since it last trained,
and one pass of DFL's local stage against the current invariant extractor recovers it. If neither
holds, the predictor is not the cause and the verdict has to look elsewhere.

What it does: runs one cell of a matrix exactly as ``bench/run_matrix.py`` does (in-process clients),
keeping the run directory and its last checkpoint, or takes an existing run directory
(``--skip-run``). Then, for every client, it rebuilds the device's model as the in-process client
does (same data split, attribute transform and held-out split; the final global invariant extractor
through the run's download codec; the device's saved parts from ``RUN_DIR/clients/ID``) and measures
on the client's held-out split:

- ``as_served``: ``dfl_evaluate`` itself, i.e. what the run's last evaluation reported for it;
- ``refreshed``: after DFL's local stage once more (invariant frozen, specific extractor and
  predictor retrained one epoch on the client's training split with the run's hyperparameters,
  seeded as the client's next training task would be), on a copy of the model;
- the round it last trained (its ``dfl_state`` history lines) and the rounds since.

The refresh is also one more epoch of local training: its gain for the clients that trained in the
last round (0 rounds since) is that epoch's worth, and staleness shows as a larger gain, and a lower
``as_served``, the longer ago a client trained. Peer slots (``dfl.diversity``) are not filled for the
refresh: it measures the predictor alone.
The mean of ``as_served`` must equal the run's last ``personalized_accuracy_mean``
(``run_check`` in the output): that is the check that the reconstruction is faithful.

Prints the tables and writes ``RESULTS/dfl_staleness.json``.

    # the protocol cell (100 clients, 100 rounds, Fashion-MNIST; about 10 minutes on 2 cores)
    python bench/dfl_staleness.py --out runs/dfl-staleness-color5-s0
    # a quick check on digits (6 clients, 2 a round, 4 rounds)
    python bench/dfl_staleness.py --set data.eval=digits --set clients.expected=6 --set clients.per_round=2 \\
        --rounds 4 --results /tmp/dfl_stale_check --out /tmp/dfl_stale_run
    # measure a kept run again
    python bench/dfl_staleness.py --skip-run --out runs/dfl-staleness-color5-s0
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from run_matrix import RESULTS, Run, expand, load_matrix, run_config
from coordinator.config import ConfigError, RunConfig, load_config, parse_override
from coordinator.runtime.downlink import download_generator
from coordinator.strategy_setup import make_strategy
from coordinator.runtime.run import run_federated
from coordinator.ops.spawn import sim_client_id
from edge_client.data import arrange_clients, load_dataset
from methods.dfl.device import STATE_FILE, dfl_evaluate, refresh, stage_hyper
from edge_client.models import state_shapes
from edge_client.objectives import TaskContext, evaluate, holdout_seed, local_data_view, shuffle_seed
from edge_client.registry import build_model
from edge_client.wire.codec import parse_codec
from edge_client.wire.updates import decode_download, encode_download
from profiling.history import HISTORY_FILE
from profiling.profiler import Profiler
from storage.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
from storage.files import read_jsonl

BENCH = Path(__file__).resolve().parent
BUCKETS = ((0, 4, "0-4"), (5, 9, "5-9"), (10, 19, "10-19"), (20, None, "20+"))
NEVER = "never"


class StalenessError(RuntimeError):
    """The run directory cannot be measured; the message says why."""


def cell_run(matrix_path: Path, cell: str, seed: int, rounds: int | None, sets: list[str]) -> Run:
    """The matrix cell ``cell`` (its GROUP label, e.g. ``color5/dfl``) with ``seed``, plus ``--set`` overrides."""
    every = expand(load_matrix(matrix_path), [seed], rounds, [])
    runs = [r for r in every if r.group == cell]
    if not runs:
        groups = sorted({r.group for r in every})
        raise ConfigError(f"{matrix_path} has no cell {cell!r}; its cells: {', '.join(groups)}")
    return dataclasses.replace(runs[0], overrides=runs[0].overrides + tuple(parse_override(s) for s in sets))


def last_trained(state_dir: Path) -> int | None:
    """The last round the device ran ``dfl_train`` (its ``dfl_state`` history lines), None if never."""
    path = state_dir / HISTORY_FILE
    rounds = [r["round"] for r in read_jsonl(path) if r.get("kind") == "dfl_state"] if path.is_file() else []
    return max(rounds) if rounds else None


def measure_run(run_dir: Path, console: Console) -> tuple[RunConfig, int, list[dict[str, Any]]]:
    """Per client of the run in ``run_dir``: last trained round, rounds since, ``as_served`` and ``refreshed``."""
    if not (run_dir / "config.toml").is_file():
        raise StalenessError(f"{run_dir} has no config.toml: not a run directory")
    config = load_config(run_dir / "config.toml")
    if config.run.strategy != "dfl":
        raise StalenessError(f"{run_dir} ran {config.run.strategy!r}, not dfl: there is no device predictor")
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    if checkpoint is None:
        raise StalenessError(f"{run_dir} has no checkpoints/: give the --out of a finished run (or drop --skip-run)")
    state, _ = load_checkpoint(checkpoint)
    count = config.clients.spawn
    ids = [sim_client_id(i) for i in range(count)]
    if not any((run_dir / "clients" / cid / STATE_FILE).is_file() for cid in ids):
        raise StalenessError(f"{run_dir}/clients/ holds no device's {STATE_FILE}: not an in-process DFL run "
                             f"with {count} spawned clients")
    final = state.round
    strategy = make_strategy(config)
    fraction, seed = config.data.local_test_fraction, config.run.seed
    rows_by_client = arrange_clients(load_dataset(config.data.eval, train=True), config.data.partition, count, seed,
                                     fraction, [holdout_seed(seed, cid) for cid in ids])
    model = build_model(state.spec)
    codec = parse_codec(config.codec.down).dense()
    results = []
    for i, cid in enumerate(ids):
        data = local_data_view(rows_by_client, i, fraction)
        plan = strategy.configure_evaluate(final, state, [cid])[0]
        # as the client decodes what the coordinator sent
        wire = encode_download(plan.down, codec, generator=download_generator(seed, final))
        model.load_state_dict(decode_download(wire, codec, state_shapes(model)), strict=False)
        ctx = TaskContext(seed=shuffle_seed(seed, final + 1, cid), round=final, client_id=cid,
                          state_dir=run_dir / "clients" / cid, profiler=Profiler())
        served = dfl_evaluate(model, data, plan.hyper, ctx).metrics["local_accuracy"]
        # DFL's local stage once more, as the client's next training task would start it
        refreshed_model = copy.deepcopy(model)
        h, d = stage_hyper(strategy.configure_train(final + 1, state, [cid])[0].hyper)
        refresh(refreshed_model, data, h, d, d.local_epochs, ctx)
        _, refreshed = evaluate(refreshed_model, data.x_test, data.y_test)
        trained = last_trained(ctx.state_dir)
        results.append({"client": cid, "last_trained": trained,
                        "rounds_since": None if trained is None else final - trained,
                        "as_served": served, "refreshed": refreshed, "test_samples": data.num_test})
        console.print(f"  {cid}  last trained {trained if trained is not None else NEVER:>5}  "
                      f"as served {served:.4f}  refreshed {refreshed:.4f}", highlight=False)
    return config, final, results


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "min": None, "std": None, "clients": 0}
    return {"mean": statistics.fmean(values), "min": min(values), "std": statistics.pstdev(values),
            "clients": len(values)}


def bucket(rounds_since: int | None) -> str:
    """The rounds-since bucket a client falls in (``never``: it did not train)."""
    if rounds_since is None:
        return NEVER
    return next(label for low, high, label in BUCKETS if rounds_since >= low and (high is None or rounds_since <= high))


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean, min and spread of both accuracies; their means per rounds-since bucket; the correlation
    of ``as_served`` with the rounds since (over the clients that trained)."""
    buckets: dict[str, dict[str, Any]] = {}
    for label in [b[2] for b in BUCKETS] + [NEVER]:
        members = [r for r in results if bucket(r["rounds_since"]) == label]
        buckets[label] = {"clients": len(members),
                          **{k: statistics.fmean(r[k] for r in members) if members else None
                             for k in ("as_served", "refreshed")}}
    trained = [r for r in results if r["rounds_since"] is not None]
    try:
        pearson = statistics.correlation([float(r["rounds_since"]) for r in trained],
                                         [r["as_served"] for r in trained])
    except statistics.StatisticsError:   # fewer than two clients, or one value of either
        pearson = None
    return {"as_served": _stats([r["as_served"] for r in results]),
            "refreshed": _stats([r["refreshed"] for r in results]),
            "by_rounds_since": buckets, "pearson_as_served_vs_rounds_since": pearson,
            "never_trained": len(results) - len(trained)}


def run_check(run_dir: Path, mean_as_served: float | None) -> dict[str, Any]:
    """The run's last evaluated ``personalized_accuracy_mean`` beside the reconstruction's mean."""
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "personalized_accuracy_mean" in r]
    if not rows or mean_as_served is None:
        return {"round": None, "personalized_accuracy_mean": None, "difference": None}
    last = rows[-1]
    return {"round": last["round"], "personalized_accuracy_mean": last["personalized_accuracy_mean"],
            "personalized_clients": last.get("personalized_clients"),
            "difference": mean_as_served - last["personalized_accuracy_mean"]}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def print_tables(record: dict[str, Any], console: Console) -> None:
    clients = Table(title=f"DFL staleness: {record['cell']} seed {record['seed']}, round {record['rounds']}")
    for name in ("client", "last trained", "rounds since", "as served", "refreshed"):
        clients.add_column(name, justify="left" if name == "client" else "right")
    for r in record["clients"]:
        clients.add_row(r["client"], str(r["last_trained"] if r["last_trained"] is not None else NEVER),
                        str(r["rounds_since"] if r["rounds_since"] is not None else NEVER),
                        _fmt(r["as_served"]), _fmt(r["refreshed"]))
    console.print(clients)
    s = record["summary"]
    summary = Table(title="over clients (accuracy, %)")
    for name in ("", "clients", "as served", "refreshed"):
        summary.add_column(name, justify="left" if not name else "right")
    for key in ("mean", "min", "std"):
        summary.add_row(key, str(s["as_served"]["clients"]), _fmt(s["as_served"][key]), _fmt(s["refreshed"][key]))
    for label, b in s["by_rounds_since"].items():
        summary.add_row(f"mean, {label} rounds since" if label != NEVER else "mean, never trained",
                        str(b["clients"]), _fmt(b["as_served"]), _fmt(b["refreshed"]))
    console.print(summary)
    pearson = s["pearson_as_served_vs_rounds_since"]
    check = record["run_check"]
    difference = "-" if check["difference"] is None else f"{check['difference']:.2e}"
    console.print(f"Pearson r(as served, rounds since): {'-' if pearson is None else f'{pearson:.3f}'}", highlight=False)
    console.print(f"the run's personalized_accuracy_mean at round {check['round']}: "
                  f"{_fmt(check['personalized_accuracy_mean'])}; as served here: {_fmt(s['as_served']['mean'])} "
                  f"(difference {difference})",
                  highlight=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run one DFL cell of a matrix (or take a kept run) and measure, per client, the personalized "
                    "accuracy as served and after one more local stage, against the rounds since it last trained.")
    parser.add_argument("--matrix", type=Path, default=BENCH / "matrices" / "dfl.toml", help="matrix file (default: bench/matrices/dfl.toml)")
    parser.add_argument("--cell", default="color5/dfl", help="the cell's GROUP label, its axis labels joined by / (default: color5/dfl)")
    parser.add_argument("--seed", type=int, default=0, help="run seed (default: 0)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default: the matrix's)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="extra config override after the matrix's, e.g. data.eval=digits (repeatable)")
    parser.add_argument("--out", type=Path, default=None,
                        help="run directory, kept (default: a new temporary directory, printed)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where dfl_staleness.json goes (default: bench/results)")
    parser.add_argument("--skip-run", action="store_true",
                        help="do not train: measure the existing run directory given with --out")
    args = parser.parse_args(argv)
    console = Console()
    try:
        run = cell_run(args.matrix, args.cell, args.seed, args.rounds, args.set)
        if args.skip_run:
            if args.out is None:
                raise StalenessError("--skip-run measures an existing run: give its directory with --out")
            if not args.out.is_dir():
                raise StalenessError(f"{args.out} is not a directory")
        else:
            out = args.out or Path(tempfile.mkdtemp(prefix="fedge-dfl-staleness-")) / "run"
            config = run_config(run, out)
            if config.run.strategy != "dfl":
                raise StalenessError(f"cell {args.cell} runs {config.run.strategy!r}, not dfl")
            console.print(f"running {run.group} seed {run.seed}, {run.rounds} rounds, into {out}", highlight=False)
            run_federated(config, say=lambda s: None,
                          on_round=lambda row: console.print(f"  round {row['round']:>3}  personalized "
                                                             f"{_fmt(row.get('personalized_accuracy_mean'))}",
                                                             highlight=False))
            args.out = out
        config, final, clients = measure_run(args.out, console)
    except (ConfigError, CheckpointError, StalenessError) as exc:
        console.print(f"[red]{exc}[/red]", soft_wrap=True)
        return 2
    summary = summarize(clients)
    record = {"matrix": str(args.matrix), "cell": args.cell, "seed": config.run.seed, "rounds": final,
              "skip_run": args.skip_run, "set": list(args.set),
              "overrides": [[s, k, v] for s, k, v in run.overrides], "run_dir": str(args.out.resolve()),
              "strategy_settings": dataclasses.asdict(config.dfl), "train": dataclasses.asdict(config.train),
              "summary": summary, "run_check": run_check(args.out, summary["as_served"]["mean"]),
              "clients": clients}
    print_tables(record, console)
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / "dfl_staleness.json"
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    console.print(f"wrote {path}; run directory {args.out}", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
