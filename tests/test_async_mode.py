"""Asynchronous buffered aggregation (run.mode = "async"): in-process runs with devices of different
speeds, a server optimizer, the methods that refuse it, a stop and --resume that lose and repeat no
result, and spawned client processes over Mosquitto. The buffer's arithmetic against FedBuff's formula
is in tests/test_fedbuff.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from coordinator.config import ConfigError, load_config
from coordinator.runtime.async_buffer import AsyncBuffer
from coordinator.runtime.run import RunInterrupted, run_federated
from coordinator.strategy_setup import make_strategy
from edge_client.objectives import train
from storage.checkpoint import latest_checkpoint, load_checkpoint


def async_config(out: Path, **sets):
    """A small in-process digits run in async mode; ``section__key=value`` overrides any key."""
    base = {"run__mode": "async", "run__rounds": 3, "run__out": str(out), "model__name": "mlp", "model__hidden": [16],
            "data__eval": "digits", "clients__expected": 4, "clients__spawn": 4, "transport__kind": "inproc",
            "sim__workers": -1, "export__enabled": False, "async__buffer_size": 2, "clients__presence_timeout": 60.0}
    base.update(sets)
    return load_config(None, [(*key.split("__", 1), value) for key, value in base.items()])


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def slow(seconds: dict[str, float]):
    """Client objectives: the real training, after ``seconds[client]`` of sleep (a slower device)."""
    def objectives(client_id: str):
        def slow_train(model, data, hyper, ctx):
            time.sleep(seconds.get(client_id, 0.0))
            return train(model, data, hyper, ctx)
        return {"train": slow_train}
    return objectives


@pytest.mark.parametrize("setting, message", [
    (("run", "mode", "later"), "run.mode must be one of sync, async"),
    (("async", "concurrency", 9), "async.concurrency must be between 0"),
    (("async", "staleness_exponent", -1.0), "async.staleness_exponent must be >= 0"),
    (("aggregate", "rule", "median"), "run.mode = 'async' needs aggregate.rule = 'mean'"),
])
def test_bad_async_settings_name_the_key(setting, message):
    sets = [("run", "mode", "async"), setting] if setting[1] != "mode" else [setting]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(None, sets)


@pytest.mark.parametrize("strategy, model", [("fedma", {"name": "mlp", "hidden": [16]}), ("spherefed", {}), ("dfl", {}),
                                             ("fed2", {"name": "cnn"})])
def test_methods_that_need_a_whole_phase_refuse_async_mode(strategy, model):
    sets = [("run", "strategy", strategy), ("run", "mode", "async"), ("run", "rounds", 8),
            *(("model", k, v) for k, v in model.items())]
    with pytest.raises(ConfigError, match=rf"run.mode = 'async' cannot run run.strategy = '{strategy}'"):
        make_strategy(load_config(None, sets))


def test_fedavg_in_async_mode_with_a_slow_device(tmp_path):
    """Four devices at once, a version every two results: results of an older version come in with
    their staleness counted, the slow device's too; with max_staleness 1 staler ones are dropped."""
    events: list[dict] = []
    speeds = {"sim-000": 0.3, "sim-001": 0.3, "sim-002": 0.3, "sim-003": 0.6}
    result = run_federated(async_config(tmp_path / "a", run__rounds=6),
                           say=lambda s: None, client_objectives=slow(speeds),
                           on_progress=lambda e: events.append(e) if e["kind"] == "buffered" else None)
    rows = rows_of(result.out_dir)
    assert [r["round"] for r in rows] == list(range(7))
    for row in rows[1:]:
        assert row["results"] == 2 == sum(row["staleness"].values()) and row["in_flight"] <= 4
        assert row["test_accuracy"] is not None and row["dropped_stale"] == 0
    assert any(s != "0" for row in rows[1:] for s in row["staleness"])   # stale results were applied
    from_slow = [e["staleness"] for e in events if e["client"] == "sim-003" and e["version"] > 0]
    assert from_slow and min(from_slow) >= 1   # the slow device's results came a version late or more
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"] + 0.2
    assert len(list((result.out_dir / "clients").glob("*.jsonl"))) == 4   # profile records as in sync mode

    # the three others make about 7 versions a second: the slow device's results come about 6 versions late
    dropped = run_federated(async_config(tmp_path / "b", async__max_staleness=1, run__rounds=12),
                            say=lambda s: None, client_objectives=slow({"sim-003": 0.8, "sim-000": 0.2,
                                                                       "sim-001": 0.2, "sim-002": 0.2}))
    rows = rows_of(dropped.out_dir)
    assert all(set(r["staleness"]) <= {"0", "1"} and r["results"] == 2 for r in rows[1:])
    assert sum(r["dropped_stale"] for r in rows[1:]) >= 1        # the slow device's first result came too late


