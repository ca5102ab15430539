"""Accuracy benchmark harness: a matrix of runs (options x seeds) through the in-process transport.

A matrix file (``bench/matrices/NAME.toml``) holds a ``[base]`` configuration with
the sections of a run config, ``[[axes.AXIS]]`` entries (each a ``label`` plus
the config keys it sets, in the same sections) and ``seeds``. Every combination of
one entry per axis and one seed is a run, e.g. ``a0.1/cnn/mul`` with seed 1:

    seeds = [0, 1]
    [base.run]
    rounds = 30
    [[axes.pan]]
    label = "mul"
    model.pan = "mul"

An entry may declare ``seeds = [0]`` (with ``off_protocol`` saying why): its cells run only those of
the matrix's seeds, a declared cut of the compute budget, and a complete matrix is then one
without them (``subset: false``). ``--seeds`` runs the given seeds in every cell instead.

Each run goes through ``coordinator.runtime.run.run_federated`` with clients as threads
(``transport.kind = "inproc"``) and results folded in client-id order (``aggregate.order = "sorted"``:
the same bits whatever ran alongside), and writes ``bench/results/NAME/LABELS-sSEED-rROUNDS.json``
(configuration, per-round metrics, summary, the final model's hash, and the commit, torch and numpy, the
CPU and the instruction set it ran with: ``bench/reproduce.py FILE`` runs it again and compares). A run cut
short by a stop goes on from its last round when the matrix runs again (``bench/unfinished.py``). The
table, printed and written to ``bench/results/NAME.json``, is built from every run file of the matrix present:
final accuracy = mean test accuracy of the last 5 evaluated rounds (``eval.every``), mean and spread (population
standard deviation) over seeds, bytes down and up per round, seconds per run, and
the mean weight divergence over the same rounds when ``run.diagnostics`` is on.
With personalized evaluation (``eval.personalized``, or a strategy such as DFL whose
result it is) the table adds the personalized accuracy (mean over clients, and the
worst client, over the same rounds) and the upload bytes per client per round.
Later methods add their axes or matrices here rather than writing new loops.

A cell gives the same bits again only on the same instruction set: torch's kernels on an AVX-512 CPU add
in another order than on an AVX2 one. ``isa = "avx2"`` at the top of a matrix file (or ``--isa avx2``)
pins ATen, oneDNN and MKL to that set (``bench/isa.py``), so that an AVX-512 CPU runs the kernels an
AVX2-only one runs; the harness then starts itself again with the pin's environment variables, which torch
reads only when it loads. The run file records the pin (``isa``) beside the CPU.

    python bench/run_matrix.py bench/matrices/pans.toml [--rounds N] [--seeds 0,1]
        [--only SUBSTRING ...] [--dry-run] [--report] [--isa avx2|avx512|native]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

import isa
from benchmark_protocol import Protocol, deviations, load_protocol, rounds_to_reach
from provenance import library_versions, machine, source_state
from coordinator.config import ConfigError, RunConfig, load_config
from coordinator.ui.report import human_bytes
from coordinator.runtime.run import RunInterrupted, run_federated
from coordinator.runtime.run_error import RunError
from coordinator.strategies.base import Strategy
from storage.checkpoint import latest_checkpoint, load_checkpoint, params_digest
from storage.files import read_jsonl
from unfinished import UNFINISHED, StartedElsewhere, Unfinished

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

RESULTS = Path(__file__).resolve().parent / "results"
LAST_ROUNDS = 5   # final accuracy = mean over this many last evaluated rounds


@dataclass(frozen=True)
class Run:
    """One cell of the matrix with one seed."""

    labels: tuple[str, ...]
    seed: int
    rounds: int
    overrides: tuple[tuple[str, str, Any], ...]
    off_protocol: str = ""        # why this cell departs from the benchmark protocol on purpose
    cell_seeds: tuple[int, ...] = ()   # every seed its cell runs (the protocol checks how many)

    @property
    def group(self) -> str:
        return "/".join(self.labels)

    @property
    def file_name(self) -> str:
        return f"{'-'.join(self.labels)}-s{self.seed}-r{self.rounds}.json"


@dataclass(frozen=True)
class Matrix:
    name: str
    path: Path
    base: dict[str, Any]
    axes: dict[str, list[dict[str, Any]]]
    seeds: list[int]
    baseline: tuple[str, str] | None = None   # (axis, label) of the method the others are measured against
    isa: str | None = None   # the instruction set its cells run under (bench/isa.py's PINS), None: the CPU's own

    @property
    def full_rounds(self) -> int:
        return int(self.base.get("run", {}).get("rounds", 5))


def _flatten(partial: dict[str, Any], where: str) -> list[tuple[str, str, Any]]:
    """``{"model": {"pan": "mul"}}`` -> ``[("model", "pan", "mul")]``."""
    out = []
    for section, values in partial.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{where}: {section!r} must be a section table such as model.pan = ..., "
                              f"got {values!r}")
        out += [(section, key, value) for key, value in values.items()]
    return out


def load_matrix(path: Path) -> Matrix:
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read matrix {path}: {exc}") from None
    axes = raw.get("axes", {})
    for axis, entries in axes.items():
        if not isinstance(entries, list) or not all(isinstance(e, dict) and "label" in e for e in entries):
            raise ConfigError(f"{path}: axes.{axis} must be an array of tables, each with a label ([[axes.{axis}]])")
    for axis, entries in axes.items():
        for e in entries:
            if "seeds" in e and (not isinstance(e["seeds"], list) or not e["seeds"]
                                 or not all(isinstance(x, int) for x in e["seeds"])):
                raise ConfigError(f"{path}: axes.{axis} {e['label']!r}: seeds must be a non-empty list of integers, "
                                  f"got {e['seeds']!r}")
            for other, labels in _conditions(str(e.get("only_with", ""))):
                known = [str(x["label"]) for x in axes.get(other, [])]
                if other == axis or not all(label in known for label in labels):
                    raise ConfigError(f"{path}: axes.{axis} {e['label']!r}: only_with must be AXIS=LABEL of another "
                                      f"axis (LABEL|LABEL for either; several conditions separated by commas), "
                                      f"got {e['only_with']!r}")
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not all(isinstance(s, int) for s in seeds):
        raise ConfigError(f"{path}: seeds must be a list of integers")
    baseline = raw.get("baseline")
    if baseline is not None:
        axis, _, label = str(baseline).partition("=")
        if axis not in axes or label not in [str(e["label"]) for e in axes[axis]]:
            raise ConfigError(f"{path}: baseline must be AXIS=LABEL of one of its axes, got {baseline!r}")
        baseline = (axis, label)
    pin = raw.get("isa")
    if pin is not None and pin not in isa.PINS:
        raise ConfigError(f"{path}: isa must be one of {', '.join(map(repr, isa.PINS))} (the instruction set its "
                          f"cells are pinned to), got {pin!r}; leave it out to run on the CPU's own")
    return Matrix(str(raw.get("name", path.stem)), path, raw.get("base", {}), axes, seeds, baseline, pin)


_ENTRY_KEYS = ("label", "off_protocol", "only_with", "seeds")


def _conditions(only_with: str) -> list[tuple[str, list[str]]]:
    """``"alpha=a0.1, model=cnn|vgg9"`` -> ``[("alpha", ["a0.1"]), ("model", ["cnn", "vgg9"])]``."""
    return [(axis, labels.split("|")) for axis, _, labels
            in (c.strip().partition("=") for c in only_with.split(",") if c.strip())]


def _fits(combo: tuple[tuple[str, dict[str, Any], str, str], ...], axes: list[str]) -> bool:
    """Whether every entry's ``only_with = "AXIS=LABEL[|LABEL][, AXIS=LABEL]"`` holds in this combination."""
    chosen = dict(zip(axes, (label for label, *_ in combo)))
    return all(chosen.get(axis) in labels for *_, only_with in combo for axis, labels in _conditions(only_with))


