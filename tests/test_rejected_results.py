"""Results the coordinator refuses: the device is told why, the round does not wait for it, and a device
whose results keep being refused is benched for that; a device's claimed weight is bounded; a device
announcing itself in a loop does not get its task again and again."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
import torch

from coordinator.config import load_config
from coordinator.runtime.run import run_federated
from coordinator.runtime.selection import Absences
from coordinator.runtime.weights import WeightBound
from edge_client.client import ClientSettings
from edge_client.data import load_dataset
from edge_client.device_protocol import presence_payload
from edge_client.objectives import LocalData, ObjectiveOutput
from edge_client.wire.protocol import ContentError, PresenceBody, ProtocolError, Topics, decode, encode
from edge_client.wire.transport import BrokerSettings, MqttTransport

TINY = {"model.name": "mlp", "model.hidden": [16], "data.eval": "digits", "export.enabled": False,
        "clients.presence_timeout": 60.0}


def _config(tmp_path, mosquitto, prefix, **sets):
    values = {**TINY, "run.out": str(tmp_path / "run"), "transport.broker": mosquitto, "transport.prefix": prefix,
              **sets}
    return load_config(None, [(*k.split(".", 1), v) for k, v in values.items()])


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _digits(i: int, n: int = 150) -> LocalData:
    digits = load_dataset("digits")
    x, y = torch.from_numpy(digits.x_train), torch.from_numpy(digits.y_train)
    return LocalData(x[i::3][:n], y[i::3][:n])


def nan_train(model, data, hyper, ctx) -> ObjectiveOutput:
    """What a broken or hostile device sends: every weight NaN, with a plausible loss."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    return ObjectiveOutput(num_samples=len(data), metrics={"train_loss": 1.0})


# -- the envelope keeps what a refusal needs --------------------------------------------------------------------------

def test_a_nan_result_is_refused_with_its_header_so_the_sender_can_be_told():
    payload = encode("result", run_id="r", round=3, task_id="0123456789abcdef", sender="dev-1",
                     body={"num_samples": 5}, tensors={"w": torch.tensor([1.0, float("nan")])})
    with pytest.raises(ContentError, match="tensor 'w' holds NaN or infinite values") as err:
        decode(payload)
    head = err.value.head
    assert (head.kind, head.run_id, head.round, head.task_id, head.sender) == ("result", "r", 3, "0123456789abcdef",
                                                                               "dev-1")
    assert head.body == {} and head.tensors == {}   # nothing of the refused content travels on


def test_a_non_finite_number_in_the_header_is_refused_with_the_header_too():
    from safetensors.torch import save

    def forged(body: str, round: str = "1") -> bytes:   # JSON no fedge encoder writes: by hand
        return save({}, metadata={"fedge": f'{{"v":2,"kind":"result","run_id":"r","round":{round},"task_id":"t",'
                                           f'"sender":"dev-1","body":{body}}}'})

    with pytest.raises(ContentError, match="non-standard JSON constant NaN") as err:
        decode(forged('{"num_samples":5,"metrics":{"train_loss":NaN}}'))
    assert err.value.head.task_id == "t"
    with pytest.raises(ContentError, match="number 1e999 is not finite"):
        decode(forged('{"num_samples":5,"metrics":{"train_loss":1e999}}'))
    # a header whose addressing is unusable stays a plain refusal: there is nobody sure to tell
    with pytest.raises(ProtocolError, match="'round' missing") as plain:
        decode(forged('{"num_samples":5}', round="NaN"))
    assert not isinstance(plain.value, ContentError)

# -- refused results end the wait; repeated ones bench the device -----------------------------------------------------

def test_rejected_results_bench_a_device_until_it_announces_itself_and_the_next_one_benches_it_again():
    absences = Absences(limit=2, rejected_limit=2)
    assert not absences.refused("d", "t1")
    assert not absences.refused("d", "t1")          # a re-sent copy of the same result counts once
    assert absences.refused("d", "t2") and absences.benched("d")
    assert not absences.returned("d")               # an answer (a late one, say) does not lift it
    assert absences.benched("d")
    assert absences.returned("d", announced=True) and not absences.benched("d")
    assert absences.refused("d", "t3") and absences.benched("d")   # re-announcing bought it one task
    absences.returned("d", announced=True)
    absences.accepted("d")                          # an accepted result ends the streak
    assert not absences.refused("d", "t4") and not absences.benched("d")
    assert not Absences(limit=2).refused("d", "t1") and not Absences(limit=2).refused("d", "t2")   # 0: never


