"""A benchmark cell gives the same bits whatever the thread timing, and bench/reproduce.py says so.

Streamed aggregation folds float64 sums, which are not associative to the last bit: folded in arrival
order, two runs of one cell drift apart once a rounding lands differently. With ``aggregate.order =
"sorted"`` (what bench/run_matrix.py sets) the fold is by client id, so devices answering in another
order change nothing.
"""

from __future__ import annotations

import io
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from rich.console import Console

from coordinator.config import ConfigError, load_config
from coordinator.runtime.intake import ResultIntake
from coordinator.strategies.fedavg import FedAvg
from edge_client.registry import OBJECTIVES, _objectives
from storage.checkpoint import checkpoint_rounds

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import reproduce  # noqa: E402
from benchmark_protocol import load_protocol  # noqa: E402
from run_matrix import Run, run_one  # noqa: E402

CLIENTS = 4
CELL = (("data", "eval", "digits"), ("data", "partition", "dirichlet:0.5"), ("model", "name", "cnn"),
        ("clients", "expected", CLIENTS), ("clients", "per_round", 3), ("eval", "every", 1),
        ("sim", "workers", -1))   # a thread per client: the sleeps below decide who answers first


def _timed(monkeypatch: pytest.MonkeyPatch, slower_first: bool, arrivals: dict, folds: list) -> None:
    """Devices that sleep before answering, by client id (the lowest slowest, or the highest), and spies on
    the order results reach the coordinator and the order they are folded in, per round."""
    train = OBJECTIVES["train"]

    def slow_train(model, data, hyper, ctx):
        index = int(ctx.client_id.rsplit("-", 1)[1])
        time.sleep(0.1 * (CLIENTS - index if slower_first else index))
        return train(model, data, hyper, ctx)

    monkeypatch.setitem(_objectives(), "train", slow_train)   # the registry's table, read at every task
    take, fold = ResultIntake._take, FedAvg.fold

    def spy_take(self, plan, msg, body):
        arrivals[msg.round].append(plan.client_id)
        return take(self, plan, msg, body)

    def spy_fold(self, phase, partial, result):
        if partial is None:
            folds.append([])
        folds[-1].append(result.client_id)
        return fold(self, phase, partial, result)

    monkeypatch.setattr(ResultIntake, "_take", spy_take)
    monkeypatch.setattr(FedAvg, "fold", spy_fold)


def test_a_cell_is_bit_identical_whatever_the_timing_and_reproduce_says_so(tmp_path, monkeypatch, capsys):
    arrivals: dict[int, list[str]] = defaultdict(list)
    folds: list[list[str]] = []
    with monkeypatch.context() as patch:
        _timed(patch, slower_first=True, arrivals=arrivals, folds=folds)
        run = Run(("tiny",), seed=0, rounds=2, overrides=CELL, off_protocol="a test")
        record = run_one(run, tmp_path / "tiny", Console(file=io.StringIO()), [], load_protocol())
    written = tmp_path / "tiny" / run.file_name
    assert record["config"]["aggregate"]["order"] == "sorted"
    assert record["model_hash"].startswith("sha256:") and record["versions"]["torch"] == torch.__version__
    assert set(record["source"]) == {"commit", "dirty"}
    assert set(reproduce.CPU_KEYS) <= set(record["machine"]) and record["isa"] is None   # the CPU; no pin

    again_arrivals: dict[int, list[str]] = defaultdict(list)
    again_folds: list[list[str]] = []
    with monkeypatch.context() as patch:
        _timed(patch, slower_first=False, arrivals=again_arrivals, folds=again_folds)
        assert reproduce.main([str(written)]) == 0
    out = capsys.readouterr().out
    assert "bit-identical" in out and "differs" not in out

    assert arrivals != again_arrivals   # the devices did answer in other orders ...
    assert len(folds) == 2 and folds == again_folds
    for order in folds:
        assert order == sorted(order)   # ... and every round was folded by client id


