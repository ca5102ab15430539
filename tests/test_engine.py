"""Round engine behaviour with scripted peers: duplicates, rejections, late results, bad tasks."""

from __future__ import annotations

import dataclasses
import struct
import threading
import time

import pytest
import torch

from coordinator.config import load_config
from coordinator.runtime.engine import Coordinator, EvalData, RunError
from coordinator.strategy_setup import make_strategy
from edge_client.client import ClientSettings, EdgeClient, presence_payload
from edge_client.data import load_dataset
from edge_client.models import federated_names
from edge_client.registry import build_model
from edge_client.objectives import LocalData
from edge_client.wire.protocol import PROTOCOL_VERSION, PresenceBody, ResultBody, Topics, decode, encode
from edge_client.wire.transport import InprocHub

SPEC = {"name": "mlp", "hidden": [16], "num_classes": 10, "in_channels": 1, "image_size": 8}


def make_coordinator(tmp_path, hub: InprocHub, *, expected: int, resumed_after: int = 0, **sets) -> Coordinator:
    # The scripted peers below read the weights from the task itself, so no model broadcast.
    overrides = [("clients", "expected", expected), ("clients", "round_timeout", 5.0), ("transport", "kind", "mqtt"),
                 ("transport", "max_decoded_bytes", 200_000), ("codec", "broadcast", False),
                 ("model", "name", "mlp"), ("model", "hidden", [16])]
    overrides += [(*k.split("__"), v) for k, v in sets.items()]
    config = load_config(None, overrides)
    digits = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model(SPEC)
    strategy = make_strategy(config)
    params = {k: v.clone() for k, v in model.state_dict().items() if k in federated_names(model)}
    state = dataclasses.replace(strategy.initialize(SPEC, params), round=resumed_after)
    return Coordinator(config, hub.connect("coordinator"), run_id="run1", out_dir=tmp_path, strategy=strategy,
                       state=state,
                       eval_data=EvalData(torch.from_numpy(digits.x_test), torch.from_numpy(digits.y_test)))


class ScriptedClient(threading.Thread):
    """A peer that answers each task with whatever payloads ``script(task)`` returns."""

    def __init__(self, hub: InprocHub, client_id: str, script) -> None:
        super().__init__(daemon=True)
        self.topics = Topics()
        self.client_id = client_id
        self.script = script
        self.transport = hub.connect(client_id)
        self.acks: list[dict] = []
        self.stop = threading.Event()
        self.transport.subscribe(self.topics.client(client_id, "task"))
        self.transport.subscribe(self.topics.client(client_id, "status"))
        self.transport.publish(self.topics.client(client_id, "presence"),
                               presence_payload(client_id, PresenceBody("online", num_samples=100)), retain=True)

    def result(self, task, tensors=None, **body) -> bytes:
        body = {"num_samples": 10, "metrics": {"train_loss": 1.0}, **body}
        return encode("result", run_id=task.run_id, round=task.round, task_id=task.task_id, sender=self.client_id,
                      body=body, tensors=task.tensors if tensors is None else tensors)

    def run(self) -> None:
        while not self.stop.is_set():
            incoming = self.transport.get(0.1)
            if incoming is None:
                continue
            msg = decode(incoming.payload)
            if msg.kind == "task":
                for payload in self.script(self, msg):
                    self.transport.publish(self.topics.client(self.client_id, "result"), payload)
            elif msg.kind == "status":
                self.acks.append(msg.body)


def test_duplicated_result_is_counted_once(tmp_path):
    hub = InprocHub()
    coord = make_coordinator(tmp_path, hub, expected=2)
    shifted = {}

    def twice(peer, task):
        shifted.update({k: v + 1.0 for k, v in task.tensors.items()})
        payload = peer.result(task, tensors=shifted, num_samples=30)
        return [payload, payload, payload]

    a = ScriptedClient(hub, "a", twice)
    def slow(peer, task):   # answers last, so a's copies arrive while the round is still open
        time.sleep(0.5)
        return [peer.result(task, num_samples=10)]

    b = ScriptedClient(hub, "b", slow)
    before = {k: v.clone() for k, v in coord.state.params.items()}
    for peer in (a, b):
        peer.start()
    coord.wait_for_clients(2, 5)
    row = coord.run_round(1)
    a.stop.set(), b.stop.set()
    assert (row["selected"], row["returned"], row["duplicates"], row["rejected"]) == (2, 2, 2, 0)
    for name, value in coord.state.params.items():  # (30 * (w + 1) + 10 * w) / 40 = w + 0.75
        torch.testing.assert_close(value, before[name] + 0.75)
    assert sum(1 for ack in a.acks if ack["state"] == "ack") == 3   # every copy acknowledged