def test_a_nan_device_is_told_why_and_the_round_closes_without_waiting_for_it(tmp_path, mosquitto, prefix,
                                                                                 mqtt_device, caplog):
    """Over Mosquitto: an honest device and one whose training gives NaN weights, rounds of 30 s timeout.
    The NaN device is answered ``rejected`` with the reason, which it logs; each round ends as soon as the
    honest result is in; after two rejected results in a row the NaN device is benched for that reason."""
    config = _config(tmp_path, mosquitto, prefix, **{"run.rounds": 3, "clients.expected": 2,
                                                      "clients.min_results": 1, "clients.round_timeout": 30.0})
    mqtt_device(ClientSettings(client_id="honest", topics=Topics(prefix)), _digits(0))
    mqtt_device(ClientSettings(client_id="nan", topics=Topics(prefix), objectives={"train": nan_train}), _digits(1))
    with caplog.at_level(logging.WARNING, logger="fedge.client"):
        result = run_federated(config, say=lambda s: None)
    rows = [r for r in _rows(result.out_dir) if r["round"] > 0]
    assert [r["returned"] for r in rows] == [1, 1, 1]
    assert [r["rejected"] for r in rows][:2] == [1, 1] and rows[2]["rejected"] == 0
    assert [r["selected"] for r in rows] == [2, 2, 1]    # benched for round 3
    assert [r["attempts"] for r in rows] == [1, 1, 1]
    assert all(r["seconds"] < 10 for r in rows), [r["seconds"] for r in rows]   # not the 30 s timeout
    told = [rec.getMessage() for rec in caplog.records if "coordinator rejected result of" in rec.getMessage()]
    assert len(told) == 2 and all("holds NaN or infinite values" in line for line in told), told
    log = (result.out_dir / "coordinator.log").read_text()
    assert "client nan had its results to 2 tasks in a row rejected" in log and "rejected results" in log
    assert "unanswered" not in log


def test_a_workers_claim_on_a_nan_result_is_rejected_with_the_workers_reason_and_ends_the_wait(tmp_path):
    """A worker that could read only a result's header claims it with the reason; the coordinator tells the
    device that reason and waits no more for it. A claim above the weight bound is refused, not capped: the
    worker folds with the device's own count."""
    from coordinator.runtime.round_book import RoundBook
    from coordinator.strategies.base import TaskPlan
    from edge_client.wire.codec import FP32
    from edge_client.wire.protocol import ManifestBody
    from edge_client.wire.transport import InprocHub
    from test_engine import make_coordinator

    hub = InprocHub()
    coord = make_coordinator(tmp_path, hub, expected=2, workers__count=1, transport__broker="mqtt://127.0.0.1:1",
                             codec__broadcast=True)
    device = hub.connect("device")
    for client in ("c1", "c2"):
        device.subscribe(Topics().client(client, "status"))
    for client, samples in (("c1", 100), ("c2", 100), ("c3", 100)):
        coord.roster.on_presence(client, presence_payload(client, PresenceBody("online", num_samples=samples)))
    names = sorted(coord.state.params)
    book = coord.intake.open(RoundBook(round=1, attempt=0, streaming=True))
    for task, client in (("t1", "c1"), ("t2", "c2")):
        coord.intake.issued(book, task, TaskPlan(client, "train", {}, coord.state.params, names))
    book.manifest = ManifestBody("x1", "train", coord.state.spec, tuple(names), FP32, {"t1": "c1", "t2": "c2"})
    unreadable = {"problem": "tensor 'fc.weight' holds NaN or infinite values", "held": False, "wire_bytes": 10}
    coord.workers.on_claim("w0", encode("result", run_id="run1", round=1, task_id="t1", sender="c1",
                                        body=unreadable))
    greedy = {"num_samples": 100_000, "problem": "", "held": True, "wire_bytes": 10}
    coord.roster.on_presence("c2", presence_payload("c2", PresenceBody("online", num_samples=100_000)))
    coord.workers.on_claim("w0", encode("result", run_id="run1", round=1, task_id="t2", sender="c2", body=greedy))
    told = {}
    while (incoming := device.get(0.2)) is not None:
        told[incoming.topic.split("/")[-2]] = decode(incoming.payload).body
    assert told["c1"] == {"state": "rejected", "task_id": "t1", "reason": unreadable["problem"]}
    assert told["c2"]["state"] == "rejected" and "an aggregation worker cannot fold it with less weight" in \
        told["c2"]["reason"]
    assert book.failed == {"c1", "c2"} and book.answered and book.tally.counts["rejected"] == 2


