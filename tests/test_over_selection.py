"""Over-selection (``clients.over_select``): a round draws more devices than it counts, closes at
``clients.per_round`` results, tells the others their tasks closed, and counts their results as late."""

from __future__ import annotations

import json
import time

import pytest
import torch

from coordinator.config import load_config
from coordinator.errors import ConfigError
from coordinator.privacy import CentralPrivacy
from test_engine import ScriptedClient, make_coordinator
from edge_client.wire.transport import InprocHub

SLOW, FAST = ("a", "b", "c"), ("d", "e", "f")   # the slow ones first: under aggregate.order = "sorted" the fast
                                                # results are held behind them until the round closes


def answer(seconds: float, shift: float, tasks: list):
    """A device that takes ``seconds`` a task, one at a time, and sends the weights it got plus ``shift``."""
    def script(peer, task):
        tasks.append((task.round, task.task_id))
        time.sleep(seconds)
        return [peer.result(task, tensors={k: v + shift for k, v in task.tensors.items()})]
    return script


@pytest.mark.parametrize("order", ["arrival", "sorted"])
def test_a_round_closes_at_per_round_results_and_the_rest_count_as_late(tmp_path, order):
    hub = InprocHub()
    coord = make_coordinator(tmp_path, hub, expected=6, clients__per_round=3, clients__over_select=2.0,
                             aggregate__order=order)
    assert coord.config.drawn_per_round == 6 and coord._streams("train")   # results are folded as they come
    tasks: dict[str, list] = {c: [] for c in SLOW + FAST}
    # A slow device's result would move the model by 100: if any were aggregated, the check below would see it.
    peers = {c: ScriptedClient(hub, c, answer(0.8 if c in SLOW else 0.0, 100.0 if c in SLOW else 1.0, tasks[c]))
             for c in SLOW + FAST}
    for peer in peers.values():
        peer.start()
    coord.wait_for_clients(6, 5)
    before = {k: v.clone() for k, v in coord.state.params.items()}
    started = time.monotonic()
    rows = [coord.run_round(r) for r in (1, 2)]
    seconds = time.monotonic() - started
    coord.pump(time.monotonic() + 3.0, lambda: coord.intake.book.tally.counts.get("late_closed", 0) >= 6)
    strays = coord.intake.book.tally.counts
    deadline = time.monotonic() + 3.0   # the last acknowledgements are on their way to the devices
    while time.monotonic() < deadline and any(len(peers[c].acks) < 4 for c in SLOW):
        time.sleep(0.05)
    for peer in peers.values():
        peer.stop.set()

    for row in rows:   # every round drew all six, counted the three fast ones and closed without the slow ones
        assert (row["selected"], row["returned"], row["counted"], row["closed_early"]) == (6, 3, 3, True)
        assert row["closed_clients"] == list(SLOW) and row["failed"] == 0
    assert seconds < 5.0 * 2   # neither round waited for its timeout (5 s)
    for name, value in coord.state.params.items():   # two rounds of the fast devices' +1, nothing of the +100
        torch.testing.assert_close(value, before[name] + 2.0)
    # Each slow device trained one task per round it was drawn in (none re-sent), was told each closed, and had
    # each late result acknowledged once and counted once: late_closed, never a failure or a duplicate.
    late = sum(r.get("late_closed", 0) for r in rows) + strays.get("late_closed", 0)
    assert late == 6 and sum(r["late"] for r in rows) + strays["late"] == 6
    assert sum(r["duplicates"] for r in rows) + strays["duplicates"] == 0
    for c in SLOW:
        assert [r for r, _ in tasks[c]] == [1, 2]
        states = [ack["state"] for ack in peers[c].acks]
        assert states.count("closed") == 2 and states.count("ack") == 2
    for c in FAST:
        assert [ack["state"] for ack in peers[c].acks] == ["ack", "ack"]


def test_without_over_selection_rows_are_as_before(tmp_path):
    hub = InprocHub()
    coord = make_coordinator(tmp_path, hub, expected=2)
    assert coord.config.drawn_per_round == 2 and not coord.config.closes_early
    peers = [ScriptedClient(hub, c, answer(0.0, 1.0, [])) for c in ("a", "b")]
    for peer in peers:
        peer.start()
    coord.wait_for_clients(2, 5)
    row = coord.run_round(1)
    for peer in peers:
        peer.stop.set()
    assert not {"counted", "closed_early", "closed_clients", "late_closed"} & row.keys()