def test_a_server_optimizer_in_async_mode(tmp_path):
    result = run_federated(async_config(tmp_path, run__strategy="fedadam", run__rounds=2), say=lambda s: None)
    state, _ = load_checkpoint(latest_checkpoint(result.out_dir / "checkpoints"))
    assert state.round == 2 and {f"m/{k}" for k in state.params} <= set(state.buffers)
    assert [r["results"] for r in rows_of(result.out_dir)[1:]] == [2, 2]


def test_a_stop_and_resume_lose_no_result_and_apply_none_twice(tmp_path):
    """The run stops with a result buffered after version 1; the checkpoint keeps it, the resumed run
    applies it, and every result applied over both lifetimes is one the coordinator took once."""
    out, taken = tmp_path / "run", {1: [], 2: []}

    def stop_when_buffered(event):
        if event["kind"] == "buffered":
            taken[1].append(event["task_id"])
            if event["version"] >= 1:
                raise KeyboardInterrupt

    with pytest.raises(RunInterrupted):
        run_federated(async_config(out, run__rounds=4), say=lambda s: None, on_progress=stop_when_buffered)
    state, _ = load_checkpoint(latest_checkpoint(out / "checkpoints"))
    buffered, _, _ = AsyncBuffer.taken_from(state)
    assert state.round >= 1 and buffered.count >= 1
    before = rows_of(out)
    assert sum(r["results"] for r in before[1:]) + buffered.count == len(taken[1])

    result = run_federated(async_config(out, run__rounds=4), resume=True, say=lambda s: None,
                           on_progress=lambda e: taken[2].append(e["task_id"]) if e["kind"] == "buffered" else None)
    rows = rows_of(result.out_dir)
    assert [r["round"] for r in rows] == [0, 1, 2, 3, 4]
    assert sum(r["results"] for r in rows[1:]) == len(taken[1]) + len(taken[2])   # nothing lost, nothing twice
    assert not set(taken[1]) & set(taken[2]) and len(set(taken[1] + taken[2])) == len(taken[1] + taken[2])
    assert rows[state.round + 1]["results"] == 2 and len(taken[2]) == 2 * (4 - state.round) - buffered.count
    records = {json.loads(line)["task_id"] for path in (out / "clients").glob("*.jsonl")
               for line in path.read_text().splitlines()}
    assert set(taken[1] + taken[2]) <= records   # every applied result keeps its profile record across the resume


