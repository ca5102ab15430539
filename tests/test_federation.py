"""End-to-end runs: real brokers, separate client processes, real digits, real training."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import psutil
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from coordinator.config import load_config
from coordinator.runtime.run import run_federated


def config_for(out: Path, **sets):
    """A small digits run; keyword ``section__key=value`` overrides any key."""
    base = {"run__rounds": 2, "run__out": str(out), "model__name": "cnn", "data__eval": "digits",
            "clients__expected": 3, "clients__spawn": 3, "clients__round_timeout": 60.0,
            "clients__presence_timeout": 60.0, "train__batch_size": 32}
    base.update(sets)
    overrides = [(*key.split("__", 1), value) for key, value in base.items()]
    return load_config(None, overrides)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_finished_run(out: Path, rounds: int, clients: int) -> list[dict]:
    rows = read_metrics(out)
    assert [r["round"] for r in rows] == list(range(rounds + 1))
    for key in ("test_accuracy", "test_loss", "selected", "returned", "late", "rejected", "bytes_down",
                "bytes_up", "seconds"):
        assert key in rows[-1], key
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"] + 0.2
    assert (out / "config.toml").is_file() and (out / "summary.json").is_file()
    assert (out / "checkpoints" / f"round_{rounds:04d}.safetensors").is_file()
    assert len(list((out / "clients").glob("*.json"))) == clients
    return rows


def test_three_clients_over_mosquitto(tmp_path, mosquitto, prefix):
    config = config_for(tmp_path / "run", transport__broker=mosquitto, transport__prefix=prefix)
    result = run_federated(config, say=lambda s: None)
    rows = check_finished_run(result.out_dir, rounds=2, clients=3)
    for row in rows[1:]:
        assert (row["selected"], row["returned"], row["rejected"], row["late"]) == (3, 3, 0, 0)
        model_bytes = 53_194 * 4   # the float32 cnn on 8x8 digits goes down once, as the broadcast
        assert model_bytes < row["bytes_broadcast"] < row["bytes_down"] < 1.1 * model_bytes
        assert row["bytes_up"] > 3 * model_bytes
    assert result.summary["final_accuracy"] == rows[-1]["test_accuracy"]


def test_three_clients_over_embedded_broker(tmp_path, prefix):
    config = config_for(tmp_path / "run", transport__prefix=prefix)
    said = []
    result = run_federated(config, say=said.append)
    assert any("embedded MQTT broker" in s for s in said)
    rows = check_finished_run(result.out_dir, rounds=2, clients=3)
    assert all(r["returned"] == 3 for r in rows[1:])


def test_inproc_transport_counts_the_same_bytes(tmp_path, mosquitto, prefix):
    """The in-process transport goes through the same encoder, so bytes are counted alike.

    Messages differ only by a few header bytes (deadline timestamps, profile numbers).
    """
    a = run_federated(config_for(tmp_path / "a", transport__kind="inproc", run__rounds=1), say=lambda s: None)
    b = run_federated(config_for(tmp_path / "b", transport__broker=mosquitto, transport__prefix=prefix,
                                 run__rounds=1), say=lambda s: None)
    ra, rb = read_metrics(a.out_dir)[1], read_metrics(b.out_dir)[1]
    assert abs(ra["bytes_down"] - rb["bytes_down"]) <= 3 * 64
    assert abs(ra["bytes_up"] - rb["bytes_up"]) < 3 * 4096  # profile JSON in the body varies a little
    assert ra["test_accuracy"] == pytest.approx(rb["test_accuracy"], abs=1e-6)


def _watch_tasks(url: str, topic: str, seen: threading.Event) -> mqtt.Client:
    host, port = url.removeprefix("mqtt://").split(":")
    watcher = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    watcher.on_message = lambda c, u, m: seen.set()
    watcher.on_connect = lambda c, u, f, r, p: c.subscribe(topic, qos=1)
    watcher.connect(host, int(port))
    watcher.loop_start()
    return watcher


def test_client_killed_mid_round_lets_the_round_finish_at_the_deadline(tmp_path, mosquitto, prefix):
    config = config_for(tmp_path / "run", transport__broker=mosquitto, transport__prefix=prefix,
                        clients__min_results=2, clients__round_timeout=8.0, train__epochs=10)
    got_task = threading.Event()
    watcher = _watch_tasks(mosquitto, f"{prefix}/clients/sim-002/task", got_task)
    killed = []

    def kill_when_task_arrives() -> None:
        if got_task.wait(60):
            me = psutil.Process()
            for child in me.children():
                if "sim-002" in " ".join(child.cmdline()):
                    child.kill()
                    killed.append(child.pid)

    killer = threading.Thread(target=kill_when_task_arrives, daemon=True)
    killer.start()
    started = time.monotonic()
    result = run_federated(config, say=lambda s: None)
    watcher.loop_stop()
    assert killed, "the client was never killed"
    rows = read_metrics(result.out_dir)
    assert (rows[1]["selected"], rows[1]["returned"]) == (3, 2)
    assert rows[1]["seconds"] >= 7.5          # it waited for the deadline
    assert (rows[2]["selected"], rows[2]["returned"]) == (2, 2)   # the dead client is no longer sampled
    assert rows[2]["test_accuracy"] > rows[0]["test_accuracy"]
    assert time.monotonic() - started < 120


RESUME_CLIENTS = 2   # client processes of the kill-and-resume runs


def _coordinator_cmd(out: Path, broker: str, prefix: str, rounds: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "coordinator.ui.cli", "run", "--data", "digits", "--model", "cnn",
            "--rounds", str(rounds), "--clients", str(RESUME_CLIENTS), "--spawn-clients", str(RESUME_CLIENTS),
            "--broker", broker,
            "--seed", "7", "--out", str(out), "--set", f"transport.prefix={prefix}",
            "--set", "train.epochs=2", *extra]


@pytest.fixture(scope="module")
def uninterrupted_rows(tmp_path_factory, mosquitto) -> list[dict]:
    """The rows of the 4-round run the kill-and-resume tests must reproduce."""
    out = tmp_path_factory.mktemp("uninterrupted")
    ref = subprocess.run(_coordinator_cmd(out / "run", mosquitto, f"ref-{time.monotonic_ns()}", 4),
                         capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    return read_metrics(out / "run")


def test_resume_after_kill_matches_uninterrupted_run(tmp_path, mosquitto, prefix, kill_after_checkpoint,
                                                    uninterrupted_rows):
    rounds = 4

    out = tmp_path / "resumed"
    proc = subprocess.Popen(_coordinator_cmd(out, mosquitto, prefix, rounds), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    kill_after_checkpoint(proc, out, 2)
    done_before = [r["round"] for r in read_metrics(out)]
    assert max(done_before) < rounds

    resumed = subprocess.run(_coordinator_cmd(out, mosquitto, prefix, rounds, "--resume"),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming run" in resumed.stdout
    session = json.loads((out / "summary.json").read_text())["this_session"]
    assert session["resumed_after_round"] == max(done_before) and session["rounds"] == rounds - max(done_before)
    a, b = uninterrupted_rows, read_metrics(out)
    assert [r["round"] for r in b] == list(range(rounds + 1))
    for ra, rb in zip(a, b):
        assert rb["test_accuracy"] == pytest.approx(ra["test_accuracy"], abs=1e-3)
        assert rb["test_loss"] == pytest.approx(ra["test_loss"], abs=1e-3)


# The coordinator as its CLI runs it, except that aggregating round 3 first leaves a mark and
# waits, so the test can kill it in the middle of aggregation.
_SLOW_AGGREGATION = """
import pathlib, sys, time
from coordinator.strategies.fedavg import FedAvg
mark = pathlib.Path(sys.argv.pop(1))
original = FedAvg.aggregate_train
def aggregate_train(self, round, state, results, *partial):
    if round == 3:
        mark.write_text(str(len(results)))
        time.sleep(120)
    return original(self, round, state, results, *partial)