def test_bad_results_are_rejected_counted_and_do_not_stop_the_round(tmp_path):
    hub = InprocHub()
    coord = make_coordinator(tmp_path, hub, expected=1)

    def bad_then_good(peer, task):
        good = peer.result(task)
        n = struct.unpack("<Q", good[:8])[0]
        current, other = f'\\"v\\":{PROTOCOL_VERSION}'.encode(), f'\\"v\\":{PROTOCOL_VERSION + 1}'.encode()
        wrong_version = good[:8] + good[8:8 + n].replace(current, other) + good[8 + n:]
        assert wrong_version != good
        nan = {k: torch.full_like(v, float("nan")) for k, v in task.tensors.items()}
        small = {k: v[..., :1].contiguous() for k, v in task.tensors.items()}
        yield b"not an envelope at all"                                   # malformed
        yield b"\0" * 300_000                                             # oversized
        yield wrong_version                                               # wrong protocol version
        yield peer.result(task, tensors=nan)                              # non-finite
        yield peer.result(task, tensors=small)                            # wrong shapes
        yield peer.result(task, tensors={k: v.double() for k, v in task.tensors.items()})   # wrong dtype
        yield peer.result(task, num_samples=-3)                           # nonsense weight
        yield peer.result(task, num_samples=101)                          # more samples than it announced
        yield encode("result", run_id=task.run_id, round=task.round, task_id="other", sender="a",
                     body={"num_samples": 1}, tensors=task.tensors)       # a task it was not given
        yield good

    peer = ScriptedClient(hub, "a", bad_then_good)
    peer.start()
    coord.wait_for_clients(1, 5)
    row = coord.run_round(1)
    peer.stop.set()
    assert (row["returned"], row["rejected"], row["unexpected"]) == (1, 8, 1)
    # no rejected result (NaN, wrong shapes or dtype) reached the model, and the row reports the state it ended on
    assert all(bool(torch.isfinite(v).all()) for v in coord.state.params.values())
    assert row["test_accuracy"] == pytest.approx(coord.evaluate()["test_accuracy"])


def test_late_result_from_an_earlier_round_is_ignored_and_counted(tmp_path):
    hub = InprocHub()
    coord = make_coordinator(tmp_path, hub, expected=1)
    stash = []

    def keep_first(peer, task):
        if not stash:
            stash.append(peer.result(task))
            return [stash[0]]
        return [stash[0], peer.result(task)]   # replays round 1's result in round 2

    peer = ScriptedClient(hub, "a", keep_first)
    peer.start()
    coord.wait_for_clients(1, 5)
    coord.run_round(1)
    row = coord.run_round(2)
    peer.stop.set()
    assert (row["returned"], row["late"], row["rejected"]) == (1, 1, 0)


def test_too_few_results_retries_the_round_with_a_fresh_sample(tmp_path):
    hub = InprocHub()
    coord = make_coordinator(tmp_path, hub, expected=2, clients__round_timeout=1.0, clients__per_round=1)
    silent = ScriptedClient(hub, "a", lambda peer, task: [])
    good = ScriptedClient(hub, "b", lambda peer, task: [peer.result(task)])
    for peer in (silent, good):
        peer.start()
    coord.wait_for_clients(2, 5)
    # The seeded sample is [b], then [a] (silent) -> retry with [b], then [b]; round 4 draws [a], whose
    # second miss in a row leaves it out (clients.max_misses = 2): the retry and round 5 take b.
    rows = [coord.run_round(r) for r in range(1, 6)]
    assert [r["returned"] for r in rows] == [1, 1, 1, 1, 1]
    assert [r["attempts"] for r in rows] == [1, 2, 1, 2, 1]
    assert coord.absences.benched("a") and not coord.absences.benched("b")


def test_a_round_whose_every_attempt_gets_too_few_results_ends_the_run(tmp_path):
    hub = InprocHub()
    coord = make_coordinator(tmp_path, hub, expected=1, clients__round_timeout=0.5, clients__max_misses=0)
    silent = ScriptedClient(hub, "a", lambda peer, task: [])
    silent.start()
    coord.wait_for_clients(1, 5)
    with pytest.raises(RunError, match="too few results"):
        coord.run_round(1)