def test_reproduce_names_the_first_difference():
    rows = [{"round": 0, "test_accuracy": 0.1, "seconds": 0.0},
            {"round": 1, "train_loss": 1.5, "test_accuracy": 0.5, "seconds": 3.0, "bytes_up": 10,
             "slowest_client": "sim-001"}]
    rerun = json.loads(json.dumps(rows))
    rerun[1].update(seconds=4.0, bytes_up=12, slowest_client="sim-002")   # the machine, not the learning
    assert reproduce.first_difference(rows, rerun) is None
    rerun[1]["test_accuracy"] = 0.5 + 2 ** -40
    found = reproduce.first_difference(rows, rerun)
    assert (found.round, found.metric) == (1, "test_accuracy")
    assert "differs by 9.09e-13" in found.describe()
    assert reproduce.first_difference(rows, rerun, rounds=0) is None   # --rounds 0..N compares only those
    assert reproduce.first_difference(rows, rerun[:1]).metric == "round"


def test_reproduce_refuses_what_is_not_a_run_file(tmp_path, capsys):
    table = tmp_path / "pans.json"
    table.write_text(json.dumps({"matrix": "pans", "full": {}, "rows": []}))
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(reproduce.NotARunFileError, match="matrix's table"):
        reproduce.load_run_file(table)
    assert reproduce.main([str(broken), str(tmp_path / "absent.json")]) == 2
    out = capsys.readouterr().out
    assert "is not JSON" in out and "cannot read" in out


def test_a_fixed_order_is_refused_where_no_order_can_be_fixed():
    base = [("clients", "expected", 4), ("clients", "spawn", 4), ("transport", "kind", "inproc"),
            ("aggregate", "order", "sorted")]
    assert load_config(None, base).aggregate.order == "sorted"
    with pytest.raises(ConfigError, match="run.mode = 'sync'"):
        load_config(None, base + [("run", "mode", "async")])
    with pytest.raises(ConfigError, match="needs workers.count = 0"):
        load_config(None, base + [("workers", "count", 2)])
    with pytest.raises(ConfigError, match="aggregate.order must be one of"):
        load_config(None, base[:-1] + [("aggregate", "order", "random")])


def test_stale_lists_files_by_what_they_recorded(tmp_path):
    from provenance import UNRECORDED, changes_since, source_state

    old = tmp_path / "old-s0-r5.json"
    old.write_text(json.dumps({"config": {"run": {}}, "rows": [{"round": 0}], "seed": 0, "rounds": 5}))
    assert reproduce.staleness(old).startswith("unrecorded")
    head = source_state()["commit"]
    if head == UNRECORDED:
        pytest.skip("not a git checkout")
    assert changes_since(head) == [] and changes_since("0" * 40) is None and changes_since(UNRECORDED) is None
    old.write_text(json.dumps({"config": {"run": {}}, "rows": [{"round": 0}], "seed": 0, "rounds": 5,
                               "source": {"commit": head, "dirty": False}}))
    assert reproduce.staleness(old).startswith("current")