def test_in_async_mode_a_rejected_device_is_free_at_once_and_then_benched(tmp_path):
    """Async mode: the NaN device's task is over when its result is rejected (not at its 60 s deadline), so it
    gets a second task at once; after two rejected results it is benched and the run goes on without it."""
    values = {"run.mode": "async", "run.rounds": 4, "run.out": str(tmp_path), "clients.expected": 3, "clients.spawn": 3,
              "transport.kind": "inproc", "sim.workers": -1, "async.buffer_size": 2, "clients.round_timeout": 60.0,
              **TINY}
    config = load_config(None, [(*k.split(".", 1), v) for k, v in values.items()])
    started = time.monotonic()
    result = run_federated(config, say=lambda s: None,
                           client_objectives=lambda cid: {"train": nan_train} if cid == "sim-000" else {})
    assert time.monotonic() - started < 60
    answers = [json.loads(line) for line in (result.out_dir / "clients" / "sim-000.jsonl").read_text().splitlines()]
    assert len(answers) == 2 and not any(a.get("missed") for a in answers)
    assert sum(r.get("rejected", 0) for r in _rows(result.out_dir)) == 2
    assert "client sim-000 had its results to 2 tasks in a row rejected" in \
        (result.out_dir / "coordinator.log").read_text()

# -- the weight a device claims ---------------------------------------------------------------------------------------

def test_the_weight_bound_caps_at_a_multiple_of_the_lower_median_and_at_a_fixed_count():
    fleet = [200, 200, 10**9]
    bound = WeightBound(10.0, 0, lambda: fleet)
    assert bound.cap(10**9) == (2000, ("it claims 1,000,000,000 samples, above the bound of 2,000 (10 x the online "
                                       "devices' median announced count 200; clients.max_weight_ratio)"))
    assert bound.cap(2000) == (2000, "")
    assert WeightBound(10.0, 0, lambda: [100, 10**9]).limit()[0] == 1000   # two devices: the other one sets it
    assert WeightBound(10.0, 500, lambda: fleet).cap(1000)[0] == 500
    assert WeightBound(0.0, 0, lambda: fleet).cap(10**9) == (10**9, "")
    assert WeightBound(10.0, 0, lambda: [None, 0]).cap(10**9) == (10**9, "")   # nothing announced: no bound
    assert "10 x the median" in WeightBound(10.0, 0, lambda: fleet).describe()
    assert "not bounded" in WeightBound(0.0, 0, lambda: fleet).describe()


