"""Re-run committed benchmark cells and say whether they give the same bits.

A run file of ``bench/run_matrix.py`` (``bench/results/MATRIX/LABELS-sSEED-rROUNDS.json``) keeps the
resolved configuration its cell ran with (seed and rounds included). This script runs that
configuration again in a scratch directory, the same way (clients as threads, results folded in
client-id order), and compares every learning metric of every round, test accuracy at each evaluated
round included, and the final model's hash where the file has one. It prints "bit-identical", or the
first round and metric that differ and by how much, and exits 1 when any file differs (2 for a file
that is not a run file).

Not compared: what measures the machine rather than the learning (seconds, bytes, which client was
slowest, messages counted late or twice): bytes move by a few with every run because each message
header carries a wall-clock deadline.

A run is repeatable bit for bit on the same instruction set, with the same torch and numpy and the same
thread counts. torch picks its CPU kernels by what the CPU has (AVX-512, AVX2), and a wider vector adds in
another order: the same cell under another instruction set departs within a round in the last bits. The
file records the CPU (model, maker and generation, vector extensions, caches), torch's CPU capability and
the variables capping it (``bench/isa.py``); each that differs is said before the run, and a difference
ends with a verdict: it may come from another CPU or instruction set, or, on the same CPU and set, it is a
regression. A file run under a pin (``isa = "avx2"`` in its matrix, or ``bench/run_matrix.py --isa avx2``:
ATen, oneDNN and MKL capped at one set, so that CPUs having it run the same kernels) is re-run under its
pin, in a new process (torch reads the pin only when it loads); ``--isa`` re-runs under another, or
``native`` for none. Measured with ``nice -n 10 python bench/reproduce_isa.py``
(``bench/results/reproduce_isa.json``) on an AVX-512 AMD EPYC, the protocol's FedAvg cell for 3 rounds:
two runs under one setting were bit-identical; unpinned and pinned to avx2 they parted at round 1
(training loss relative 4.1e-7), and the accuracy after 3 rounds was 45.56 unpinned, 45.49 under avx2,
45.16 under avx512.

    python bench/reproduce.py bench/results/spherefed/a0.1-cnn-fedavg-s0-r100.json --rounds 5
    python bench/reproduce.py --stale bench/results/*/*-r*.json   # which files predate a code change
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

import isa
from provenance import CODE, UNRECORDED, changes_since, library_versions, machine, source_state
from run_matrix import execute, scratch_overrides
from coordinator.config import ConfigError, RunConfig, load_config, renamed_keys
from coordinator.strategies.base import Strategy
from coordinator.strategy_setup import make_strategy
from storage.errors import FedgeError

__all__ = ["NotARunFileError", "Difference", "SYSTEM_KEYS", "CPU_KEYS", "compared_keys", "first_difference",
           "load_run_file", "cpu_differences", "verdict", "reproduce", "staleness", "main"]

# Keys that measure the machine and the network, not the learning: never compared.
SYSTEM_KEYS = frozenset({"slowest_client", "inbox_dropped", "late", "duplicates", "skipped"})
# The keys of a run file's machine that say which CPU and instruction set torch's kernels ran with (bench/isa.py).
CPU_KEYS = ("cpu_model", "cpu_id", "cpu_flags", "cpu_caches", "torch_cpu_capability", "isa_env")
_UNRECORDED_CPU = ("it predates the recording of the CPU and its instruction set: a difference may come from "
                   "another CPU (AVX-512 against AVX2, say), and the file cannot tell")


class NotARunFileError(FedgeError, ValueError):
    """A file given to reproduce is not a run file of bench/run_matrix.py."""


@dataclass(frozen=True)
class Difference:
    """The first place a re-run departs from its run file."""

    round: int | None     # None: the final model, not a row
    metric: str
    recorded: Any
    rerun: Any

    def describe(self) -> str:
        where = "the final model" if self.round is None else f"round {self.round}, {self.metric}"
        text = f"{where}: recorded {self.recorded!r}, re-run {self.rerun!r}"
        if _number(self.recorded) and _number(self.rerun):
            gap = abs(self.rerun - self.recorded)
            scale = abs(self.recorded) or 1.0
            text += f" (differs by {gap:.3g}, relative {gap / scale:.3g})"
        return text


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def compared_keys(row: dict[str, Any]) -> set[str]:
    """The keys of a row that depend only on the learning: every one but seconds, bytes and
    :data:`SYSTEM_KEYS`."""
    return {k for k in row if k not in SYSTEM_KEYS and "seconds" not in k and "bytes" not in k}


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON values, NaN equal to NaN (a diverged run repeats its NaN)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def first_difference(recorded: list[dict[str, Any]], rerun: list[dict[str, Any]],
                     rounds: int | None = None) -> Difference | None:
    """The first round (and within it the first metric, by name) where ``rerun`` departs from ``recorded``,
    over the recorded rows up to ``rounds`` (all of them when None); None when they agree bit for bit."""
    want = [r for r in recorded if rounds is None or r["round"] <= rounds]
    got = {r["round"]: r for r in rerun}
    for row in want:
        other = got.get(row["round"])
        if other is None:
            return Difference(row["round"], "round", "present", "missing")
        for key in sorted(compared_keys(row) | compared_keys(other)):
            if key not in row or key not in other or not _same(row[key], other[key]):
                return Difference(row["round"], key, row.get(key, "absent"), other.get(key, "absent"))
    return None


def load_run_file(path: Path) -> dict[str, Any]:
    """The run file at ``path``; NotARunFileError saying what is missing otherwise."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise NotARunFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise NotARunFileError(f"{path} is not JSON ({exc}): give a run file, "
                               "bench/results/MATRIX/LABELS-sSEED-rROUNDS.json") from None
    missing = [k for k in ("config", "rows", "seed", "rounds") if not isinstance(record, dict) or k not in record]
    if missing:
        hint = (" (it looks like a matrix's table: give one of the run files in its directory)"
                if isinstance(record, dict) and "matrix" in record and "full" in record else "")
        raise NotARunFileError(f"{path} is not a run file of bench/run_matrix.py: it has no "
                               f"{', '.join(missing)}{hint}")
    if not isinstance(record["config"], dict) or not isinstance(record["config"].get("run"), dict) \
            or not isinstance(record["rows"], list) or not all(isinstance(r, dict) and "round" in r
                                                               for r in record["rows"]):
        raise NotARunFileError(f"{path}: its config has no [run] section or its rows have no round numbers")
    return record