def expand(matrix: Matrix, seeds: list[int] | None, rounds: int | None, only: list[str]) -> list[Run]:
    """Every combination of one entry per axis and one seed, in file order.

    An entry with ``only_with = "AXIS=LABEL"`` joins only the combinations with that
    label on that axis (e.g. a layer choice that exists for one model only; ``AXIS=A|B`` for
    either label; several conditions, separated by commas, must all hold). An entry's
    own ``run.rounds`` replaces the base's (FedMA counts phases), unless ``rounds`` is given.
    With ``seeds`` None, each cell runs the matrix's seeds, fewer where an entry declares its own
    ``seeds`` (a cut of the compute budget, e.g. the deep model's one seed); given seeds apply to every cell.
    """
    runs = []
    axes = list(matrix.axes)
    choices = [[(e["label"], {k: v for k, v in e.items() if k not in _ENTRY_KEYS},
                 str(e.get("off_protocol", "")), str(e.get("only_with", ""))) for e in entries]
               for entries in matrix.axes.values()]
    declared = [[e.get("seeds") for e in entries] for entries in matrix.axes.values()]
    for combo, cuts in zip(itertools.product(*choices), itertools.product(*declared)):
        if not _fits(combo, axes):
            continue
        cell_seeds = seeds if seeds is not None else [s for s in matrix.seeds
                                                       if all(cut is None or s in cut for cut in cuts)]
        labels = tuple(str(label) for label, *_ in combo)
        overrides = _flatten(matrix.base, "base")
        for (label, partial, _, _), axis in zip(combo, matrix.axes):
            overrides += _flatten(partial, f"axes.{axis} {label!r}")
        why = "; ".join(reason for _, _, reason, _ in combo if reason)
        own = [partial["run"]["rounds"] for _, partial, _, _ in combo if "rounds" in partial.get("run", {})]
        r = rounds if rounds is not None else int(own[-1]) if own else matrix.full_rounds
        for seed in cell_seeds:
            run = Run(labels, seed, r, tuple(overrides), why, tuple(cell_seeds))
            if not only or any(s in f"{run.group}/s{seed}" for s in only):
                runs.append(run)
    return runs


