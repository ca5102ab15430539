"""Test-set evaluation every eval.every rounds, off the critical path: it runs while the next round trains."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from coordinator.config import load_config
from coordinator.runtime.engine import RunError
from coordinator.runtime.run import run_federated
from coordinator.strategies.fedavg import FedAvg


def config_for(out: Path, **sets):
    """A small in-process digits run; keyword ``section__key=value`` overrides any key."""
    base = {"run__rounds": 2, "run__out": str(out), "model__name": "cnn", "data__eval": "digits",
            "clients__expected": 3, "clients__spawn": 3, "clients__round_timeout": 60.0,
            "clients__presence_timeout": 60.0, "train__batch_size": 32, "transport__kind": "inproc",
            "export__enabled": False}
    base.update(sets)
    return load_config(None, [(*key.split("__", 1), value) for key, value in base.items()])


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_every_k_rounds_and_the_last_with_personalized_evaluation_on_the_same_knob(tmp_path):
    config = config_for(tmp_path / "run", run__rounds=7, eval__every=3, data__local_test_fraction=0.2,
                        eval__personalized=True)
    seen = []
    result = run_federated(config, say=lambda s: None, on_round=lambda row: seen.append(row["round"]))
    rows = read_metrics(result.out_dir)
    assert [r["round"] for r in rows] == seen == list(range(8))
    assert [r["round"] for r in rows if "test_accuracy" in r] == [0, 3, 6, 7]
    assert [r["round"] for r in rows if "test_loss" in r] == [0, 3, 6, 7]
    assert [r["round"] for r in rows if "personalized_accuracy_mean" in r] == [3, 6, 7]
    s = result.summary
    assert s["final_accuracy"] == rows[7]["test_accuracy"] and s["final_loss"] == rows[7]["test_loss"]
    assert s["best_accuracy"] == max(rows[r]["test_accuracy"] for r in (0, 3, 6, 7))
    assert s["rounds"] == 7
    assert sorted(p.name for p in (result.out_dir / "checkpoints").glob("round_*.safetensors")) == [
        f"round_{r:04d}.safetensors" for r in range(1, 8)]


class OverlappedEvaluation(FedAvg):
    """FedAvg whose evaluation of round r waits until round r + 1's tasks are planned, and whose aggregation
    of round r + 1 waits until round r's evaluation began: run one after the other, either would wait out
    PATIENCE, which the test sees. Events, not durations, which a loaded machine stretches at will."""

    PATIENCE = 60.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.planned: dict[int, threading.Event] = {}           # round -> its tasks were planned
        self.evaluating: dict[int, threading.Event] = {}        # round -> its evaluation began
        self.threads: dict[int, str] = {}                       # round -> the thread that evaluated it
        self.waited_out: list[str] = []                         # the waits that ran out of patience
        self.last_round = 0                                     # the run's: no round follows its evaluation

    def _event(self, table: dict[int, threading.Event], round: int) -> threading.Event:
        return table.setdefault(round, threading.Event())

    def configure_train(self, round, state, clients):
        self._event(self.planned, round).set()
        return super().configure_train(round, state, clients)

    def aggregate_train(self, round, state, results):
        if round > 1 and not self._event(self.evaluating, round - 1).wait(self.PATIENCE):
            self.waited_out.append(f"round {round} was aggregated before round {round - 1}'s evaluation began")
        return super().aggregate_train(round, state, results)

    def evaluate(self, state, model, x, y):
        r = state.round
        self.threads[r] = threading.current_thread().name
        self._event(self.evaluating, r).set()
        if 0 < r < self.last_round and not self._event(self.planned, r + 1).wait(self.PATIENCE):
            self.waited_out.append(f"round {r}'s evaluation ended before round {r + 1}'s tasks were planned")
        return super().evaluate(state, model, x, y)


def test_evaluation_runs_while_the_next_round_trains(tmp_path):
    rounds = 4
    config = config_for(tmp_path / "run", run__rounds=rounds, clients__expected=2, clients__spawn=2)
    strategy = OverlappedEvaluation.from_config(config)
    strategy.last_round = rounds
    result = run_federated(config, say=lambda s: None, strategy=strategy)
    rows = read_metrics(result.out_dir)
    assert all("test_accuracy" in r for r in rows)
    assert sorted(strategy.threads) == list(range(rounds + 1))
    assert strategy.threads[0] == threading.current_thread().name    # round 0: before training, on the run's thread
    for r in range(1, rounds):   # round r's evaluation on its own thread, while round r + 1 trained
        assert strategy.threads[r] != threading.current_thread().name
    assert strategy.waited_out == []


class FailingEvaluation(FedAvg):
    def evaluate(self, state, model, x, y):
        if state.round == 2:
            raise ValueError("no test split today")
        return super().evaluate(state, model, x, y)


@pytest.mark.parametrize("keep", ["all", "last"])
def test_a_failed_evaluation_fails_the_run_keeps_the_rounds_trained_and_a_resume_evaluates_them(tmp_path, keep):
    """Round 2's checkpoint is written when it is aggregated, before its evaluation fails: the run stops with
    rounds 2 (and 3, if it was trained meanwhile) checkpointed and their rows pending; --resume evaluates them.
    ``checkpoint.keep = "last"`` keeps the checkpoints of pending rows until they are evaluated."""
    config = config_for(tmp_path / "run", run__rounds=4, checkpoint__keep=keep)
    with pytest.raises(RunError, match="evaluation of round 2 failed: ValueError: no test split today.*--resume"):
        run_federated(config, say=lambda s: None, strategy=FailingEvaluation.from_config(config))
    rows = read_metrics(tmp_path / "run")
    trained = [r["round"] for r in rows]
    assert trained in ([0, 1, 2], [0, 1, 2, 3])
    assert [r["round"] for r in rows if r.get("evaluation") == "pending"] == trained[2:]
    assert all("test_accuracy" not in r for r in rows[2:]) and "test_accuracy" in rows[1]
    checkpoints = (tmp_path / "run" / "checkpoints").glob("round_*.safetensors")
    kept = trained[1:] if keep == "all" else trained[2:]
    assert sorted(p.name for p in checkpoints) == [f"round_{r:04d}.safetensors" for r in kept]

    result = run_federated(config, resume=True, say=lambda s: None)
    rows = read_metrics(result.out_dir)
    assert [r["round"] for r in rows] == [0, 1, 2, 3, 4]
    assert all("test_accuracy" in r and "evaluation" not in r for r in rows)
    assert result.summary["this_session"]["resumed_after_round"] == trained[-1]
    checkpoints = (tmp_path / "run" / "checkpoints").glob("round_*.safetensors")
    assert len(list(checkpoints)) == (4 if keep == "all" else 1)


def test_a_run_killed_before_its_last_evaluation_is_completed_on_resume_without_clients(tmp_path):
    """The last round is checkpointed and its evaluation never done: --resume evaluates it and writes the summary,
    starting and waiting for no client."""
    config = config_for(tmp_path / "run", run__rounds=2)
    with pytest.raises(RunError, match="evaluation of round 2 failed"):
        run_federated(config, say=lambda s: None, strategy=FailingEvaluation.from_config(config))
    assert read_metrics(tmp_path / "run")[-1] == {**read_metrics(tmp_path / "run")[-1], "evaluation": "pending"}
    said, progress = [], []
    result = run_federated(config, resume=True, say=said.append, on_progress=progress.append)
    rows = read_metrics(result.out_dir)
    assert [r["round"] for r in rows] == [0, 1, 2] and all("evaluation" not in r for r in rows)
    assert result.summary["final_accuracy"] == rows[2]["test_accuracy"]
    assert not any("nothing to resume" in line for line in said)
    assert not [p for p in progress if p["kind"] == "waiting"]


def _coordinator_cmd(out: Path, broker: str, prefix: str, rounds: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "coordinator.ui.cli", "run", "--data", "digits", "--model", "mlp",
            "--set", "model.hidden=[32]", "--rounds", str(rounds), "--clients", "2", "--spawn-clients", "2",
            "--broker", broker, "--seed", "5", "--out", str(out), "--set", f"transport.prefix={prefix}",
            "--set", "eval.every=2", "--set", "export.enabled=false", *extra]


def test_resume_after_kill_with_evaluation_every_two_rounds(tmp_path, mosquitto, prefix, kill_after_checkpoint):
    rounds = 5
    ref = subprocess.run(_coordinator_cmd(tmp_path / "ref", mosquitto, prefix + "-ref", rounds),
                         capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stdout + ref.stderr

    out = tmp_path / "resumed"
    proc = subprocess.Popen(_coordinator_cmd(out, mosquitto, prefix, rounds), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    kill_after_checkpoint(proc, out, 2)   # round 2 aggregated (its evaluation, if due, may be pending)
    done_before = [r["round"] for r in read_metrics(out)]
    assert 2 <= max(done_before) < rounds

    resumed = subprocess.run(_coordinator_cmd(out, mosquitto, prefix, rounds, "--resume"),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    a, b = read_metrics(tmp_path / "ref"), read_metrics(out)
    assert [r["round"] for r in b] == [r["round"] for r in a] == list(range(rounds + 1))
    assert [r["round"] for r in b if "test_accuracy" in r] == [r["round"] for r in a if "test_accuracy" in r] == [
        0, 2, 4, 5]
    for ra, rb in zip(a, b):
        if "test_accuracy" in ra:
            assert rb["test_accuracy"] == pytest.approx(ra["test_accuracy"], abs=1e-3)
            assert rb["test_loss"] == pytest.approx(ra["test_loss"], abs=1e-3)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_accuracy"] == b[-1]["test_accuracy"]
