"""What a run that cannot go on tells its user: which devices it waited for and which setting gave up, where
its log is (kept, though nothing was checkpointed), and a device leaving, shown at the default log level.

Real runs: on a real Mosquitto with devices that are presences published as a device publishes them, and in
process with spawned clients training on digits, one of them too slow.
"""

from __future__ import annotations

import logging
import re
import time

import pytest
import torch

from coordinator.runtime.run import RunError, run_federated
from edge_client.client import presence_payload
from edge_client.objectives import train
from edge_client.wire.protocol import PresenceBody, Topics
from edge_client.wire.transport import BrokerSettings, MqttTransport
from storage.files import read_jsonl
from test_federation import config_for


@pytest.fixture
def device_presences(mosquitto, prefix):
    """A connection that publishes devices' retained presences, as the devices (or their last wills) do."""
    transport = MqttTransport(BrokerSettings(url=mosquitto, session_expiry=0), f"devices-{prefix}").connect()
    topics = Topics(prefix)

    def publish(client: str, state: str) -> None:
        body = PresenceBody(state, num_samples=100) if state == "online" else PresenceBody(state)
        transport.publish(topics.client(client, "presence"), presence_payload(client, body), retain=True)

    yield publish
    for client in ("pi-09", "pi-10"):   # nothing retained outlives the test
        transport.publish(topics.client(client, "presence"), b"", retain=True)
    transport.close()


def test_a_run_short_of_devices_names_who_left_and_the_timeout_and_keeps_its_log(tmp_path, mosquitto, prefix,
                                                                                 device_presences, caplog):
    caplog.set_level(logging.WARNING, logger="fedge")   # the console's level without -v
    out = tmp_path / "run"
    config = config_for(out, transport__broker=mosquitto, transport__prefix=prefix, clients__spawn=0,
                        clients__expected=3, clients__presence_timeout=4.0)
    device_presences("pi-09", "online")
    device_presences("pi-10", "online")

    def on_progress(event: dict) -> None:   # pi-09 leaves once the run has seen it
        if event.get("kind") == "waiting" and "pi-09" in event["online"]:
            device_presences("pi-09", "offline")

    with pytest.raises(RunError) as failed:
        run_federated(config, say=lambda s: None, on_progress=on_progress)
    message = str(failed.value)
    assert "only 1 of 3 clients came online within 4 s (clients.presence_timeout)" in message
    assert "waiting for pi-09 (went offline" in message and "raise clients.presence_timeout" in message
    # nothing was checkpointed, yet the log that says why is kept, and the error says where
    assert sorted(p.name for p in out.iterdir()) == ["coordinator.log"]
    assert str(out / "coordinator.log") in message
    log = (out / "coordinator.log").read_text()
    assert "client pi-09 went offline" in log and "only 1 of 3 clients came online" in log
    left = [r for r in caplog.records if r.getMessage() == "client pi-09 went offline"]
    assert len(left) == 1 and left[0].levelno >= logging.WARNING


def test_a_run_no_device_joins_says_where_it_listened(tmp_path, mosquitto, prefix):
    config = config_for(tmp_path / "run", transport__broker=mosquitto, transport__prefix=prefix, clients__spawn=0,
                        clients__expected=2, clients__presence_timeout=2.0)
    with pytest.raises(RunError, match=rf"only 0 of 2 clients came online within 2 s \(clients.presence_timeout\) "
                                       rf"\(\[\]\); no other device announced itself on {prefix}/clients/\+/presence"):
        run_federated(config, say=lambda s: None)


def test_a_round_short_of_results_names_the_devices_that_did_not_answer_and_their_times(tmp_path):
    """sim-002 trains as the others do in round 1, then holds its round-2 result past every attempt."""
    def slow_from_round_2(model, data, hyper, ctx):
        if ctx.round >= 2:
            time.sleep(12)   # past both attempts (3 s each, the second waiting for it): the run has failed by then
        return train(model, data, hyper, ctx)

    slow = {"train": slow_from_round_2}
    config = config_for(tmp_path / "run", transport__kind="inproc", clients__expected=3, clients__spawn=3,
                        clients__round_timeout=3.0, clients__max_attempts=2, export__enabled=False)
    with pytest.raises(RunError) as failed:
        run_federated(config, say=lambda s: None, client_objectives=lambda client: slow if client == "sim-002" else {})
    message = str(failed.value)
    assert message.startswith("round 2 (train) got too few results in 2 attempts; ")
    named = re.search(r"no answer in time from sim-002 \(its earlier train tasks took (\d+\.\d) s\); the last attempt "
                      r"waited (\d+\.\d) s \(clients.round_timeout", message)
    assert named is not None, message
    measured = [a["round_seconds"] for a in read_jsonl(tmp_path / "run" / "clients" / "sim-002.jsonl")
                if a["round"] == 1 and not a["missed"]]
    assert float(named.group(1)) == pytest.approx(measured[0], abs=0.05)   # its round-1 time, as measured
    assert float(named.group(2)) >= 3.0 and "sim-000" not in message and "sim-001" not in message


