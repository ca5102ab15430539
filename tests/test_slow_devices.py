"""Devices slower than ``clients.round_timeout``: their results count in later attempts of the round,
a retry does not restart them, and a late result names the attempt it missed."""

from __future__ import annotations

import logging
import time

import torch

from coordinator.config import load_config
from coordinator.runtime.attempts import Attempts
from coordinator.runtime.round_book import RoundBook
from coordinator.runtime.round_times import RoundTimes
from coordinator.runtime.selection import Absences, Sampler
from coordinator.strategies.base import TaskPlan
from test_engine import ScriptedClient, make_coordinator
from edge_client.wire.transport import InprocHub


def slow(seconds: float, tasks: list):
    """A device that needs ``seconds`` per task and works through its tasks one at a time, as a real one does."""
    def answer(peer, task):
        tasks.append((task.round, task.task_id))
        time.sleep(seconds)
        return [peer.result(task)]
    return answer


def plan(client_id: str) -> TaskPlan:
    return TaskPlan(client_id=client_id, objective="train", hyper={}, down={}, up=[])


def test_a_result_of_an_earlier_attempt_counts_in_the_current_one(tmp_path):
    hub = InprocHub()
    coord = make_coordinator(tmp_path, hub, expected=1, clients__round_timeout=0.6)
    tasks: list = []
    peer = ScriptedClient(hub, "a", slow(0.9, tasks))
    peer.start()
    coord.wait_for_clients(1, 5)
    before = {k: v.clone() for k, v in coord.state.params.items()}
    row = coord.run_round(1)
    peer.stop.set()
    # attempt 1's result came 0.3 s into attempt 2 and was taken there, not thrown away as late
    assert (row["returned"], row["attempts"], row["late"]) == (1, 2, 0)
    # the scripted device sends the weights it got back unchanged: the aggregate is the model it trained from
    assert all(torch.equal(coord.state.params[k], v) for k, v in before.items())


def test_a_retry_waits_for_a_device_still_working_instead_of_restarting_it(tmp_path):
    hub = InprocHub()
    coord = make_coordinator(tmp_path, hub, expected=1, clients__round_timeout=0.4)
    coord.round_times.sent("before", "a", "train", 0.0)   # measured earlier: a task takes it 1 s, 2.5 timeouts
    coord.round_times.answered("before", "a", 1.0)
    tasks: list = []
    peer = ScriptedClient(hub, "a", slow(1.0, tasks))
    peer.start()
    coord.wait_for_clients(1, 5)
    rows = [coord.run_round(r) for r in (1, 2)]
    peer.stop.set()
    # attempt 1 waited 0.8 s (the most: 2 timeouts); attempt 2 gave no new task, as the device was still
    # on its first one, and took its result 0.2 s later
    assert [(r["returned"], r["attempts"], r["late"], r["selected"]) for r in rows] == [(1, 2, 0, 1)] * 2
    assert [r for r, _ in tasks] == [1, 2]


def test_devices_slower_than_the_timeout_finish_the_run(tmp_path):
    """Three devices needing 1.2 to 1.4 timeouts a round, as in the deployment where every attempt ended at the
    timeout with no results and the results that came seconds later were thrown away."""
    hub = InprocHub()
    coord = make_coordinator(tmp_path, hub, expected=3, clients__round_timeout=0.8)
    logs: dict[str, list] = {}
    peers = [ScriptedClient(hub, f"d{i}", slow(s, logs.setdefault(f"d{i}", [])))
             for i, s in enumerate((1.0, 1.05, 1.1))]
    for peer in peers:
        peer.start()
    coord.wait_for_clients(3, 5)
    rows = [coord.run_round(r) for r in range(1, 5)]
    for peer in peers:
        peer.stop.set()
    assert [r["returned"] for r in rows] == [3, 3, 3, 3]
    # once their times are measured, an attempt waits long enough for them (at most 2 timeouts)
    assert all(r["attempts"] <= 2 for r in rows) and rows[-1]["attempts"] == 1
    for tasks in logs.values():   # known slow devices were not restarted in rounds 3 and 4
        assert [r for r, _ in tasks].count(3) == 1 and [r for r, _ in tasks].count(4) == 1