FedAvg.aggregate_train = aggregate_train
from coordinator.ui.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def _kill_at_mark(program: str, mark: Path, cmd: list[str], never: str) -> None:
    """Run the coordinator's ``cmd`` under ``program`` and SIGKILL it (its spawned clients left to end) once it
    writes ``mark``; ``never``: what failed when it does not within 3 minutes."""
    proc = subprocess.Popen([sys.executable, "-c", program, str(mark), *cmd[3:]],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while not mark.exists():
        assert proc.poll() is None and time.monotonic() < deadline, never
        time.sleep(0.05)
    children = psutil.Process(proc.pid).children()
    proc.kill()
    proc.wait()
    psutil.wait_procs(children, timeout=30)


def test_coordinator_killed_during_aggregation_resumes_to_the_same_rows(tmp_path, mosquitto, prefix,
                                                                       uninterrupted_rows):
    rounds = 4

    out, mark = tmp_path / "killed", tmp_path / "aggregating"
    cmd = _coordinator_cmd(out, mosquitto, prefix, rounds)
    _kill_at_mark(_SLOW_AGGREGATION, mark, cmd, "the coordinator never aggregated round 3")
    assert mark.read_text() == str(RESUME_CLIENTS)      # every result of round 3 was in
    assert [r["round"] for r in read_metrics(out)] == [0, 1, 2]
    assert not (out / "checkpoints" / "round_0003.safetensors").exists()

    resumed = subprocess.run(_coordinator_cmd(out, mosquitto, prefix, rounds, "--resume"),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    a, b = uninterrupted_rows, read_metrics(out)
    assert [r["round"] for r in b] == list(range(rounds + 1))
    for ra, rb in zip(a, b):
        assert rb["test_accuracy"] == pytest.approx(ra["test_accuracy"], abs=1e-3)
        assert rb["test_loss"] == pytest.approx(ra["test_loss"], abs=1e-3)


# The coordinator as its CLI runs it, except that the evaluation of round 2 first leaves a mark and waits (as
# a slow evaluation outlasts the next round), so the test can kill it after the aggregate, before the evaluation.
_SLOW_EVALUATION = """
import pathlib, sys, time
from coordinator.strategies.fedavg import FedAvg
mark = pathlib.Path(sys.argv.pop(1))
original = FedAvg.evaluate
def evaluate(self, state, model, x, y):
    if state.round == 2:
        mark.write_text("evaluating")
        time.sleep(120)
    return original(self, state, model, x, y)
FedAvg.evaluate = evaluate
from coordinator.ui.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def test_coordinator_killed_before_an_evaluation_finished_resumes_from_that_round(tmp_path, mosquitto, prefix,
                                                                                  uninterrupted_rows):
    """SIGKILL after round 2's aggregate and before its evaluation finished: round 2 is checkpointed, its row
    pending; the resumed run evaluates it again, goes on from round 2, and its rows are the unbroken run's."""
    rounds = 4

    out, mark = tmp_path / "killed", tmp_path / "evaluating"
    cmd = _coordinator_cmd(out, mosquitto, prefix, rounds)
    _kill_at_mark(_SLOW_EVALUATION, mark, cmd, "the coordinator never evaluated round 2")
    assert (out / "checkpoints" / "round_0002.safetensors").exists()
    left = read_metrics(out)
    assert left[2]["round"] == 2 and left[2]["evaluation"] == "pending" and "test_accuracy" not in left[2]

    resumed = subprocess.run(_coordinator_cmd(out, mosquitto, prefix, rounds, "--resume"),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    session = json.loads((out / "summary.json").read_text())["this_session"]
    assert session["resumed_after_round"] == max(r["round"] for r in left) >= 2
    a, b = uninterrupted_rows, read_metrics(out)
    assert [r["round"] for r in b] == list(range(rounds + 1))
    assert all("evaluation" not in r for r in b)
    for ra, rb in zip(a, b):
        assert rb["test_accuracy"] == pytest.approx(ra["test_accuracy"], abs=1e-3)
        assert rb["test_loss"] == pytest.approx(ra["test_loss"], abs=1e-3)


def test_demo_command_help_and_bad_input(tmp_path):
    for args in (["--help"], ["run", "--help"], ["demo", "--help"]):
        out = subprocess.run([sys.executable, "-m", "coordinator.ui.cli", *args], capture_output=True, text=True)
        assert out.returncode == 0 and "usage" in out.stdout
    out = subprocess.run([sys.executable, "-m", "edge_client.cli", "run", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--state-dir" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "coordinator.ui.cli", "run", "--data", "npz:/nonexistent.npz",
                          "--spawn-clients", "1", "--clients", "1", "--transport", "inproc", "--out",
                          str(tmp_path / "x")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "nonexistent.npz" in bad.stdout
    bad = subprocess.run([sys.executable, "-m", "coordinator.ui.cli", "run", "--set", "train.lr=", "--out",
                          str(tmp_path / "y")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "train.lr" in bad.stdout


def test_personalized_evaluation_reports_local_accuracy(tmp_path):
    config = config_for(tmp_path / "run", transport__kind="inproc", data__partition="shards:2",
                        data__local_test_fraction=0.25, eval__personalized=True, eval__finetune_epochs=1)
    result = run_federated(config, say=lambda s: None)
    rows = read_metrics(result.out_dir)
    for row in rows[1:]:
        assert row["evaluate_returned"] == 3 and row["personalized_clients"] == 3
        assert 0 <= row["personalized_accuracy_min"] <= row["personalized_accuracy_mean"] <= 1
        # the variance of n accuracies <= 1 with this mean and minimum: no less than with the other n - 1
        # all equal, no more than (1 - mean)(mean - min) (Bhatia-Davis)
        mean, low, std = (row[f"personalized_accuracy_{k}"] for k in ("mean", "min", "std"))
        n = row["personalized_clients"]
        assert (mean - low) ** 2 / (n - 1) - 1e-9 <= std ** 2 <= (1 - mean) * (mean - low) + 1e-9
    # two classes per client and a fine-tuning epoch: local accuracy beats the global model's
    assert rows[-1]["personalized_accuracy_mean"] > rows[-1]["test_accuracy"]