def rerun_config(record: dict[str, Any], out: Path) -> tuple[RunConfig, list[str]]:
    """The recorded configuration, to run in ``out``; and notes on what had to be supplied."""
    notes = []
    renamed = renamed_keys()
    overrides = [renamed.get((section, key), (section, key)) + (value,) for section, values in record["config"].items()
                 if isinstance(values, dict) for key, value in values.items()]
    if "order" not in record["config"].get("aggregate", {}):
        notes.append("it predates aggregate.order: a streamed phase (FedAvg's mean, say) folded its results in "
                     "arrival order, which no re-run can repeat; re-running in client-id order, so a streaming cell "
                     "may differ in the last bits from round 1")
        overrides.append(("aggregate", "order", "sorted"))
    privacy = record["config"].get("privacy", {})
    if privacy.get("mode") == "central" and "accountant" not in privacy:
        notes.append("it predates privacy.accountant and the secret draws: its rounds were drawn from the run's seed "
                     "(today's privacy.sampling = 'seeded') and its dp_epsilon is RDP's Poisson account; re-running "
                     "with that draw and privacy.accountant = 'rdp'")
        overrides += [("privacy", "sampling", "seeded"), ("privacy", "accountant", "rdp")]
    if record["config"]["run"].get("mode") == "async" and "weighting" not in record["config"].get("async", {}):
        notes.append("it predates async.weighting: its versions were the sample-weighted mean of the buffer; "
                     "re-running with async.weighting = 'normalized'")
        overrides.append(("async", "weighting", "normalized"))
    return load_config(None, overrides + scratch_overrides(out)), notes