def scaled_train(factor: float):
    """The ``train`` objective of a hostile device: it sends ``factor`` times its update."""
    def objective(model, data, hyper, ctx):
        start = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}
        out = train(model, data, hyper, ctx)
        with torch.no_grad():
            for k, v in model.state_dict().items():
                if k in start:
                    v.copy_(start[k] + factor * (v - start[k]))
        return out
    return objective


def test_a_poisoned_plain_mean_ends_saying_the_model_diverged_and_what_to_try(tmp_path):
    """Two devices of ten scale their updates 1000 times; the plain mean takes them, and training the global model
    soon gives infinite values (here first in a metric the device sends, the mean squared loss, which no JSON
    body can carry): the run ends naming the divergence, the round and the settings to change."""
    hostile = {"train": scaled_train(1000.0)}
    config = config_for(tmp_path / "run", transport__kind="inproc", clients__expected=10, clients__spawn=10,
                        data__partition="iid", run__rounds=4, clients__max_attempts=1, clients__round_timeout=30.0,
                        export__enabled=False)
    with pytest.raises(RunError) as failed:
        run_federated(config, say=lambda s: None,
                      client_objectives=lambda client: hostile if client in ("sim-000", "sim-001") else {})
    message = str(failed.value)
    assert re.match(r"round \d \(train\) got too few results in 1 attempts; the global model this round started "
                    r"from has diverged", message), message
    assert "aggregate.rule" in message and "train.lr" in message and "earlier checkpoint" in message
    assert "not plain finite JSON" not in message


def test_a_run_short_of_aggregation_workers_names_the_timeout_that_gave_up(tmp_path, mosquitto, prefix):
    config = config_for(tmp_path / "run", transport__broker=mosquitto, transport__prefix=prefix, clients__spawn=0,
                        workers__count=1, clients__presence_timeout=1.0)
    with pytest.raises(RunError, match=r"only 0 of 1 aggregation workers came online within 1 s "
                                       r"\(clients.presence_timeout\)"):
        run_federated(config, say=lambda s: None)


def test_a_resumed_run_short_of_devices_names_those_that_took_part_before(tmp_path):
    out = tmp_path / "run"
    run_federated(config_for(out, transport__kind="inproc", run__rounds=1, export__enabled=False),
                  say=lambda s: None)
    fewer = config_for(out, transport__kind="inproc", run__rounds=2, clients__spawn=2, clients__presence_timeout=2.0,
                       export__enabled=False)
    with pytest.raises(RunError, match=r"only 2 of 3 clients came online within 2 s \(clients.presence_timeout\) "
                                       r".*; waiting for sim-002 \(took part in this run, not online\)"):
        run_federated(fewer, resume=True, say=lambda s: None)


def test_after_a_resume_a_straggler_is_named_with_the_times_the_run_recorded_before(tmp_path):
    """The resumed session has timed nothing yet: sim-002's times come from the run's records of round 1."""
    out = tmp_path / "run"
    run_federated(config_for(out, transport__kind="inproc", run__rounds=1, export__enabled=False), say=lambda s: None)

    def stalled(model, data, hyper, ctx):
        time.sleep(8)   # past the attempt (3 s): the run has failed by then
        return train(model, data, hyper, ctx)

    config = config_for(out, transport__kind="inproc", run__rounds=2, clients__round_timeout=3.0,
                        clients__max_attempts=1, export__enabled=False)
    with pytest.raises(RunError) as failed:
        run_federated(config, resume=True, say=lambda s: None,
                      client_objectives=lambda client: {"train": stalled} if client == "sim-002" else {})
    recorded = [a["round_seconds"] for a in read_jsonl(out / "clients" / "sim-002.jsonl") if a["round"] == 1]
    assert f"no answer in time from sim-002 (its earlier train tasks took {recorded[0]:.1f} s)" in str(failed.value)