def test_a_stop_while_a_version_is_evaluated_loses_none_of_its_results(tmp_path):
    """The stop comes after version 2 was made from the buffer and before it was checkpointed (while its
    evaluation runs in line): the checkpoint goes back to version 1 with version 2's results buffered, and
    the resumed run makes version 2 again from them."""
    out, taken = tmp_path / "run", {1: [], 2: []}

    def stop_while_evaluating(event):
        if event["kind"] == "buffered":
            taken[1].append(event["task_id"])
        if event["kind"] == "round" and event["phase"] == "end" and event["round"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(RunInterrupted):
        run_federated(async_config(out, run__rounds=3), say=lambda s: None, on_progress=stop_while_evaluating)
    state, _ = load_checkpoint(latest_checkpoint(out / "checkpoints"))
    buffered, _, _ = AsyncBuffer.taken_from(state)
    assert state.round == 1 and buffered.count >= 2

    result = run_federated(async_config(out, run__rounds=3), resume=True, say=lambda s: None,
                           on_progress=lambda e: taken[2].append(e["task_id"]) if e["kind"] == "buffered" else None)
    rows = rows_of(result.out_dir)
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    assert sum(r["results"] for r in rows[1:]) == len(taken[1]) + len(taken[2])   # nothing lost, nothing twice
    assert not set(taken[1]) & set(taken[2])
    assert all(r["results"] == 2 for r in rows[1:])   # what came during the stop went to the next version


def test_async_mode_with_client_processes_over_mosquitto(tmp_path, mosquitto, prefix):
    config = async_config(tmp_path / "run", transport__kind="mqtt", transport__broker=mosquitto,
                          transport__prefix=prefix, clients__expected=3, clients__spawn=3, run__rounds=3,
                          clients__round_timeout=60.0, codec__up="topk:0.1+int8")
    result = run_federated(config, say=lambda s: None)
    rows = rows_of(result.out_dir)
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    for row in rows[1:]:
        assert row["results"] == 2 and row["rejected"] == 0 and row["failed"] == 0
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"]


def test_a_schedule_sets_the_rate_of_each_version(tmp_path):
    """[schedule] in async mode: the tasks toward version v carry the rate of round v, and its row says so."""
    result = run_federated(async_config(tmp_path, train__lr=0.09, schedule__warmup_rounds=3), say=lambda s: None)
    rows = [r for r in rows_of(result.out_dir) if r["round"] > 0]
    assert [r["train_lr"] for r in rows] == pytest.approx([0.03, 0.06, 0.09])


# The coordinator as its CLI runs it, writing the id of every result it puts into its buffer to a file; with a
# mark path and a version, once that version exists and one acknowledged result waits in the buffer for the
# next, it leaves the mark and waits, so the test can kill it with that result unapplied and tasks in flight.
_COORDINATOR = """
import pathlib, sys, time
from coordinator.runtime.asynchronous import AsyncRun
mark, version, taken = sys.argv.pop(1), int(sys.argv.pop(1)), pathlib.Path(sys.argv.pop(1))
take, harvest = AsyncRun._take, AsyncRun._harvest
def _take(self, task_id, client_id, version, result):
    event = take(self, task_id, client_id, version, result)
    if event is not None:
        with open(taken, "a") as fh:
            fh.write(task_id + "\\n")
    return event
def _harvest(self, report=True):
    harvest(self, report)
    if mark and self.co.state.round >= version and self.buffer.count == 1 and not self.buffer.due():
        pathlib.Path(mark).write_text(str(self.co.state.round))
        time.sleep(120)
AsyncRun._take, AsyncRun._harvest = _take, _harvest
from coordinator.ui.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def _journaled_results(out: Path) -> set[str]:
    """The task ids of the results in the run's async journal."""
    from safetensors import safe_open

    ids = set()
    for path in (out / "async-journal").glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as fh:
            ids.add(json.loads(fh.metadata()["fedge_async_result"])["task_id"])
    return ids


def _journaled_tasks(out: Path) -> set[str]:
    return {json.loads(line)["task_id"] for line in (out / "async-journal" / "tasks.jsonl").read_text().splitlines()}


def test_a_coordinator_killed_twice_with_results_unapplied_applies_each_once(tmp_path, mosquitto, prefix):
    """SIGKILL twice, each time with an acknowledged result buffered after a version (no checkpoint holds it) and
    tasks in flight, the devices running on: each resumed coordinator restores the result from its journal and
    applies the results the devices send to the killed coordinator's tasks; no result is applied twice."""
    import subprocess
    import sys

    import paho.mqtt.client as mqtt
    import psutil
    from paho.mqtt.enums import CallbackAPIVersion

    from edge_client.wire.protocol import ResultBody, decode

    out, rounds, kills = tmp_path / "run", 6, [1, 3]   # the versions after which the coordinator is killed
    cmd = ["run", "--data", "digits", "--model", "mlp", "--set", "model.hidden=[16]",
           "--rounds", str(rounds), "--clients", "3", "--broker", mosquitto, "--seed", "7", "--out", str(out),
           "--set", f"transport.prefix={prefix}", "--set", "run.mode=async", "--set", "async.buffer_size=2",
           "--set", "clients.round_timeout=60", "--set", "export.enabled=false"]
    published: set[str] = set()   # results the devices sent, as anyone on the broker sees them

    def on_message(client, userdata, msg):
        message = decode(msg.payload)
        if ResultBody.from_body(message.body).error is None:
            published.add(message.task_id)

    observer = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"observer-{prefix}")
    observer.on_message = on_message
    host, port = mosquitto.removeprefix("mqtt://").rsplit(":", 1)
    observer.connect(host, int(port))
    observer.subscribe(f"{prefix}/clients/+/result", qos=1)
    observer.loop_start()
    devices = [subprocess.Popen([sys.executable, "-m", "edge_client.cli", "run", "--broker", mosquitto,
                                 "--client-id", f"dev-{i}", "--data", "digits", "--partition", "iid",
                                 "--partition-index", str(i), "--num-partitions", "3", "--seed", "7",
                                 "--state-dir", str(tmp_path / f"dev-{i}"), "--prefix", prefix, "--exit-after-run"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(3)]
    taken = [tmp_path / f"taken-{i}" for i in range(len(kills) + 1)]
    # per kill: the version checkpointed, the journaled results no checkpoint holds, the tasks being trained
    checkpointed, lost, in_flight = [], [], []
    try:
        for session, version in enumerate(kills):
            mark = tmp_path / f"buffered-{session}"
            proc = subprocess.Popen([sys.executable, "-c", _COORDINATOR, str(mark), str(version), str(taken[session]),
                                     *cmd, *(["--resume"] if session else [])],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 180
            while not mark.exists():
                assert proc.poll() is None and time.monotonic() < deadline, f"nothing buffered after version {version}"
                time.sleep(0.05)
            proc.kill()
            proc.wait()
            state, _ = load_checkpoint(latest_checkpoint(out / "checkpoints"))
            assert state.round == int(mark.read_text()) and AsyncBuffer.taken_from(state)[0].count == 0
            checkpointed.append(state.round)
            lost.append(_journaled_results(out))
            assert len(lost[-1]) == 1 and lost[-1] <= set(taken[session].read_text().split())
            given = _journaled_tasks(out) | set(state.extra["async"]["in_flight"])   # since it, and before it
            in_flight.append(given - set(taken[session].read_text().split()))
            assert in_flight[-1]
        resumed = subprocess.run([sys.executable, "-c", _COORDINATOR, "", "0", str(taken[-1]), *cmd, "--resume"],
                                 capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    finally:
        for device in devices:
            device.terminate()
        psutil.wait_procs([psutil.Process(d.pid) for d in devices if d.poll() is None], timeout=30)
        observer.loop_stop()
        observer.disconnect()
    log = (out / "coordinator.log").read_text()
    took = [path.read_text().split() for path in taken]
    records = {json.loads(line)["task_id"] for path in (out / "clients").glob("*.jsonl")
               for line in path.read_text().splitlines()}
    for session, version in enumerate(checkpointed):
        assert f"restored 1 result(s) taken after version {version}'s checkpoint" in log
        assert next(iter(lost[session])) in log
        assert lost[session] <= set(took[session + 1])             # restored by the next coordinator
        answered = in_flight[session] & published
        assert answered and answered <= set(took[session + 1])   # the killed one's tasks: applied, not counted late
        assert answered <= records   # each with its profile record
    everything = [task for session in took for task in session]
    again = {task for task in everything if everything.count(task) > 1}
    assert again == set().union(*lost) and all(everything.count(task) == 2 for task in again)   # only restored ones
    rows = rows_of(out)
    assert [r["round"] for r in rows] == list(range(rounds + 1))
    final, _ = load_checkpoint(latest_checkpoint(out / "checkpoints"))
    applied = sum(r["results"] for r in rows[1:]) + AsyncBuffer.taken_from(final)[0].count
    assert applied == len(set(everything))   # every result taken is applied (or buffered) once
    assert not list((out / "async-journal").glob("*.safetensors"))   # the last checkpoint accounts for them all


def test_the_journal_reads_back_what_it_wrote_and_skips_what_does_not_read(tmp_path, caplog):
    """Results come back bit for bit, in the order taken, after a mark; a damaged file and a torn task line are
    skipped (with a warning for the result); a checkpoint's mark lets the files it accounts for go."""
    import torch

    from coordinator.runtime.async_journal import AsyncJournal
    from coordinator.strategies.base import ClientResult

    deltas = [{"w": torch.randn(3, 4), "b": torch.randn(4, dtype=torch.float64)} for _ in range(2)]
    journal = AsyncJournal(tmp_path, mark=0)
    for i, d in enumerate(deltas):
        assert journal.taken(f"t{i}", 2 + i, ClientResult(f"dev-{i}", 10 + i, {}, {"train_loss": 0.5}, d)) == i + 1
    (journal.dir / "00000003.safetensors").write_bytes(b"not a safetensors file")
    journal.given("t5", "dev-0", 3, 200.0, 100.0)
    with open(journal.dir / "tasks.jsonl", "a") as fh:
        fh.write('{"task_id": "t6", "client_')   # a coordinator killed mid-append
    journal.given("t7", "dev-1", 4, 300.0, 150.0)

    again = AsyncJournal(tmp_path, mark=1)   # a checkpoint accounted for the first result
    assert again.seq == 3                     # numbered after everything on disk
    back = again.results_after(1)
    assert [(r.seq, r.task_id, r.version, r.result.client_id, r.result.num_samples) for r in back] == [
        (2, "t1", 3, "dev-1", 11)]
    assert all(torch.equal(back[0].result.deltas[k], deltas[1][k]) for k in deltas[1])
    assert back[0].result.metrics == {"train_loss": 0.5}
    assert "00000003.safetensors, which does not read as a journaled result" in caplog.text
    assert again.tasks_since(4) == {"t7": ["dev-1", 4, 300.0, 150.0]}
    assert set(again.tasks_since(0)) == {"t5", "t7"}

    again.forget(2, 4)
    assert sorted(p.name for p in again.dir.glob("*.safetensors")) == ["00000003.safetensors"]
    assert set(again.tasks_since(0)) == {"t7"}
