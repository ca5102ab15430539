"""A flood on one device's topic does not starve the others, and what was dropped is counted."""

from __future__ import annotations

import json
import threading
import time
import uuid

import paho.mqtt.client as mqtt
import psutil
from paho.mqtt.enums import CallbackAPIVersion

from coordinator.config import load_config
from coordinator.run import run_federated
from edge_client.wire.transport import Incoming, _Inbox


def test_the_inbox_serves_topics_in_turn_and_caps_each_topics_share():
    inbox = _Inbox(maxsize=100, max_bytes=10_000, share=0.25)
    for i in range(1_000):
        inbox.put(Incoming("fedge/clients/flood/result", b"x" * 10))
    inbox.put(Incoming("fedge/clients/a/result", b"a"))
    inbox.put(Incoming("fedge/clients/b/result", b"b"))
    assert inbox.dropped_by == {"one topic over its share of the inbox": 975}
    first = [inbox.get(0.1).topic for _ in range(3)]
    assert first == ["fedge/clients/flood/result", "fedge/clients/a/result", "fedge/clients/b/result"]
    big = _Inbox(maxsize=100, max_bytes=1_000, share=0.5)
    big.put(Incoming("t/1", b"x" * 400))
    big.put(Incoming("t/1", b"x" * 400))            # over the topic's 500 bytes
    big.put(Incoming("t/2", b"x" * 400))
    big.put(Incoming("t/3", b"x" * 400))            # over the inbox's 1,000 bytes
    assert big.dropped_by == {"one topic over its share of the inbox": 1, "inbox full": 1}
    assert big.get(0.0).topic == "t/1" and big.get(0.0).topic == "t/2" and big.get(0.0) is None


def _run(tmp_path, name, mosquitto, prefix, flood: bool) -> tuple[list[dict], float]:
    out = tmp_path / name
    sets = {"run.rounds": 6, "run.out": str(out), "model.name": "cnn", "data.eval": "digits",
            "clients.expected": 3, "clients.spawn": 3, "clients.min_results": 2, "clients.round_timeout": 30.0,
            "clients.presence_timeout": 60.0, "transport.broker": mosquitto, "transport.prefix": prefix,
            "export.enabled": False}
    config = load_config(None, [(*k.split(".", 1), v) for k, v in sets.items()])
    me, peak, stop = psutil.Process(), [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], me.memory_info().rss)
            time.sleep(0.02)

    def flooder() -> None:   # full speed on one device's result topic: garbage, truncated and oversized
        host, port = mosquitto.removeprefix("mqtt://").split(":")
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"flood-{uuid.uuid4().hex[:8]}")
        client.connect(host, int(port))
        client.loop_start()
        while not (out / "metrics.jsonl").exists() and not stop.is_set():
            time.sleep(0.01)
        for i in range(50_000):
            client.publish(f"{prefix}/clients/sim-002/result", bytes([i % 251]) * (1 + i % 700), qos=0)
        client.loop_stop()
        client.disconnect()

    threads = [threading.Thread(target=watch, daemon=True)]
    if flood:
        threads.append(threading.Thread(target=flooder, daemon=True))
    for t in threads:
        t.start()
    try:
        run_federated(config, say=lambda s: None)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], peak[0] / 2**20


def test_a_flood_on_one_devices_topic_leaves_the_others_results_and_the_memory_alone(tmp_path, mosquitto, prefix):
    calm, calm_mb = _run(tmp_path, "calm", mosquitto, prefix + "-calm", flood=False)
    flooded, flooded_mb = _run(tmp_path, "flooded", mosquitto, prefix, flood=True)
    assert [r["round"] for r in flooded] == list(range(7))
    for row in flooded[1:]:
        assert row["returned"] >= 2        # sim-000 and sim-001 always count
    rejected = sum(r["rejected"] for r in flooded)
    dropped = sum(sum(r.get("inbox_dropped", {}).values()) for r in flooded)
    assert rejected + dropped > 1_000, (rejected, dropped)   # the flood was seen, counted and refused
    assert flooded[-1]["test_accuracy"] > flooded[0]["test_accuracy"] + 0.2
    assert flooded_mb < calm_mb + 100, (calm_mb, flooded_mb)