def run_config(run: Run, out: Path) -> RunConfig:
    """The configuration one cell runs with: the matrix's keys, its seed and rounds, clients as threads,
    results folded in client-id order (``aggregate.order``: the same bits whatever ran alongside)."""
    overrides = [*run.overrides, ("run", "seed", run.seed), ("run", "rounds", run.rounds),
                 *scratch_overrides(out), ("aggregate", "order", "sorted")]
    clients = load_config(None, overrides).clients
    return load_config(None, overrides + [("clients", "spawn", clients.spawn or clients.expected),
                                          ("transport", "kind", "inproc")])


def scratch_overrides(out: Path) -> list[tuple[str, str, Any]]:
    """A cell's run directory is scratch, deleted once its run file is written: only the last
    checkpoint (the final model's hash), and nothing to export into."""
    return [("run", "out", str(out)), ("checkpoint", "keep", "last"), ("export", "enabled", False)]


def protocol_check(runs: list[Run], protocol: Protocol) -> list[list[str]]:
    """Each run's departures from the benchmark protocol ([] for a run that follows it), its cell's seeds
    included; building each run's configuration also refuses a bad key before hours of running."""
    return [deviations(run_config(run, Path("unused")), protocol, list(run.cell_seeds)) for run in runs]


def refuse_departures(runs: list[Run], departures: list[list[str]], console: Console) -> bool:
    """Print the cells that depart from the protocol without saying why; True if there are any."""
    unexplained: dict[str, list[str]] = {}
    for run, found in zip(runs, departures):
        if found and not run.off_protocol:
            unexplained.setdefault(run.group, found)
    for group, found in unexplained.items():
        console.print(f"[red]{group} departs from the benchmark protocol: {'; '.join(found)}[/red]", soft_wrap=True)
    if unexplained:
        console.print("Follow bench/protocol.toml (docs/benchmarks.md), give the cell off_protocol = \"why\" in the "
                      "matrix, or pass --off-protocol for a trial run; run files record the departures.",
                      soft_wrap=True)
    return bool(unexplained)