def test_edge_client_survives_bad_tasks_and_still_trains(tmp_path, announce_running, client_thread):
    hub = InprocHub()
    digits = load_dataset("digits")
    settings = ClientSettings(client_id="dev1", state_dir=tmp_path / "state")
    client = EdgeClient(settings, hub.connect("dev1"),
                        LocalData(torch.from_numpy(digits.x_train[:200]), torch.from_numpy(digits.y_train[:200])))
    running = client_thread(client)
    me = hub.connect("coord")
    topics = Topics()
    me.subscribe(topics.client("dev1", "result"))
    announce_running(me)
    model = build_model(SPEC)
    params = {k: v for k, v in model.state_dict().items()}
    body = {"objective": "train", "hyper": {"epochs": 1}, "model": SPEC, "up": sorted(params), "seed": 1,
            "timeout": 30, "resend_every": 30}

    def task(task_id, **changes):
        return encode("task", run_id="r", round=1, task_id=task_id, sender="coordinator",
                      body={**body, **changes.pop("body", {})}, tensors=changes.pop("tensors", params))

    bad = [b"garbage", task("t1", body={"objective": "mine-bitcoin"}),
           task("t2", body={"model": {**SPEC, "name": "resnet9000"}}),
           task("t3", body={"up": ["no.such.param"]}),
           task("t4", tensors={k: v[:1].contiguous() for k, v in params.items()}),
           task("t5", body={"model": {**SPEC, "image_size": 28}}),
           task("t6", body={"hyper": {"lr": -1}})]
    for payload in bad:
        me.publish(topics.client("dev1", "task"), payload)
    me.publish(topics.client("dev1", "task"), task("ok"))
    results = {}
    deadline = time.monotonic() + 30
    while "ok" not in results and time.monotonic() < deadline:
        incoming = me.get(0.5)
        if incoming is not None:
            msg = decode(incoming.payload)
            results[msg.task_id] = msg
    running.stop()
    assert set(results) == {"t1", "t2", "t3", "t4", "t5", "t6", "ok"}
    assert all("error" in results[t].body for t in ("t1", "t2", "t3", "t4", "t5", "t6"))
    ok = results["ok"]
    assert ok.body["num_samples"] == 200 and set(ok.tensors) == set(params)
    assert ok.body["profile"]["steps"] > 0 and ok.body["profile"]["peak_rss_bytes"] > 0
    assert (tmp_path / "state" / "profile.jsonl").is_file()


def test_results_whose_body_does_not_parse_are_rejected_naming_the_field(tmp_path):
    hub = InprocHub()
    coord = make_coordinator(tmp_path, hub, expected=1)

    def bad_bodies_then_good(peer, task):
        yield peer.result(task, metrics="fast")                   # not an object
        yield peer.result(task, num_samples="10")                 # not an integer
        yield peer.result(task, codec="fp8")                      # not a codec
        yield peer.result(task, delta="all")                      # not a list of names
        yield peer.result(task, error=["disk full"])              # a reason that is not a string
        yield peer.result(task)

    peer = ScriptedClient(hub, "a", bad_bodies_then_good)
    peer.start()
    coord.wait_for_clients(1, 5)
    row = coord.run_round(1)
    deadline = time.monotonic() + 10   # the answers to all six are on their way to the peer
    while len(peer.acks) < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    peer.stop.set()
    assert (row["returned"], row["rejected"], row["failed"]) == (1, 5, 0)
    reasons = [ack["reason"] for ack in peer.acks if ack["state"] == "rejected"]
    for name in ("metrics", "num_samples", "codec", "delta", "error"):
        assert any(f"result field '{name}'" in reason for reason in reasons), (name, reasons)


def test_edge_client_answers_tasks_whose_body_does_not_parse_with_an_error_naming_the_field(tmp_path, announce_running, client_thread):
    hub = InprocHub()
    digits = load_dataset("digits")
    client = EdgeClient(ClientSettings(client_id="dev1"), hub.connect("dev1"),
                        LocalData(torch.from_numpy(digits.x_train[:50]), torch.from_numpy(digits.y_train[:50])))
    running = client_thread(client)
    me, topics = hub.connect("coord"), Topics()
    me.subscribe(topics.client("dev1", "result"))
    announce_running(me)
    body = {"objective": "train", "hyper": {"epochs": 1}, "model": SPEC, "up": [], "timeout": 30, "resend_every": 30}
    bad = {"t1": {"timeout": "soon"}, "t2": {"upload": {"codec": "fp8"}}, "t3": {"broadcast": "latest"},
           "t4": {"model": "mlp"}, "t5": {"seed": 1.5}, "t6": {"up": "everything"}}
    me.publish(topics.client("dev1", "status"), encode("status", run_id="r", round=1, task_id="t0",
                                                        sender="coordinator", body={"state": 3}))   # ignored
    for task_id, change in bad.items():
        me.publish(topics.client("dev1", "task"), encode("task", run_id="r", round=1, task_id=task_id,
                                                         sender="coordinator", body={**body, **change}))
    results = {}
    deadline = time.monotonic() + 30
    while len(results) < len(bad) and time.monotonic() < deadline:
        incoming = me.get(0.5)
        if incoming is not None:
            msg = decode(incoming.payload)
            results[msg.task_id] = msg.body
    running.stop()
    assert set(results) == set(bad)
    for task_id, change in bad.items():
        (name,) = change
        assert f"task field '{name}" in results[task_id]["error"], results[task_id]


