"""A broker that restarts at the moment of the model broadcast, with and without persistence.

Without persistence the restarted broker has forgotten the retained broadcast and run
status; the coordinator publishes both again once it is reconnected (and on a retry),
so the devices get the model and the round completes.
"""

from __future__ import annotations

import json
import threading
import uuid

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from coordinator.runtime import broadcast, tasks
from coordinator.config import load_config
from coordinator.ops.mosquitto import LocalMosquitto
from coordinator.runtime.run import run_federated


@pytest.mark.parametrize("persistence", [False, True], ids=["no-persistence", "persistence"])
def test_a_broker_restart_at_the_broadcast_loses_no_round(tmp_path, monkeypatch, persistence):
    broker = LocalMosquitto(workdir=tmp_path / "broker", persistence=persistence)
    broker.start()
    restarts: list[int] = []
    original = broadcast.Broadcast.publish_model

    def broadcast_then_restart(self, book, tensors):
        digest = original(self, book, tensors)
        if book.round == 2 and not restarts:     # the model is at the broker, the tasks not yet out
            restarts.append(book.round)
            _wait_until_retained(broker.port, self.topics.model)
            broker.stop()
            broker.start(same_port=True)
        return digest

    monkeypatch.setattr(broadcast.Broadcast, "publish_model", broadcast_then_restart)
    out = tmp_path / "run"
    overrides = {"run.rounds": 3, "run.out": str(out), "model.name": "cnn", "data.eval": "digits",
                 "clients.expected": 2, "clients.spawn": 2, "clients.round_timeout": 30.0,
                 "clients.presence_timeout": 60.0, "transport.broker": broker.url, "export.enabled": False}
    config = load_config(None, [(*k.split(".", 1), v) for k, v in overrides.items()])
    try:
        result = run_federated(config, say=lambda s: None)
    finally:
        broker.stop()
    assert restarts == [2]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    assert all(r["returned"] == 2 for r in rows[1:])
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"] + 0.2
    assert result.summary["final_accuracy"] == rows[-1]["test_accuracy"]


def _wait_until_retained(port: int, topic: str, timeout: float = 10.0) -> None:
    """Block until the broker holds a retained message on ``topic`` (its first chunk, if chunked)."""
    got = threading.Event()
    probe = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"probe-{uuid.uuid4().hex[:8]}")
    probe.on_message = lambda client, userdata, message: got.set() if message.retain else None
    probe.connect("127.0.0.1", port)
    probe.subscribe(f"{topic}/#")
    probe.subscribe(topic)
    probe.loop_start()
    try:
        assert got.wait(timeout), "the broadcast never reached the broker"
    finally:
        probe.loop_stop()
        probe.disconnect()


def test_tasks_a_restarted_broker_lost_are_sent_again_after_the_reconnect(tmp_path, monkeypatch):
    """The broker accepted round 2's tasks and restarted without persistence before delivering them:
    the coordinator sends each unanswered task again when its device is back, so the attempt does not
    wait out its timeout."""
    broker = LocalMosquitto(workdir=tmp_path / "broker", persistence=False)
    broker.start()
    restarts: list[int] = []
    original = tasks.TaskSender.send_all

    def tasks_lost_in_a_restart(self, book, plans):
        if book.round != 2 or restarts:
            return original(self, book, plans)
        restarts.append(book.round)
        publish = self.outbox.transport.publish

        def lost(topic, payload, **kw):   # what the restart takes with it: accepted, never delivered
            return len(payload) if topic.endswith("/task") else publish(topic, payload, **kw)

        monkeypatch.setattr(self.outbox.transport, "publish", lost)
        try:
            original(self, book, plans)
        finally:
            monkeypatch.setattr(self.outbox.transport, "publish", publish)
        broker.stop()
        broker.start(same_port=True)

    monkeypatch.setattr(tasks.TaskSender, "send_all", tasks_lost_in_a_restart)
    out, timeout = tmp_path / "run", 60.0
    overrides = {"run.rounds": 3, "run.out": str(out), "model.name": "cnn", "data.eval": "digits",
                 "clients.expected": 2, "clients.spawn": 2, "clients.round_timeout": timeout,
                 "clients.presence_timeout": 60.0, "transport.broker": broker.url, "export.enabled": False}
    config = load_config(None, [(*k.split(".", 1), v) for k, v in overrides.items()])
    try:
        run_federated(config, say=lambda s: None)
    finally:
        broker.stop()
    assert restarts == [2]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    assert (rows[2]["attempts"], rows[2]["returned"]) == (1, 2)
    assert rows[2]["seconds"] < timeout / 2, rows[2]
    log = (out / "coordinator.log").read_text()
    assert all(f"sending {cid}'s unanswered task again" in log for cid in ("sim-000", "sim-001")), log


def test_a_device_whose_broadcast_was_lost_in_a_broker_restart_says_so(tmp_path, announce_running, client_thread,
                                                                      wait_until):
    """Not "check the ACL": the device saw its connection drop while it waited for the broadcast."""
    import torch

    from edge_client.client import ClientSettings, EdgeClient
    from edge_client.data import load_dataset
    from edge_client.objectives import LocalData
    from edge_client.wire.protocol import Topics, decode, encode
    from edge_client.wire.transport import BrokerSettings, MqttTransport

    broker = LocalMosquitto(workdir=tmp_path / "broker", persistence=False, extra_config="log_type subscribe\n")
    broker.start()

    def subscribed(topic: str) -> bool:   # the broker logs each subscription as "CLIENT QOS FILTER"
        return f" dev1 1 {topic}\n" in (broker.workdir / "mosquitto.log").read_text()

    digits = load_dataset("digits")
    settings = BrokerSettings(url=broker.url)
    device = MqttTransport(settings, "dev1", will=EdgeClient.will(ClientSettings(client_id="dev1"))).connect()
    client = EdgeClient(ClientSettings(client_id="dev1"), device,
                        LocalData(torch.from_numpy(digits.x_train[:64]), torch.from_numpy(digits.y_train[:64])))
    running = client_thread(client)
    me, topics = MqttTransport(settings, "coord").connect(), Topics()
    try:
        me.subscribe(topics.client("dev1", "result"))
        wait_until(lambda: subscribed(topics.client("dev1", "task")), "the device never subscribed to its tasks")
        announce_running(me)
        spec = {"name": "mlp", "in_channels": 1, "image_size": 8, "num_classes": 10, "hidden": [8]}
        body = {"objective": "train", "hyper": {"epochs": 1}, "model": spec, "up": [], "seed": 1, "timeout": 8,
                "resend_every": 30, "broadcast": "2" * 64}
        me.publish(topics.client("dev1", "task"), encode("task", run_id="r", round=1, task_id="t1",
                                                         sender="coordinator", body=body))
        # The device waits for the task's broadcast on the model topic: the broker goes down meanwhile.
        wait_until(lambda: subscribed(topics.model), "the device never waited for the broadcast", timeout=30)
        broker.stop()
        broker.start(same_port=True)
        incoming = me.get(30)
        while incoming is not None and not incoming.payload:
            incoming = me.get(30)
        assert incoming is not None, "no answer"
        error = decode(incoming.payload).body["error"]
    finally:
        running.stop()
        me.close()
        broker.stop()
    assert "the connection to the broker dropped 1 time(s)" in error and "ACL" not in error, error