def progress_printer(console: Console, label: str) -> Callable[[dict[str, Any]], None]:
    """A round's row as one line on ``console``, under ``label``."""

    def progress(row: dict[str, Any]) -> None:
        div, personal = row.get("weight_divergence_mean"), row.get("personalized_accuracy_mean")
        console.print(f"  {label} round {row['round']:>3}  acc {_fmt(row.get('test_accuracy'))}  "
                      f"{row.get('seconds', 0.0):6.1f} s" + (f"  div {div:.4f}" if div is not None else "")
                      + (f"  personal {personal:.4f}" if personal is not None else ""), highlight=False)

    return progress


def execute(config: RunConfig, on_round: Callable[[dict[str, Any]], None], *,
            strategy: Strategy | None = None, resume: bool = False,
            source: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run ``config`` (its ``run.out`` a scratch directory) and return what a run file keeps of it: the
    resolved configuration, seconds, rows, summary, the final model's hash, the commit and library versions,
    the machine and CPU (``bench/provenance.py``) and the instruction-set pin it ran with (``isa``, None for
    none: ``bench/isa.py``), so that ``bench/reproduce.py`` can run it again and compare. ``on_round`` gets
    each row as it completes; ``strategy``: one to use instead of the configured; ``resume``: go on from the last checkpoint in ``run.out``, whose run started at ``source``."""
    source = source or source_state()   # before the run: the code that runs is the code the run file names
    started = time.monotonic()
    try:
        result = run_federated(config, resume=resume, say=lambda s: None, on_round=on_round, strategy=strategy)
    except RunError as exc:   # a run that cannot go on (every device's training diverged) is a result too
        return failed_record(config, str(exc), time.monotonic() - started, source)
    seconds = time.monotonic() - started
    out = result.out_dir
    final = latest_checkpoint(out / "checkpoints")
    record = {"config": tomllib.loads((out / "config.toml").read_text()), "seconds": seconds,
              "rows": read_jsonl(out / "metrics.jsonl"), "summary": result.summary,
              "model_hash": params_digest(load_checkpoint(final)[0].params) if final is not None else None,
              "source": source, "versions": library_versions(), "machine": machine(), "isa": isa.held()}
    record["config"]["run"]["out"] = ""   # the scratch directory is gone
    return record


def failed_record(config: RunConfig, failure: str, seconds: float, source: dict[str, Any]) -> dict[str, Any]:
    """What a run file keeps of a run that stopped with a RunError: its rows up to there and why. Its final
    figure is no figure (``summarize`` counts it under ``failed``, not in the means)."""
    out = Path(config.run.out)
    conf = out / "config.toml"
    record = {"config": tomllib.loads(conf.read_text()) if conf.exists() else {}, "seconds": seconds,
              "rows": read_jsonl(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else [],
              "summary": None, "model_hash": None, "failure": failure, "source": source,
              "versions": library_versions(), "machine": machine(), "isa": isa.held()}
    if record["config"].get("run"):
        record["config"]["run"]["out"] = ""
    return record


def run_one(run: Run, out_dir: Path, console: Console, departures: list[str], protocol: Protocol, *,
            restart: bool = False) -> dict[str, Any]:
    """Run one cell and keep its configuration, metrics, summary, final model hash and provenance in
    ``OUT_DIR/LABELS-sSEED-rROUNDS.json``. It runs in ``OUT_DIR/.unfinished/`` and goes on from there if a
    stop cut an earlier try short (``bench/unfinished.py``); the file then says after which rounds.
    Raises StartedElsewhere for such a run begun at other code, unless ``restart`` (then it starts over)."""
    work = Unfinished(out_dir / UNFINISHED / Path(run.file_name).stem)
    config = run_config(run, work.run_dir)
    said = work.begin(source_state(), restart=restart)
    if said:
        console.print(f"  {said}", highlight=False)
    progress = progress_printer(console, f"{run.group} s{run.seed}")

    def on_round(row: dict[str, Any]) -> None:
        progress(row)
        work.tick()

    ran = execute(config, on_round, resume=work.resuming, source=work.progress["source"])
    ran["seconds"] = work.seconds()
    if work.resuming:
        ran["resumed_after"] = work.progress["resumed_after"]
    record = {"matrix": out_dir.name, "group": run.group, "labels": list(run.labels), "seed": run.seed,
              "rounds": run.rounds, "protocol": protocol.name, "departures": departures,
              "off_protocol": run.off_protocol, **ran}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / run.file_name).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    work.finish()
    return record


def final_mean(rows: list[dict[str, Any]], key: str) -> float | None:
    """Mean of ``key`` over the last LAST_ROUNDS trained rounds that have it: rows of rounds without
    an evaluation (``eval.every``) have none."""
    trained = [r[key] for r in rows if r["round"] > 0 and r.get(key) is not None]
    tail = trained[-LAST_ROUNDS:]
    return sum(tail) / len(tail) if tail else None


def _spread(values: list[float]) -> float | None:
    return statistics.pstdev(values) if len(values) > 1 else None   # one seed has no spread


def _fmt(value: float | None, scale: float = 1.0, digits: int = 4) -> str:
    """A number, or "-" where a run has none (DFL has no global test accuracy)."""
    return "-" if value is None else f"{scale * value:.{digits}f}"


def _mean(values: list[float | None]) -> float | None:
    return statistics.fmean(values) if values and all(v is not None for v in values) else None  # type: ignore


def _personalized(recs: list[dict[str, Any]], trained: list[dict[str, Any]]) -> dict[str, Any]:
    """Personalized accuracy (each client's model on its own held-out split; last rounds, over seeds)
    and upload bytes per client per round, when the runs report them."""
    finals = [final_mean(r["rows"], "personalized_accuracy_mean") for r in recs]
    if any(f is None for f in finals):
        return {}
    up = [row["bytes_up_per_client"] for row in trained if "bytes_up_per_client" in row]
    return {"personalized_accuracy_mean": statistics.fmean(finals), "personalized_accuracy_spread": _spread(finals),
            "personalized_accuracy_per_seed": finals,
            "personalized_accuracy_min_mean": _mean([final_mean(r["rows"], "personalized_accuracy_min") for r in recs]),
            # the spread over clients (each run's std over its clients, then the mean over seeds)
            "personalized_accuracy_client_std_mean": _mean([final_mean(r["rows"], "personalized_accuracy_std")
                                                            for r in recs]),
            "bytes_up_per_client_per_round": statistics.fmean(up) if up else None}


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One table row per (cell, rounds): figures averaged over the seeds present."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for rec in records:
        groups.setdefault((rec["group"], rec["rounds"]), []).append(rec)
    table = []
    for (group, rounds), recs in groups.items():
        recs.sort(key=lambda r: r["seed"])
        finals = [None if r.get("failure") else final_mean(r["rows"], "test_accuracy") for r in recs]
        divs = [d for d in (final_mean(r["rows"], "weight_divergence_mean") for r in recs) if d is not None]
        trained = [row for r in recs for row in r["rows"] if row["round"] > 0]
        tested = [f for f in finals if f is not None]
        table.append({
            "group": group, "rounds": rounds, "seeds": [r["seed"] for r in recs],
            "final_accuracy_mean": _mean(finals), "final_accuracy_spread": _spread(tested) if tested else None,
            "final_accuracy_per_seed": finals,
            "failed": {r["seed"]: r["failure"] for r in recs if r.get("failure")},
            "best_accuracy_mean": _mean([max((row["test_accuracy"] for row in r["rows"]
                                              if row.get("test_accuracy") is not None), default=None) for r in recs]),
            "bytes_down_per_round": _mean([row["bytes_down"] for row in trained]),
            "bytes_up_per_round": _mean([row["bytes_up"] for row in trained]),
            # how many times smaller than the whole float32 model from every client (absent in older runs)
            "up_times_smaller": (statistics.fmean(row["fp32_bytes_up"] for row in trained)
                                 / statistics.fmean(row["bytes_up"] for row in trained)
                                 if trained and all("fp32_bytes_up" in row for row in trained) else None),
            "seconds_per_run": statistics.fmean(r["seconds"] for r in recs),
            "seconds_per_round": _mean([row["seconds"] for row in trained]),
            "weight_divergence_mean": statistics.fmean(divs) if divs else None,
            **_personalized(recs, trained),
        })
    return table


def add_rounds_to_baseline(table: list[dict[str, Any]], records: list[dict[str, Any]], matrix: Matrix) -> None:
    """Per seed, the first round each cell reached its baseline's final accuracy: the baseline is the
    cell with the same labels but the matrix's ``baseline`` on its axis (e.g. FedAvg's row). Where both
    report personalized accuracy, also the first round each reached the baseline's final personalized mean."""
    if matrix.baseline is None:
        return
    axis, label = matrix.baseline
    position = list(matrix.axes).index(axis)
    finals = {(row["group"], row["rounds"]): row for row in table}
    for row in table:
        labels = row["group"].split("/")
        base = "/".join([*labels[:position], label, *labels[position + 1:]])
        target = finals.get((base, row["rounds"]), {})
        runs = [rec for rec in records if rec["group"] == row["group"] and rec["rounds"] == row["rounds"]]
        row["baseline"] = base
        row["rounds_to_baseline_final"] = [rounds_to_reach(rec["rows"], target.get("final_accuracy_mean"))
                                           for rec in runs]
        if "personalized_accuracy_mean" in row and "personalized_accuracy_mean" in target:
            row["rounds_to_baseline_personalized"] = [
                rounds_to_reach(rec["rows"], target["personalized_accuracy_mean"], "personalized_accuracy_mean")
                for rec in runs]


def _rounds(per_seed: list[int | None]) -> str:
    return ",".join("-" if n is None else str(n) for n in per_seed)


def print_table(console: Console, title: str, rows: list[dict[str, Any]]) -> None:
    table = Table(title=title)
    personal = any("personalized_accuracy_mean" in r for r in rows)
    extra = ((f"personal acc (last {LAST_ROUNDS})", "personal min", "personal std (clients)", "up/client/round",
              "rounds to baseline (personal)") if personal else ())
    baseline = any("rounds_to_baseline_final" in r for r in rows)
    extra += ("rounds to baseline",) if baseline else ()
    for name in ("run", "rounds", "seeds", f"final acc (last {LAST_ROUNDS})", "best acc", *extra, "down/round",
                 "up/round", "up vs fp32", "s/run", "weight div"):
        table.add_column(name, justify="left" if name == "run" else "right")
    for r in rows:
        div = r["weight_divergence_mean"]
        cells = []
        if personal:
            up = r.get("bytes_up_per_client_per_round")
            cells = [f"{_fmt(r.get('personalized_accuracy_mean'), 100, 2)} ± "
                     f"{_fmt(r.get('personalized_accuracy_spread'), 100, 2)}",
                     _fmt(r.get("personalized_accuracy_min_mean"), 100, 2),
                     _fmt(r.get("personalized_accuracy_client_std_mean"), 100, 2),
                     "-" if up is None else human_bytes(up), _rounds(r.get("rounds_to_baseline_personalized", []))]
        if baseline:
            cells.append(_rounds(r.get("rounds_to_baseline_final", [])))
        final, spread = _fmt(r["final_accuracy_mean"], 100, 2), r["final_accuracy_spread"]
        if r["failed"]:
            final = f"{final} ({len(r['failed'])} failed)"
        table.add_row(r["group"], str(r["rounds"]), ",".join(map(str, r["seeds"])),
                      final if spread is None else f"{final} ± {_fmt(spread, 100, 2)}",
                      _fmt(r["best_accuracy_mean"], 100, 2), *cells,
                      *("-" if r[k] is None else human_bytes(r[k])
                        for k in ("bytes_down_per_round", "bytes_up_per_round")),
                      "" if r.get("up_times_smaller") is None else f"{r['up_times_smaller']:.1f}x smaller",
                      f"{r['seconds_per_run']:.0f}",
                      "" if div is None else f"{div:.4f}")
    console.print(table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("matrix", type=Path, help="matrix file, e.g. bench/matrices/pans.toml")
    parser.add_argument("--rounds", type=int, help="rounds per run instead of the matrix's run.rounds")
    parser.add_argument("--seeds", help="comma-separated seeds instead of the matrix's seeds")
    parser.add_argument("--only", action="append", default=[],
                        help="run only cells whose GROUP/sSEED label contains this text (repeatable)")
    parser.add_argument("--skip-existing", action="store_true", help="keep run files already written")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and exit")
    parser.add_argument("--report", action="store_true", help="only rebuild the table from the run files")
    parser.add_argument("--results", type=Path, default=RESULTS, help="results directory (default bench/results)")
    parser.add_argument("--off-protocol", action="store_true",
                        help="run cells that depart from the benchmark protocol (bench/protocol.toml), e.g. a short "
                             "trial with --rounds; their run files record each departure")
    parser.add_argument("--isa", choices=[*isa.PINS, isa.NATIVE],
                        help="pin the instruction set of torch's CPU kernels (instead of the matrix's isa key; "
                             f"{isa.NATIVE}: none), so the cells give the same bits on any CPU that has it")
    parser.add_argument("--restart-unfinished", action="store_true",
                        help="start over a run a stop cut short that began at other code (by default it is left, to "
                             "be resumed from a checkout of its commit; bench/unfinished.py)")
    args = parser.parse_args()
    console = Console(width=None if sys.stdout.isatty() else 150)
    try:
        matrix = load_matrix(args.matrix)
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
        runs = expand(matrix, seeds, args.rounds, args.only)
        protocol = load_protocol()
        departures = protocol_check(runs, protocol)
    except (ConfigError, ValueError) as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    if not (args.report or args.dry_run or args.off_protocol) and refuse_departures(runs, departures, console):
        return 2
    if not (args.report or args.dry_run):
        try:   # before any cell: a pin takes effect only in a process that loads torch under it
            isa.reexec_under(args.isa or matrix.isa)
            isa.check_in_force(args.isa or matrix.isa)
        except isa.IsaError as exc:
            console.print(f"[red]{exc}[/red]", soft_wrap=True)
            return 2
        pin = isa.held()
        if pin:
            console.print(f"instruction set pinned to {pin} ({' '.join(f'{k}={v}' for k, v in isa.PINS[pin].items())})",
                          highlight=False, soft_wrap=True)
    out_dir = args.results / matrix.name
    if args.dry_run:
        for run, found in zip(runs, departures):
            note = f"  (off protocol: {run.off_protocol or '; '.join(found)})" if found else ""
            state = "written" if (out_dir / run.file_name).exists() else \
                Unfinished(out_dir / UNFINISHED / Path(run.file_name).stem).describe()
            console.print(f"{run.group}  seed {run.seed}  {run.rounds} rounds  -> {out_dir / run.file_name}"
                          f"{f' ({state})' if state else ''}{note}", highlight=False, soft_wrap=True)
        console.print(f"{len(runs)} runs")
        return 0
    left: list[str] = []
    if not args.report:
        for i, (run, found) in enumerate(zip(runs, departures), 1):
            if args.skip_existing and (out_dir / run.file_name).exists():
                console.print(f"[dim]{i}/{len(runs)} {run.group} seed {run.seed}: kept {run.file_name}[/dim]")
                continue
            console.print(f"[bold]{i}/{len(runs)} {run.group} seed {run.seed}, {run.rounds} rounds[/bold]")
            try:
                record = run_one(run, out_dir, console, found, protocol, restart=args.restart_unfinished)
            except StartedElsewhere as exc:
                console.print(f"  [yellow]{exc}[/yellow]", soft_wrap=True)
                left.append(run.file_name)
                continue
            except RunInterrupted as exc:   # Ctrl-C or SIGTERM: the run is kept to go on from its last round
                kept = ("before its first checkpoint" if exc.checkpointed_round is None
                        else f"after round {exc.checkpointed_round}")
                console.print(f"[yellow]stopped {kept}; run the same command to go on from there[/yellow]")
                return 130
            personal = final_mean(record["rows"], "personalized_accuracy_mean")
            console.print(f"  final accuracy {_fmt(final_mean(record['rows'], 'test_accuracy'))}"
                          + (f", personalized {personal:.4f}" if personal is not None else "")
                          + f" in {record['seconds']:.0f} s")
    records = [json.loads(p.read_text()) for p in sorted(out_dir.glob("*.json"))]
    if not records:
        console.print(f"no run files in {out_dir}")
        return 1
    full_runs = expand(matrix, None, None, [])
    order = {run.group: i for i, run in enumerate(full_runs)}   # the file's order
    missing = [run.file_name for run in full_runs if not (out_dir / run.file_name).exists()]
    rows = sorted(summarize(records), key=lambda r: (order.get(r["group"], len(order)), r["group"], r["rounds"]))
    add_rounds_to_baseline(rows, records, matrix)
    ran_rounds = sorted({r["rounds"] for r in rows})
    ran_seeds = sorted({s for r in rows for s in r["seeds"]})
    cells = len(order)   # the combinations the matrix runs (an only_with entry joins only some)
    report = {
        "matrix": matrix.name, "file": str(matrix.path),
        "full": {"cells": cells, "rounds": matrix.full_rounds, "seeds": matrix.seeds},
        "ran": {"cells": len({r["group"] for r in rows}), "rounds": ran_rounds, "seeds": ran_seeds,
                "runs": len(records)},
        # subset: some run of the full matrix (every cell, seed, all rounds) has no file; shorter or
        # extra runs beside a complete matrix are kept in the table but do not make it one.
        "subset": bool(missing), "missing": missing,
        "personalized_accuracy": f"mean over clients of each one's accuracy on its own held-out split, mean of "
                                 f"the last {LAST_ROUNDS} rounds that evaluated it; mean and population standard "
                                 "deviation over seeds",
        "final_accuracy": f"mean test accuracy of the last {LAST_ROUNDS} evaluated rounds; mean and population "
                          "standard deviation over seeds",
        "machine": {"python": platform.python_version(), "arch": platform.machine(), "cpus": os.cpu_count()},
        "rows": rows,
    }
    (args.results / f"{matrix.name}.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    title = f"{matrix.name}: {report['ran']['cells']} of {cells} cells, rounds {ran_rounds}, seeds {ran_seeds}"
    print_table(console, title + (" (subset of the matrix)" if report["subset"] else ""), rows)
    console.print(f"written to {args.results / (matrix.name + '.json')} and {out_dir}/")
    if left:
        console.print(f"[yellow]left unfinished, begun at other code: {', '.join(left)}[/yellow]", soft_wrap=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