def test_a_result_is_held_only_while_a_client_before_it_may_still_answer(tmp_path, monkeypatch):
    """Four devices: a fails at once, c answers before b, d last. In client-id order c waits for b (a's
    failure does not hold anyone up), then b and c are folded together, and d as soon as it comes."""
    from test_engine import ScriptedClient, make_coordinator
    from edge_client.wire.transport import InprocHub

    folded: list[str] = []
    fold = FedAvg.fold

    def spy_fold(self, phase, partial, result):
        folded.append(result.client_id)
        return fold(self, phase, partial, result)

    monkeypatch.setattr(FedAvg, "fold", spy_fold)
    books = []
    close = ResultIntake.close
    monkeypatch.setattr(ResultIntake, "close", lambda self, book: (books.append(book), close(self, book))[1])
    delays = {"a": 0.0, "b": 0.6, "c": 0.05, "d": 1.2}

    def answer(peer, task):
        time.sleep(delays[peer.client_id])
        if peer.client_id == "a":
            return [peer.result(task, error="cannot train")]
        scale = 1 + 0.001 * "abcd".index(peer.client_id)
        return [peer.result(task, tensors={k: v * scale for k, v in task.tensors.items()})]

    hub = InprocHub()
    coord = make_coordinator(tmp_path, hub, expected=4, clients__min_results=3, aggregate__order="sorted")
    peers = [ScriptedClient(hub, c, answer) for c in "abcd"]
    for peer in peers:
        peer.start()
    coord.wait_for_clients(4, 5)
    row = coord.run_round(1)
    for peer in peers:
        peer.stop.set()
    assert (row["returned"], row["failed"]) == (3, 1)
    assert folded == ["b", "c", "d"]
    assert books[0].held_peak <= 2 and not books[0].held   # c and b together at most; nothing left at the end


def test_a_run_that_stops_with_a_run_error_is_kept_as_failed_and_left_out_of_the_means(tmp_path):
    """A cell whose training cannot go on (here every device diverges) is a result: its file keeps the rows
    up to there and the reason, and the table counts it as failed instead of averaging a figure it never had."""
    from run_matrix import summarize

    run = Run(("diverges",), 0, 2, CELL + (("train", "lr", 1e12), ("clients", "max_attempts", 1)), "", (0,))
    record = run_one(run, tmp_path / "m", Console(file=io.StringIO()), [], load_protocol())
    assert "diverged" in record["failure"] and record["summary"] is None and record["model_hash"] is None
    assert json.loads((tmp_path / "m" / run.file_name).read_text())["failure"] == record["failure"]
    row, = summarize([record])
    assert row["final_accuracy_mean"] is None and row["failed"] == {0: record["failure"]}


def test_a_run_cut_short_goes_on_from_its_last_round_to_the_same_bits(tmp_path, monkeypatch, capsys):
    """A stop in the middle of a matrix run: running the cell again, here from another directory, resumes it from its
    last checkpoint, and the run file is what an unbroken run writes (DFL with diversity: state on the devices and
    peers on the server)."""
    import run_matrix
    import unfinished
    from coordinator.runtime.run import RunInterrupted

    clean = {"commit": "c0ffee", "dirty": False}
    monkeypatch.setattr(run_matrix, "source_state", lambda: clean)
    monkeypatch.setattr(unfinished, "changes_since", lambda commit: [])
    cell = CELL + (("run", "strategy", "dfl"), ("dfl", "diversity", 1), ("clients", "per_round", 0),
                   ("data", "partition", "attribute:colorlabel:4:0.9"), ("data", "local_test_fraction", 0.2))
    run = Run(("dfl",), seed=0, rounds=4, overrides=cell, off_protocol="a test")
    unbroken = run_one(run, tmp_path / "unbroken", Console(file=io.StringIO()), [], load_protocol())

    printer = run_matrix.progress_printer

    def stopping_printer(console, label):
        def progress(row):
            if row["round"] == 2:
                raise KeyboardInterrupt   # what a stop of the machine does after round 2's checkpoint
        return progress

    monkeypatch.setattr(run_matrix, "progress_printer", stopping_printer)
    with pytest.raises(RunInterrupted):
        run_one(run, tmp_path / "cut", Console(file=io.StringIO()), [], load_protocol())
    left = tmp_path / "cut" / unfinished.UNFINISHED / run.file_name[:-len(".json")]
    assert (left / "run" / "checkpoints").is_dir() and not (tmp_path / "cut" / run.file_name).exists()
    # round 3 is checkpointed too if it was aggregated before round 2's evaluation came (its row pending)
    last = max(checkpoint_rounds(left / "run" / "checkpoints"))
    assert last in (2, 3)
    assert f"unfinished: round {last} done" in unfinished.Unfinished(left).describe()   # what --dry-run lists

    # another checkout resumes it: the directory is all it needs (committed, it is what a fresh clone gets)
    (tmp_path / "cut").rename(tmp_path / "clone")
    left = tmp_path / "clone" / unfinished.UNFINISHED / run.file_name[:-len(".json")]
    monkeypatch.setattr(run_matrix, "progress_printer", printer)
    said = io.StringIO()
    resumed = run_one(run, tmp_path / "clone", Console(file=said), [], load_protocol())
    assert f"resuming after round {last}" in said.getvalue()
    assert resumed["resumed_after"] == [last] and "resumed_after" not in unbroken
    assert resumed["model_hash"] == unbroken["model_hash"]
    assert reproduce.first_difference(unbroken["rows"], resumed["rows"]) is None   # what was learned, every round
    assert not left.exists()   # the run file is written: the unfinished directory is gone