def test_a_late_result_names_the_attempt_it_missed(tmp_path, caplog):
    hub = InprocHub()
    coord = make_coordinator(tmp_path, hub, expected=1)
    stash: list = []

    def replay(peer, task):
        stash.append(peer.result(task))
        return stash[-2:]   # in round 2, round 1's result again, then round 2's

    peer = ScriptedClient(hub, "a", replay)
    peer.start()
    coord.wait_for_clients(1, 5)
    coord.run_round(1)
    with caplog.at_level(logging.WARNING, logger="fedge.coordinator"):
        row = coord.run_round(2)
    peer.stop.set()
    assert row["late"] == 1
    assert "of round 1 attempt 1 is over (the round ended)" in caplog.text


def test_attempts_keep_earlier_plans_and_carry_results_only_within_a_phase():
    attempts = Attempts()
    first = RoundBook(round=2, attempt=0)
    first.plans["t1"] = plan("a")
    first.results["b"] = object()
    attempts.issued("t1", first)
    second = RoundBook(round=2, attempt=1)
    attempts.opened(first, second, carry=True)
    assert attempts.find("t1") == (first, first.plans["t1"])
    assert set(second.results) == {"b"}                    # b's result of attempt 1 still counts
    assert attempts.unanswered(second.answered_by) == {"t1": "a"}
    assert "an aggregation worker holds it" in attempts.why_late("t1", 2)   # refused only as a worker's claim
    other = RoundBook(round=2, attempt=0, phase="evaluate")
    attempts.opened(second, other, carry=True)
    assert attempts.find("t1") is None and not other.results   # another phase: another global state
    assert attempts.why_late("t1", 2) == "task t1 of round 2 attempt 1 is over (the round's train phase ended)"
    attempts.ended_round = 2
    assert attempts.why_late("t1", 2) == "task t1 of round 2 attempt 1 is over (the round ended)"


def test_a_device_is_presumed_working_only_if_it_answered_before_and_within_reason():
    times = RoundTimes()
    times.sent("t0", "a", "train", 0.0)
    assert not times.working("t0", "a", 1.0, timeout=10.0)   # never heard from: maybe gone
    times.answered("t0", "a", 12.0)                          # takes 12 s, timeout 10 s
    times.sent("t1", "a", "train", 20.0)
    assert times.working("t1", "a", 30.0, timeout=10.0)      # the retry at the timeout waits for it
    assert not times.working("t1", "a", 20.0 + 12.0 * 1.25 + 0.1, timeout=10.0)   # long overdue
    assert not times.working("t1", "b", 30.0, timeout=10.0)


def test_an_attempt_waits_longer_for_devices_known_to_need_it_but_not_without_bound():
    times = RoundTimes()
    assert times.deadline([("a", "train")], 10.0) == 10.0            # nothing measured: the timeout
    times.sent("t0", "a", "train", 0.0)
    times.answered("t0", "a", 12.0)
    assert times.deadline([("a", "train"), ("b", "train")], 10.0) == 12.0 * 1.25
    assert times.deadline([("a", "evaluate")], 10.0) == 10.0          # its training time says nothing of this
    times.sent("t1", "a", "train", 0.0)
    times.answered("t1", "a", 100.0)
    assert times.deadline([("a", "train")], 10.0) == 20.0             # at most STRETCH timeouts


def test_a_retry_draws_only_besides_the_clients_it_already_counts_on():
    config = load_config(None, [("clients", "expected", 4), ("clients", "per_round", 3)])
    sampler = Sampler(config, Absences(2), RoundTimes())
    draw = sampler.draw(["a", "b", "c", "d"], 1, 1, taken={"a", "b"})
    assert len(draw.clients) == 1 and not {"a", "b"} & set(draw.clients)
    assert sampler.draw(["a", "b", "c"], 1, 1, taken={"a", "b", "c"}).clients == []