def config(**sets):
    return load_config(None, [(*k.split("__"), v) for k, v in sets.items()])


def test_the_draw_is_per_round_times_over_select_rounded_up_and_bounded_by_the_fleet():
    assert config(clients__expected=20, clients__per_round=10, clients__over_select=1.3).drawn_per_round == 13
    assert config(clients__expected=20, clients__per_round=7, clients__over_select=1.3).drawn_per_round == 10
    assert config(clients__expected=12, clients__per_round=10, clients__over_select=1.3).drawn_per_round == 12
    assert config(clients__expected=12, clients__per_round=10).drawn_per_round == 10


@pytest.mark.parametrize(("sets", "says"), [
    ({"clients__over_select": 0.5}, "clients.over_select must be a number >= 1.0"),
    ({"run__strategy": "fedma"}, "matching a layer's neurons needs every client's layer at once"),
    ({"run__strategy": "spherefed"}, "FFC calibration"),
    ({"run__mode": "async"}, "run.mode = 'sync'"),
    ({"secagg__enabled": True, "clients__per_round": 3, "secagg__threshold": 3}, "more than 3 must advertise"),
    ({"privacy__mode": "central"}, "privacy.sampling = 'fixed' or 'seeded'"),
    ({"clients__expected": 4}, "set clients.expected to at least 6"),   # the draw's cap: nothing over-selected
])
def test_what_cannot_close_a_round_early_is_refused_naming_why(sets, says):
    with pytest.raises(ConfigError, match="over_select") as caught:
        config(**{"clients__expected": 10, "clients__per_round": 4, "clients__over_select": 1.5, **sets})
    assert says in str(caught.value)


def test_central_dp_divides_by_the_results_counted_and_accounts_the_rate_of_being_drawn():
    c = config(clients__expected=20, clients__per_round=4, clients__over_select=1.5, privacy__mode="central",
               privacy__sampling="fixed", clients__max_attempts=1)
    privacy = CentralPrivacy.from_config(c)
    # the noise on the mean is z C / 4 (four results are summed); a fast device is counted whenever it is drawn,
    # which is 6 of 20 draws
    assert privacy.per_round == 4 and privacy.sampling_rate == pytest.approx(6 / 20)


def test_a_secure_round_takes_the_drawn_devices_as_its_cohort_and_closes_at_per_round_keys(tmp_path, monkeypatch):
    """Five drawn into the secure round, one of them slow: the advertise stage closes at four keys, the slow
    device is told its task closed and counts as dropped before sharing, and the four survivors' sum is released."""
    from coordinator.ops.spawn import sim_client_id
    from coordinator.runtime.run import run_federated
    from edge_client.client import EdgeClient

    slow_id, execute = sim_client_id(4), EdgeClient._execute

    def slow(self, *args, **kwargs):
        if self.settings.client_id == slow_id:
            time.sleep(1.5)
        return execute(self, *args, **kwargs)

    monkeypatch.setattr(EdgeClient, "_execute", slow)
    sets = {"run.rounds": 2, "clients.expected": 5, "clients.spawn": 5, "clients.per_round": 4,
            "clients.over_select": 1.25, "clients.max_attempts": 1, "transport.kind": "inproc", "secagg.enabled": True,
            "model.name": "mlp", "model.hidden": [16], "export.enabled": False, "run.out": str(tmp_path)}
    result = run_federated(load_config(None, [(*k.split(".", 1), v) for k, v in sets.items()]), say=lambda s: None)
    rows = [json.loads(line) for line in (result.out_dir / "metrics.jsonl").read_text().splitlines()]
    for row in [r for r in rows if r["round"] > 0]:
        assert (row["secagg_clients"], row["secagg_advertise_answers"], row["secagg_survivors"]) == (5, 4, 4), row
        assert (row["selected"], row["counted"], row["closed_early"], row["closed_clients"]) == (5, 4, True, [slow_id])
    assert sum(r.get("late_closed", 0) for r in rows) == sum(r.get("late", 0) for r in rows) <= 2
