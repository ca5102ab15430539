"""A flood on one device's topic does not starve the others, and what was dropped is counted."""

from __future__ import annotations

import sys
from pathlib import Path

from edge_client.wire.inbox import Inbox
from edge_client.wire.transport import Incoming

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from flood import flooded_run  # noqa: E402


def test_the_inbox_serves_topics_in_turn_and_caps_each_topics_share():
    inbox = Inbox(maxsize=100, max_bytes=10_000, share=0.25)
    for i in range(1_000):
        inbox.put(Incoming("fedge/clients/flood/result", b"x" * 10))
    inbox.put(Incoming("fedge/clients/a/result", b"a"))
    inbox.put(Incoming("fedge/clients/b/result", b"b"))
    assert inbox.dropped_by == {"one topic over its share of the inbox": 975}
    first = [inbox.get(0.1).topic for _ in range(3)]
    assert first == ["fedge/clients/flood/result", "fedge/clients/a/result", "fedge/clients/b/result"]
    big = Inbox(maxsize=100, max_bytes=1_000, share=0.5)
    big.put(Incoming("t/1", b"x" * 400))
    big.put(Incoming("t/1", b"x" * 400))            # over the topic's 500 bytes
    big.put(Incoming("t/2", b"x" * 400))
    big.put(Incoming("t/3", b"x" * 400))            # over the inbox's 1,000 bytes
    assert big.dropped_by == {"one topic over its share of the inbox": 1, "inbox full": 1}
    assert big.get(0.0).topic == "t/1" and big.get(0.0).topic == "t/2" and big.get(0.0) is None


def test_a_topic_publishing_faster_than_its_rate_is_cut_off_and_refills_with_time():
    inbox = Inbox(maxsize=10_000, rate=10.0, burst=5)
    for i in range(20):                        # all at one instant: the burst passes, the rest is dropped
        inbox.put(Incoming("fedge/clients/flood/result", b"x", received_at=100.0))
    inbox.put(Incoming("fedge/clients/calm/result", b"y", received_at=100.0))
    assert inbox.dropped_by == {"one topic over its rate limit": 15}
    inbox.put(Incoming("fedge/clients/flood/result", b"x", received_at=100.05))   # half a token back
    inbox.put(Incoming("fedge/clients/flood/result", b"x", received_at=100.2))    # two tokens back
    assert inbox.dropped_by == {"one topic over its rate limit": 16}
    topics = [inbox.get(0.0).topic for _ in range(7)]
    assert topics.count("fedge/clients/flood/result") == 6 and inbox.get(0.0) is None


def test_the_selected_clients_results_are_read_first():
    inbox = Inbox(maxsize=100)
    for topic in ("t/idle/presence", "t/b/result", "t/idle/presence", "t/a/result", "t/b/result"):
        inbox.put(Incoming(topic, b"."))
    inbox.prefer(["t/a/result", "t/b/result"])
    order = [inbox.get(0.0).topic for _ in range(5)]
    assert order == ["t/b/result", "t/a/result", "t/b/result", "t/idle/presence", "t/idle/presence"]
    inbox.prefer([])
    inbox.put(Incoming("t/idle/presence", b"."))
    inbox.put(Incoming("t/a/result", b"."))
    assert inbox.get(0.0).topic == "t/idle/presence"


def test_a_flood_on_one_devices_topic_leaves_the_others_results_and_the_memory_alone(tmp_path, mosquitto, prefix):
    _, calm_mb = flooded_run(tmp_path / "calm", mosquitto, prefix + "-calm", messages=0)
    flooded, flooded_mb = flooded_run(tmp_path / "flooded", mosquitto, prefix, messages=50_000)
    assert [r["round"] for r in flooded] == list(range(7))
    for row in flooded[1:]:
        assert row["returned"] >= 2        # sim-000 and sim-001 always count
    rejected = sum(r["rejected"] for r in flooded)
    dropped = sum(sum(r.get("inbox_dropped", {}).values()) for r in flooded)
    assert rejected + dropped > 1_000, (rejected, dropped)   # the flood was seen, counted and refused
    assert flooded[-1]["test_accuracy"] > flooded[0]["test_accuracy"] + 0.2
    assert flooded_mb < calm_mb + 100, (calm_mb, flooded_mb)