def _stopping_after(strategy: Strategy, rounds: int) -> Strategy:
    """``strategy``, ending the run after ``rounds`` rounds through its own stop hook: every round runs as
    in the full run (the same evaluations, the same last-round phases scheduled), just fewer of them."""
    own = strategy.stop_before

    def stop_before(round: int, state: Any) -> str:
        return f"reproducing the first {rounds} rounds" if round > rounds else own(round, state)

    strategy.stop_before = stop_before   # type: ignore[method-assign]
    return strategy


def _listed(values: dict[str, str] | None) -> str:
    return " ".join(f"{k}={v}" for k, v in (values or {}).items()) or "none"


def cpu_differences(recorded: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """How the CPU and the instruction set of a run file's ``machine`` differ from ``here`` (both as
    ``provenance.machine()`` gives them), one note each, the one that decides the bits first; a file that
    predates their recording gives one note saying so; [] when they agree."""
    if not any(key in recorded for key in CPU_KEYS):
        return [_UNRECORDED_CPU]
    notes = []
    if recorded.get("torch_cpu_capability") != here.get("torch_cpu_capability"):
        notes.append(f"torch's CPU kernels: {recorded.get('torch_cpu_capability')} recorded, "
                     f"{here.get('torch_cpu_capability')} here (another instruction set adds in another order)")
    if (recorded.get("isa_env") or {}) != (here.get("isa_env") or {}):
        notes.append(f"instruction-set caps: {_listed(recorded.get('isa_env'))} recorded, "
                     f"{_listed(here.get('isa_env'))} here")
    was, now = recorded.get("cpu_flags") or [], here.get("cpu_flags") or []
    if set(was) != set(now):
        gone, new = [f for f in was if f not in now], [f for f in now if f not in was]
        notes.append("vector extensions: " + "; ".join(
            ([f"the recorded CPU had {', '.join(gone)}, this one has not"] if gone else [])
            + ([f"this CPU has {', '.join(new)}, the recorded one had not"] if new else [])))
    if (recorded.get("cpu_model"), recorded.get("cpu_id")) != (here.get("cpu_model"), here.get("cpu_id")):
        notes.append(f"another CPU: {recorded.get('cpu_model')} ({recorded.get('cpu_id')}) recorded, "
                     f"{here.get('cpu_model')} ({here.get('cpu_id')}) here")
    if recorded.get("cpu_caches") != here.get("cpu_caches"):
        notes.append(f"caches: {_listed(recorded.get('cpu_caches'))} recorded, {_listed(here.get('cpu_caches'))} "
                     "here (oneDNN sizes its blocks by them)")
    return notes


def verdict(recorded: dict[str, Any], here: dict[str, Any]) -> str:
    """What a re-run that differs says, given the run file's ``machine`` and this one's: whether the difference
    may come from another CPU or instruction set, from other core or thread counts, or from neither (the same
    CPU and set: a regression)."""
    cpu = cpu_differences(recorded, here)
    if cpu == [_UNRECORDED_CPU]:
        return ("the file does not record its CPU: the difference may come from another CPU or instruction set as "
                "well as from the code; re-run the cell here to record it, then compare")
    if cpu:
        return (f"not the recorded CPU or instruction set ({cpu[0]}{'; ...' if len(cpu) > 1 else ''}): the "
                "difference may come from that rather than from the code; re-run under the file's pin on a CPU like "
                "the recorded one, or compare runs under one pin (bench/run_matrix.py --isa avx2)")
    threads = [key for key in ("arch", "cpus", "torch_threads") if key in recorded and recorded[key] != here.get(key)]
    if threads:
        return (f"same CPU and instruction set, other {', '.join(threads)}: torch splits its sums by thread "
                "count; re-run with the recorded counts")
    return ("same CPU and instruction set as recorded: not the machine, a regression (in the code, or in a library "
            "the notes above name)")


def _provenance_notes(record: dict[str, Any]) -> list[str]:
    """What differs between the run file's code, libraries, machine, CPU and instruction set and this one's."""
    notes = []
    source, now = record.get("source") or {}, source_state()
    commit = source.get("commit", UNRECORDED)
    if commit == UNRECORDED:
        notes.append("its commit is unrecorded (written before run files recorded one)")
    elif commit != now["commit"]:
        notes.append(f"it ran at commit {commit[:12]}, this tree is at {now['commit'][:12]}: code changed since "
                     "may change the numbers (check out its commit to re-run that code)")
    if source.get("dirty"):
        notes.append("its tree had changes not committed: its code cannot be checked out exactly")
    if now.get("dirty"):
        notes.append("this tree has changes not committed")
    versions, here = record.get("versions") or {}, library_versions()
    notes += [f"{name} {versions[name]} recorded, {here[name]} here" for name in here
              if name in versions and versions[name] != here[name]]
    recorded_machine, this = record.get("machine") or {}, machine()
    notes += [f"{key} {recorded_machine[key]} recorded, {this[key]} here" for key in this
              if key not in CPU_KEYS and key in recorded_machine and recorded_machine[key] != this[key]]
    pin, here = record.get("isa"), isa.held()
    if pin != here and ("isa" in record or here is not None):
        notes.append(f"it ran {f'under the {pin} pin' if pin else 'unpinned'}, this process runs "
                     f"{f'under the {here} pin' if here else 'unpinned'}: expect a difference")
    return notes + cpu_differences(recorded_machine, this)


def reproduce(path: Path, console: Console, rounds: int | None = None) -> Difference | None:
    """Re-run the cell of the run file at ``path`` (its first ``rounds`` rounds) and compare; the first
    difference, or None when the re-run is bit-identical."""
    record = load_run_file(path)
    recorded_rounds = int(record["config"]["run"].get("rounds", record["rounds"]))
    if rounds is not None and not 1 <= rounds <= recorded_rounds:
        raise NotARunFileError(f"--rounds must be between 1 and the {recorded_rounds} rounds {path.name} ran")
    if record["config"]["run"].get("mode") == "async" or record["config"].get("privacy", {}).get("mode") in (
            "central", "local"):
        console.print("[yellow]  asynchronous versions (made of whichever results come first) and differential "
                      "privacy's noise (fresh from the OS) are not repeatable: expect a difference[/yellow]")
    upto = rounds if rounds is not None and rounds < recorded_rounds else None
    with tempfile.TemporaryDirectory(prefix="fedge-reproduce-") as scratch:
        config, notes = rerun_config(record, Path(scratch) / "run")
        for note in notes + _provenance_notes(record):
            console.print(f"[yellow]  note: {note}[/yellow]", highlight=False)
        strategy = make_strategy(config)
        if upto is not None:
            strategy = _stopping_after(strategy, upto)
        expected = {r["round"]: r for r in record["rows"]}

        def progress(row: dict[str, Any]) -> None:
            want = expected.get(row["round"])
            same = want is not None and first_difference([want], [row]) is None
            acc = row.get("test_accuracy")
            console.print(f"  round {row['round']:>3}" + (f"  acc {acc:.4f}" if acc is not None else "")
                          + ("  same" if same else "  [red]differs[/red]"), highlight=False)

        ran = execute(config, progress, strategy=strategy)
    found = first_difference(record["rows"], ran["rows"], upto)
    if found is None and upto is None and record.get("model_hash") and record["model_hash"] != ran["model_hash"]:
        found = Difference(None, "model_hash", record["model_hash"], ran["model_hash"])
    return found


def staleness(path: Path) -> str:
    """One line on whether the run file at ``path`` predates a change to the code it ran: "current",
    "stale" with the commits since, or "unrecorded" (written before run files recorded their commit)."""
    record = load_run_file(path)
    commit = (record.get("source") or {}).get("commit", UNRECORDED)
    since = changes_since(commit)
    if commit == UNRECORDED:
        return f"unrecorded  {path}"
    if since is None:
        return f"unknown     {path} (commit {commit[:12]} is not in this checkout)"
    dirty = " (its tree was dirty)" if (record.get("source") or {}).get("dirty") else ""
    if not since:
        return f"current     {path}{dirty}"
    return f"stale       {path}: {len(since)} commit(s) since {commit[:12]} changed the code, newest {since[0]}{dirty}"


def _in_pinned_process(path: Path, pin: str, rounds: int | None, console: Console) -> int:
    """Reproduce ``path`` in a new Python process under the ``pin`` instruction set (its variables are read when
    torch loads, and this process has loaded it); that process's exit status."""
    try:
        isa.require(pin)
    except isa.IsaError as exc:
        console.print(f"[bold]{path}[/bold]\n  [red]cannot re-run under the {pin} pin: {exc}[/red]", highlight=False)
        return 2
    console.print(f"[dim]{path.name}: under the {pin} pin ({_listed(isa.PINS.get(pin))}), in a new process[/dim]",
                  highlight=False, soft_wrap=True)
    sys.stdout.flush()
    command = [sys.executable, str(Path(__file__).resolve()), str(path), "--isa", pin]
    command += ["--rounds", str(rounds)] if rounds is not None else []
    return subprocess.run(command, env=isa.pinned_environment(pin), check=False).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="run files, bench/results/MATRIX/LABELS-sSEED-rROUNDS.json")
    parser.add_argument("--rounds", type=int, help="re-run only the first N rounds of each cell and compare those")
    parser.add_argument("--isa", choices=[*isa.PINS, isa.NATIVE],
                        help="re-run under this instruction-set pin instead of the one the file records (native: "
                             "none); a file pinned, or this option, runs in a new process under the pin")
    parser.add_argument("--stale", action="store_true",
                        help=f"run nothing: say of each file whether the code it ran ({', '.join(CODE)}) changed "
                             "since its recorded commit")
    args = parser.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 150)
    status = 0
    if args.stale:
        for path in args.files:
            try:
                console.print(staleness(path), highlight=False, soft_wrap=True)
            except NotARunFileError as exc:
                console.print(f"[red]{exc}[/red]", highlight=False)
                status = 2
        return status
    for path in args.files:
        try:
            pin = args.isa or load_run_file(path).get("isa")
        except NotARunFileError:
            pin = None   # said below
        if pin is not None and not isa.holds(pin):
            status = max(status, _in_pinned_process(path, pin, args.rounds, console))
            continue
        console.print(f"[bold]{path}[/bold]" + (f": first {args.rounds} rounds" if args.rounds else "")
                      + (f", under the {pin} pin" if pin and pin != isa.NATIVE else ""), highlight=False)
        try:
            isa.check_in_force(pin)
            found = reproduce(path, console, args.rounds)
        except (NotARunFileError, ConfigError, isa.IsaError) as exc:
            console.print(f"[red]{exc}[/red]", highlight=False)
            status = max(status, 2)
            continue
        if found is None:
            console.print(f"  [green]bit-identical[/green]: {path.name}", highlight=False)
        else:
            console.print(f"  [red]differs[/red] at {found.describe()}", highlight=False)
            console.print(f"  verdict: {verdict(load_run_file(path).get('machine') or {}, machine())}",
                          highlight=False, soft_wrap=True)
            status = max(status, 1)
    return status


if __name__ == "__main__":
    sys.exit(main())
