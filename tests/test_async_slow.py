"""Slow devices in async mode (async.slow, coordinator/runtime/async_pace.py): the prediction of how stale
a device's next result will be, the policy's decision, and in-process runs with one device eight times
slower per step than the others, under each policy."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from coordinator.config import ConfigError, load_config
from coordinator.runtime.async_pace import MARGIN, PROBE_EVERY, PaceBook, VersionClock, task_steps
from coordinator.runtime.run import run_federated
from coordinator.runtime.run_summary import contributions
from coordinator.ui.status_cli import read_run_dir
from edge_client.hyper import ObjectiveError, TrainHyper
from edge_client.objectives import LocalData, TaskContext, train
from profiling.profiler import Profiler
from profiling.report import device_table
from profiling.runs import load

HYPER = {"epochs": 1, "batch_size": 10, "lr": 0.05}


def clock_at(rate: float, versions: int = 8) -> VersionClock:
    """A clock that made ``versions`` versions at ``rate`` per second, the last one at time ``versions / rate``."""
    clock = VersionClock(0.0)
    for v in range(1, versions + 1):
        clock.made(v / rate)
    return clock


def test_task_steps_counts_epochs_of_mini_batches_up_to_the_cap():
    assert task_steps(HYPER, 95) == 10
    assert task_steps({**HYPER, "epochs": 3}, 100) == 30
    assert task_steps({**HYPER, "epochs": 3, "max_steps": 4}, 100) == 4
    assert task_steps({**HYPER, "max_steps": 40}, 100) == 10


def test_the_prediction_is_the_version_rate_times_the_task_time():
    book = PaceBook("shorten", 3, clock_at(rate=10.0))   # a version every 0.1 s, the last at t = 0.8
    assert book.expected("c", 0.8) is None                 # never heard from: not predicted
    book.answered("c", HYPER, 100, seconds=2.0)            # 10 steps in 2 s: 0.2 s a step
    assert book.expected("c", 0.8) == pytest.approx(20.0)  # 2 s at 10 versions a second
    assert book.expected("c", 0.8, steps=1) == pytest.approx(2.0)
    book.answered("c", {**HYPER, "max_steps": 2}, 100, seconds=0.6)   # a shortened task: 0.3 s a step
    book.answered("c", {**HYPER, "max_steps": 2}, 100, seconds=0.5)
    assert book.expected("c", 0.8) == pytest.approx(10 * 0.25 * 10)    # the median of the last three per step
    assert book.expected("c", 1.6) == pytest.approx(12.5)              # no version for 0.8 s: the rate halves


def test_each_policy_decides_for_a_device_predicted_too_stale():
    def book(policy: str, limit: int = 3) -> PaceBook:
        b = PaceBook(policy, limit, clock_at(rate=10.0))
        b.answered("slow", HYPER, 100, seconds=2.0)   # 20 versions behind
        b.answered("fast", HYPER, 100, seconds=0.2)   # 2 versions behind
        return b

    for policy in ("send", "shorten", "rest"):
        assert book(policy).pace("fast", 5, 0.8).action == "send"
        assert book(policy, limit=0).pace("slow", 5, 0.8).action == "send"   # no limit: nothing is dropped
    assert book("send").pace("slow", 5, 0.8).action == "send"

    short = book("shorten").pace("slow", 5, 0.8)
    assert (short.action, short.max_steps) == ("shorten", int(MARGIN * 3 / 2.0))   # 2 versions a step: 1 step
    assert short.predicted == pytest.approx(2.0) and short.predicted <= 3

    rest = book("rest")
    pace = rest.pace("slow", 5, 0.8)
    assert pace.action == "rest" and pace.predicted == pytest.approx(20.0)
    assert "resting slow" in rest.rested("slow", pace, 5) and rest.rested("slow", pace, 6) == ""   # said once
    assert rest.resting() == ["slow"]
    assert rest.pace("slow", 5 + PROBE_EVERY * 3 - 1, 0.8).action == "rest"
    probe = rest.pace("slow", 5 + PROBE_EVERY * 3, 0.8)
    assert probe.probe and probe.action == "send"          # the full task, to measure it anew
    rest.given("slow", probe, 17, 0.8)
    rest.answered("slow", HYPER, 100, seconds=2.0)         # still slow: it rests as long again from its answer
    assert rest.rested("slow", rest.pace("slow", 30, 0.8), 30) == ""   # not said again
    assert rest.pace("slow", 30 + PROBE_EVERY * 3 - 1, 0.8).action == "rest"
    assert rest.pace("slow", 30 + PROBE_EVERY * 3, 0.8).probe
    rest.answered("slow", HYPER, 100, seconds=0.2)          # it got faster
    rest.answered("slow", HYPER, 100, seconds=0.2)
    back = rest.pace("slow", 31, 0.8)
    assert back.action == "send" and "given tasks again" in rest.given("slow", back, 31, 0.8)
    assert rest.resting() == []

    tight = book("shorten", limit=1)   # not even one step (2 versions) arrives within 1: rested, probed with one
    assert tight.pace("slow", 5, 0.8).action == "rest"
    tight.rested("slow", tight.pace("slow", 5, 0.8), 5)
    probe = tight.pace("slow", 5 + PROBE_EVERY, 0.8)
    assert (probe.action, probe.max_steps, probe.probe) == ("shorten", 1, True)


def test_a_task_capped_in_steps_trains_that_many_and_a_bad_cap_is_refused():
    data = LocalData(torch.randn(95, 4), torch.randint(0, 3, (95,)))
    for cap, steps in ((0, 20), (3, 3), (12, 12), (50, 20)):   # two epochs of 10 mini-batches, or the cap
        profiler = Profiler()
        out = train(torch.nn.Linear(4, 3), data, {**HYPER, "epochs": 2, "max_steps": cap},
                    TaskContext(0, 1, "pi", None, profiler))
        assert profiler.summary()["steps"] == steps and out.num_samples == 95
        assert out.metrics["train_loss_sq"] > 0   # over the last epoch's worth of the steps it ran
    with pytest.raises(ObjectiveError):
        TrainHyper.from_dict({**HYPER, "max_steps": -1})
    assert TrainHyper.from_dict({**HYPER, "max_steps": 3}).max_steps == 3
    with pytest.raises(ConfigError, match="async.slow must be one of shorten, rest, send"):
        load_config(None, [("run", "mode", "async"), ("async", "slow", "later")])


def test_the_summary_adds_up_each_device_over_the_rows():
    def row(a: dict, b: dict) -> dict:
        zero = {"counted": 0, "dropped": 0, "shortened": 0, "rested": 0, "weight": 0.0}
        return {"contributions": {"a": {**zero, **a}, "b": {**zero, **b}}}

    rows = [{"round": 0}, {"round": 1, **row({"counted": 2, "weight": 1.5}, {"dropped": 1, "shortened": 1})},
            {"round": 2,
             **row({"counted": 1, "weight": 0.5}, {"counted": 1, "shortened": 1, "rested": 2, "weight": 0.5})}]
    assert contributions(rows) == {
        "a": {"counted": 3, "dropped": 0, "shortened": 0, "rested": 0, "weight_share": 0.8},
        "b": {"counted": 1, "dropped": 1, "shortened": 2, "rested": 2, "weight_share": pytest.approx(0.2)}}
    assert contributions([{"round": 0}, {"round": 1}]) == {}   # a sync run's rows say nothing of it


# -- runs --------------------------------------------------------------------------------------------
SLOW, STEP = "sim-003", {"sim-003": 0.08}   # seconds of sleep per local step: a device eight times slower
FAST_STEP = 0.01


def per_step(seconds: dict[str, float], default: float):
    """Client objectives: the real training, each local step slowed by ``seconds[client]`` (a CPU quota)."""
    def objectives(client_id: str):
        pause = seconds.get(client_id, default)

        def slowed(scores, labels):
            time.sleep(pause)
            return F.cross_entropy(scores, labels)

        def slow_train(model, data, hyper, ctx):
            return train(model, data, hyper, ctx, criterion=slowed)
        return {"train": slow_train}
    return objectives


def slow_run(out: Path, policy: str, **sets):
    base = {"run__mode": "async", "run__rounds": 40, "run__out": str(out), "model__name": "mlp",
            "model__hidden": [16], "data__eval": "digits", "clients__expected": 4, "clients__spawn": 4,
            "transport__kind": "inproc", "sim__workers": -1, "export__enabled": False, "async__buffer_size": 2,
            "async__max_staleness": 3, "async__slow": policy, "eval__every": 40, "clients__presence_timeout": 60.0}
    base.update(sets)
    config = load_config(None, [(*key.split("__", 1), value) for key, value in base.items()])
    result = run_federated(config, say=lambda s: None, client_objectives=per_step(STEP, FAST_STEP))
    rows = [json.loads(line) for line in (result.out_dir / "metrics.jsonl").read_text().splitlines()]
    return result, rows


def test_send_drops_every_result_of_the_slow_device(tmp_path):
    """Today's rule: the slow device trains the whole run, and none of its results counts."""
    result, rows = slow_run(tmp_path, "send")
    mine = result.summary["contributions"][SLOW]
    assert mine["counted"] == 0 and mine["dropped"] >= 2 and mine["weight_share"] == 0.0
    assert mine["shortened"] == mine["rested"] == 0
    assert all(r["dropped_stale"] == sum(c["dropped"] for c in r["contributions"].values()) for r in rows[1:])
    shares = [c["weight_share"] for c in result.summary["contributions"].values()]
    assert sum(shares) == pytest.approx(1.0)