def test_a_run_is_resumed_only_at_the_code_it_began_at(monkeypatch):
    import unfinished

    monkeypatch.setattr(unfinished, "changes_since", lambda commit: [] if commit == "same" else ["abc1234 a change"])
    clean = {"commit": "same", "dirty": False}
    assert unfinished.other_code(clean, clean) is None
    assert "not committed" in unfinished.other_code({**clean, "dirty": True}, clean)
    assert "not committed" in unfinished.other_code(clean, {**clean, "dirty": True})
    assert "abc1234 a change" in unfinished.other_code({"commit": "old", "dirty": False}, clean)


def test_a_run_begun_at_other_code_is_left_for_its_commit_unless_restarted(tmp_path, monkeypatch):
    import run_matrix
    import unfinished
    from coordinator.runtime.run import RunInterrupted

    def stop_after_round_1(console, label):
        def progress(row):
            if row["round"] == 1:
                raise KeyboardInterrupt
        return progress

    monkeypatch.setattr(run_matrix, "source_state", lambda: {"commit": "old", "dirty": False})
    monkeypatch.setattr(unfinished, "changes_since", lambda commit: [] if commit == "new" else ["abc1234 a change"])
    run = Run(("tiny",), seed=0, rounds=2, overrides=CELL, off_protocol="a test")
    with monkeypatch.context() as patch:
        patch.setattr(run_matrix, "progress_printer", stop_after_round_1)
        with pytest.raises(RunInterrupted):
            run_one(run, tmp_path, Console(file=io.StringIO()), [], load_protocol())
    monkeypatch.setattr(run_matrix, "source_state", lambda: {"commit": "new", "dirty": False})
    with pytest.raises(unfinished.StartedElsewhere, match="abc1234 a change.*git worktree add DIR old"):
        run_one(run, tmp_path, Console(file=io.StringIO()), [], load_protocol())
    assert (tmp_path / unfinished.UNFINISHED / run.file_name[:-len(".json")] / "run" / "checkpoints").is_dir()
    said = io.StringIO()
    record = run_one(run, tmp_path, Console(file=said), [], load_protocol(), restart=True)
    assert "starting over (it had reached round 1)" in said.getvalue() and "resumed_after" not in record
    assert record["source"]["commit"] == "new"


def test_a_stopped_matrix_says_how_to_go_on(tmp_path, monkeypatch, capsys):
    """Ctrl-C or SIGTERM during a matrix: one line saying where the run stopped and that the same command
    goes on from there, not a traceback."""
    import run_matrix
    from coordinator.runtime.run import RunInterrupted

    def stopped(*args, **kwargs):
        raise RunInterrupted(tmp_path / "run", 7)

    monkeypatch.setattr(run_matrix, "run_one", stopped)
    monkeypatch.setattr(sys, "argv", ["run_matrix.py", str(ROOT / "bench" / "matrices" / "tuning.toml"),
                                      "--seeds", "0", "--results", str(tmp_path), "--off-protocol"])
    assert run_matrix.main() == 130
    assert "stopped after round 7; run the same command to go on from there" in capsys.readouterr().out