def test_after_resume_a_result_of_the_interrupted_round_is_late_not_unexpected(tmp_path):
    hub = InprocHub()
    coord = make_coordinator(tmp_path, hub, expected=1, resumed_after=2)
    body = ResultBody(num_samples=5).to_body()
    before = encode("result", run_id="run1", round=3, task_id="given-before", sender="a", body=body)
    forged = encode("result", run_id="run1", round=7, task_id="never-given", sender="a", body=body)
    for _ in range(3):   # re-sent until the acknowledgement reaches the device: counted once
        coord.intake.on_result("a", before, len(before))
    coord.intake.on_result("a", forged, len(forged))
    assert coord.intake.book.tally.counts["late"] == 1 and coord.intake.book.tally.counts["unexpected"] == 1


def test_the_coordinator_holds_a_whole_round_of_chunked_results(tmp_path):
    """Results of a large round arrive together: the bound on incomplete chunked messages is sized to
    hold all of them (clients per round x the float32 model), unless the config sets one."""
    hub = InprocHub()
    coord = make_coordinator(tmp_path, hub, expected=20_000, clients__per_round=20_000,
                             transport__max_decoded_bytes=100_000)
    per_model = coord.fp32_model_bytes
    assert coord.max_partial_bytes == 20_000 * per_model > 64 * 1024 * 1024
    assert coord.transport.reassembler.total_bytes == coord.max_partial_bytes
    fixed = make_coordinator(tmp_path, hub, expected=2, transport__max_partial_bytes=300_000)
    assert fixed.transport.reassembler.total_bytes == 300_000


def test_a_partial_bound_below_the_largest_message_is_refused():
    from coordinator.config import ConfigError
    with pytest.raises(ConfigError, match="max_partial_bytes"):
        load_config(None, [("transport", "max_partial_bytes", 1000)])


def test_a_round_whose_results_all_hold_nan_says_the_model_diverged(tmp_path):
    """Not "raise clients.round_timeout": every result was NaN, which is what a diverged model gives."""
    hub = InprocHub()
    # The scripted peers answer at once: a second is ample for both results to be in when the round ends.
    coord = make_coordinator(tmp_path, hub, expected=2, clients__max_attempts=1, clients__round_timeout=1.0)

    def nan(peer, task):
        return [peer.result(task, tensors={k: torch.full_like(v, float("nan")) for k, v in task.tensors.items()})]

    peers = [ScriptedClient(hub, cid, nan) for cid in ("a", "b")]
    for peer in peers:
        peer.start()
    coord.wait_for_clients(2, 5)
    with pytest.raises(RunError, match="results of 2 client.s. held NaN or infinite values.*aggregate.rule") as err:
        coord.run_round(1)
    for peer in peers:
        peer.stop.set()
    assert "round_timeout" not in str(err.value)


def test_a_non_finite_aggregate_ends_the_run_before_it_is_sent():
    from coordinator.runtime.guards import check_finite
    from storage.state import ServerState

    state = ServerState(params={"fc.weight": torch.tensor([1.0, float("inf")]), "fc.bias": torch.zeros(2)},
                        spec=SPEC, round=3)
    with pytest.raises(RunError, match=r"round 4 \(train\) aggregated to a model with NaN or infinite values in "
                                       r"fc.weight.*aggregate.norm_bound"):
        check_finite(state, 4, "train", "mean")
    check_finite(dataclasses.replace(state, params={"fc.bias": torch.zeros(2)}), 4, "train", "mean")


def test_a_result_from_a_device_that_announced_no_sample_count_is_taken(tmp_path):
    """The sample count is optional in a presence: with none announced there is nothing to hold a result's
    count against (it used to raise TypeError in the coordinator's loop)."""
    from coordinator.runtime.round_book import RoundBook
    from coordinator.strategies.base import TaskPlan

    hub = InprocHub()
    coord = make_coordinator(tmp_path, hub, expected=1)
    assert coord.roster.on_presence("a", presence_payload("a", PresenceBody("online")))
    book = coord.intake.open(RoundBook(round=1, attempt=0))
    coord.intake.issued(book, "t1", TaskPlan("a", "train", {}, coord.state.params, sorted(coord.state.params)))
    result = encode("result", run_id="run1", round=1, task_id="t1", sender="a",
                    body=ResultBody(num_samples=5).to_body(), tensors=dict(coord.state.params))
    coord.intake.on_result("a", result, len(result))
    assert list(book.results) == ["a"] and book.results["a"].num_samples == 5