def test_shorten_makes_the_slow_device_count(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="fedge.coordinator")
    result, rows = slow_run(tmp_path, "shorten")
    mine = result.summary["contributions"][SLOW]
    assert mine["shortened"] >= 3 and mine["counted"] >= 3 and mine["weight_share"] > 0.05
    assert mine["counted"] > mine["dropped"]
    assert read_run_dir(result.out_dir)["devices"][SLOW]["contribution"] == mine   # fedge-coordinator status
    records = load(result.out_dir)                                                   # fedge-profile show
    table = device_table(records, records.stats())
    cells = {row[1]: row[-1] for row in table.rows}
    assert table.columns[-1] == "counted" and cells[SLOW].startswith(f"{mine['counted']}/")
    said = [r.message for r in caplog.records if r.message.startswith(f"shortening {SLOW}'s tasks")]
    assert len(said) == 1
    assert all(r["results"] == 2 for r in rows[1:])


def test_rest_stops_sending_and_says_so(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="fedge.coordinator")
    result, rows = slow_run(tmp_path, "rest")
    mine = result.summary["contributions"][SLOW]
    assert mine["rested"] >= 15 and mine["shortened"] == 0
    # its first task, then a probe after every PROBE_EVERY x max_staleness versions of rest
    assert 1 <= mine["counted"] + mine["dropped"] <= 1 + 40 // (PROBE_EVERY * 3)
    assert len([r for r in caplog.records if r.message.startswith(f"resting {SLOW}")]) >= 1
    assert all(r["results"] == 2 for r in rows[1:])