class _Forger(threading.Thread):
    """A device with its own credentials and its own code: announces ``samples`` and answers every task with
    the tensors it was sent, claiming ``samples``; with ``answer`` False it answers nothing and, once it has a
    task, announces itself ``flood`` times (a device in a loop). ``tasks`` counts the task messages it received;
    ``run_over`` is set once the coordinator's status says the run finished."""

    def __init__(self, mosquitto: str, prefix: str, client_id: str, samples: int, *, answer: bool = True,
                 flood: int = 0) -> None:
        super().__init__(daemon=True)
        self.topics, self.client_id, self.samples, self.answer, self.flood = Topics(prefix), client_id, samples, \
            answer, flood
        self.tasks = 0
        self.stop, self.run_over = threading.Event(), threading.Event()
        self.transport = MqttTransport(BrokerSettings(url=mosquitto), client_id).connect()
        for kind in ("task", "status"):
            self.transport.subscribe(self.topics.client(client_id, kind))
        self.transport.subscribe(self.topics.coordinator_status)
        self.presence = presence_payload(client_id, PresenceBody("online", num_samples=samples))
        self.transport.publish(self.topics.client(client_id, "presence"), self.presence, retain=True)

    def run(self) -> None:
        while not self.stop.is_set():
            incoming = self.transport.get(0.1)
            if incoming is not None and incoming.topic == self.topics.coordinator_status:
                if decode(incoming.payload).body.get("state") == "finished":
                    self.run_over.set()
                continue
            if incoming is None or not incoming.topic.endswith("/task"):
                continue
            self.tasks += 1
            task = decode(incoming.payload)
            if self.answer:
                result = encode("result", run_id=task.run_id, round=task.round, task_id=task.task_id,
                                sender=self.client_id, body={"num_samples": self.samples}, tensors=task.tensors)
                self.transport.publish(self.topics.client(self.client_id, "result"), result)
            elif self.tasks == 1:
                for _ in range(self.flood):
                    self.transport.publish(self.topics.client(self.client_id, "presence"), self.presence, retain=True)

    def close(self) -> None:
        self.stop.set()
        self.join(5)
        self.transport.close()


def test_a_device_claiming_a_billion_samples_weighs_ten_times_the_median(tmp_path, mosquitto, prefix, mqtt_device,
                                                                          caplog):
    config = _config(tmp_path, mosquitto, prefix, **{"run.rounds": 1, "clients.expected": 3,
                                                      "clients.round_timeout": 60.0, "codec.broadcast": False})
    for i in range(2):
        mqtt_device(ClientSettings(client_id=f"honest-{i}", topics=Topics(prefix)), _digits(i))
    forger = _Forger(mosquitto, prefix, "greedy", 10**9)
    forger.start()
    said: list[str] = []
    try:
        with caplog.at_level(logging.WARNING, logger="fedge.coordinator"):
            result = run_federated(config, say=said.append)
    finally:
        forger.close()
    row = _rows(result.out_dir)[-1]
    assert row["returned"] == 3 and row["weight_capped"] == 1 and row["rejected"] == 0
    assert row["train_samples"] == 150 + 150 + 1500   # the claim capped at 10 x the median 150
    assert any("capped at 10 x the median sample count the online devices announced (clients.max_weight_ratio)"
               in line for line in said), said   # said at start
    assert "capped the weight of greedy's result at 1,500 samples" in caplog.text


def test_a_secure_round_weighs_a_device_announcing_a_billion_samples_as_the_bound(tmp_path, caplog):
    """Under secure aggregation each device's weight is its count over the round's weight unit, the largest
    count announced: one device announcing 10^9 made every other device weigh next to nothing. The unit is
    now held to the weight bound, so that device weighs as ten median devices."""
    from coordinator.runtime.round_book import RoundBook
    from coordinator.strategies.base import TaskPlan
    from edge_client.wire.transport import InprocHub
    from test_engine import make_coordinator

    coord = make_coordinator(tmp_path, InprocHub(), expected=3, secagg__enabled=True)
    plans = []
    for client, samples in (("a", 200), ("b", 150), ("greedy", 10**9)):
        coord.roster.on_presence(client, presence_payload(client, PresenceBody("online", num_samples=samples)))
        plans.append(TaskPlan(client, "train", {}, {}, []))
    book = RoundBook(round=1, attempt=0)
    with caplog.at_level(logging.WARNING, logger="fedge.coordinator"):
        assert coord.secure._weight_unit(book, plans) == 2000.0   # 10 x the median 200: a weighs 0.1, greedy 1
    assert book.tally.counts["weight_capped"] == 1 and "greedy announced more than the weight bound" in caplog.text
    assert coord.secure._weight_unit(book, plans[:2]) == 200.0   # within the bound: the largest count, as before


def test_profile_selection_reads_the_capped_count_too(tmp_path):
    """Profile selection ranks devices by utility, samples times the root of their loss: the sample count
    it reads from a result is held to the weight bound as well."""
    from coordinator.runtime.round_book import RoundBook
    from coordinator.strategies.base import TaskPlan
    from edge_client.wire.transport import InprocHub
    from test_engine import make_coordinator

    coord = make_coordinator(tmp_path, InprocHub(), expected=3)
    for client, samples in (("a", 100), ("b", 100), ("greedy", 10**9)):
        coord.roster.on_presence(client, presence_payload(client, PresenceBody("online", num_samples=samples)))
    book = coord.intake.open(RoundBook(round=1, attempt=0))
    coord.intake.issued(book, "t1", TaskPlan("greedy", "train", {}, coord.state.params, sorted(coord.state.params)))
    result = encode("result", run_id="run1", round=1, task_id="t1", sender="greedy",
                    body={"num_samples": 10**9, "metrics": {"train_loss_sq": 4.0}}, tensors=dict(coord.state.params))
    coord.intake.on_result("greedy", result, len(result))
    assert book.results["greedy"].num_samples == 1000 and book.tally.counts["weight_capped"] == 1
    assert coord.device_book.record("greedy").utility == 1000 * 2.0

# -- presences in a loop ----------------------------------------------------------------------------------------------

def test_a_thousand_presences_resend_the_task_at_most_once_per_interval(tmp_path, mosquitto, prefix, mqtt_device):
    config = _config(tmp_path, mosquitto, prefix, **{"run.rounds": 1, "clients.expected": 2, "clients.min_results": 1,
                                                      "clients.round_timeout": 4.0, "clients.max_attempts": 1})
    mqtt_device(ClientSettings(client_id="honest", topics=Topics(prefix)), _digits(0))
    looper = _Forger(mosquitto, prefix, "looper", 150, answer=False, flood=1000)
    looper.start()
    try:
        result = run_federated(config, say=lambda s: None)
        # The coordinator's last word, after every task it sent on the same connection: once the looper has it,
        # it has every re-sent task too.
        assert looper.run_over.wait(30), "the looper never saw the run finish"
    finally:
        looper.close()
    row = _rows(result.out_dir)[-1]
    assert looper.tasks <= 2, looper.tasks   # its task, and at most one re-send within the 4 s round
    assert row["presence_ignored"] >= 990, row.get("presence_ignored")


def test_a_presence_after_the_interval_re_sends_the_task_again(tmp_path):
    """The limit is per task and per interval: a device that really reconnects later still gets its task."""
    from coordinator.runtime.round_book import RoundBook
    from coordinator.strategies.base import TaskPlan
    from edge_client.wire.transport import InprocHub
    from test_engine import make_coordinator

    hub = InprocHub()
    coord = make_coordinator(tmp_path, hub, expected=1, clients__presence_interval=5.0)
    device = hub.connect("device")
    device.subscribe(Topics().client("c1", "task"))
    book = coord.intake.open(RoundBook(round=1, attempt=0))
    coord.tasks.send_all(book, [TaskPlan("c1", "train", {}, coord.state.params, sorted(coord.state.params))])
    for now in (100.0, 101.0, 104.9, 105.0, 105.1):
        coord.tasks.resend_unanswered(book, "c1", now=now)
    tasks = 0
    while device.get(0.2) is not None:
        tasks += 1
    assert tasks == 3 and book.tally.counts["presence_ignored"] == 3   # sent, re-sent at 100.0 and at 105.0

# -- metrics ----------------------------------------------------------------------------------------------------------

def test_the_metrics_endpoint_counts_capped_weights_and_ignored_presences():
    pytest.importorskip("prometheus_client")
    from coordinator.telemetry import RunTelemetry

    telemetry = RunTelemetry(run_id="r", strategy="fedavg", model="mlp")
    for row in ({"round": 1, "weight_capped": 1, "presence_ignored": 999}, {"round": 2, "weight_capped": 2}):
        telemetry.observe(row)
    value = telemetry.registry.get_sample_value
    assert value("fedge_weight_capped_total") == 3 and value("fedge_presence_ignored_total") == 999
