"""A receiver that cannot keep up slows the broker down instead of dropping what it was sent."""

from __future__ import annotations

import threading
import time

from edge_client.wire.broker_settings import BrokerSettings
from edge_client.wire.inbox import Inbox
from edge_client.wire.mqtt_transport import MqttTransport
from edge_client.wire.transport import Incoming


def test_a_message_is_acknowledged_when_taken_and_a_full_inbox_waits_instead_of_dropping():
    acked: list[str] = []
    inbox = Inbox(maxsize=2, max_bytes=1_000, share=1.0)
    for name in ("a", "b"):
        inbox.put(Incoming(f"t/{name}", b"x"), lambda n=name: acked.append(n))
    assert acked == []                                   # held, not yet taken
    done = threading.Event()
    waiting = threading.Thread(target=lambda: (inbox.put(Incoming("t/c", b"x"), lambda: acked.append("c"),
                                                         hold=10.0), done.set()))
    waiting.start()
    assert not done.wait(0.2)                            # full: the sender's thread waits for room
    assert inbox.get(0.0).topic == "t/a" and acked == ["a"]
    assert done.wait(2.0)                                # room made: queued, not dropped
    assert [inbox.get(0.0).topic for _ in range(2)] == ["t/b", "t/c"] and acked == ["a", "b", "c"]
    assert inbox.dropped_by == {} and inbox.held_over == 0
    inbox.put(Incoming("t/d", b"x"), lambda: acked.append("d"))
    inbox.put(Incoming("t/e", b"x"), lambda: acked.append("e"))
    inbox.put(Incoming("t/f", b"x"), lambda: acked.append("f"), hold=0.05)   # nobody reads: kept, counted
    assert inbox.held_over == 1 and inbox.dropped_by == {} and acked == ["a", "b", "c"]
    inbox.put(Incoming("t/g", b"x"))                     # without an ack a full inbox still drops
    assert inbox.dropped_by == {"inbox full": 1}


def test_a_flood_is_acknowledged_at_once_so_the_broker_moves_on():
    acked: list[int] = []
    inbox = Inbox(maxsize=100, rate=10.0, burst=2)
    for i in range(5):
        inbox.put(Incoming("t/flood", b"x", received_at=1.0), lambda i=i: acked.append(i), hold=10.0)
    assert inbox.dropped_by == {"one topic over its rate limit": 3} and acked == [2, 3, 4]


def _flood_through(url: str, client_id: str, prefix: str, *, flow_control: bool, messages: int = 400,
                   size: int = 20_000) -> tuple[set[int], dict[str, int], int, int]:
    """Publish ``messages`` QoS 1 messages as fast as paho sends them to a receiver whose queue holds 20
    messages and 100 kB, which reads one every millisecond; what it got, dropped, held over and its peak."""
    settings = BrokerSettings(url=url, protocol="5", max_message_bytes=size + 100)
    receiver = MqttTransport(settings, client_id, queue_size=20, flow_control=flow_control)
    receiver._inbox.max_bytes = 100_000
    receiver.connect()
    sender = MqttTransport(settings, client_id + "-sender").connect()
    topic = f"{prefix}/load"
    try:
        receiver.subscribe(topic)
        time.sleep(0.3)
        for i in range(messages):
            sender.publish(topic, i.to_bytes(4, "big") + bytes(size))
        got: set[int] = set()
        peak = 0
        deadline = time.monotonic() + 30
        while len(got) < messages and time.monotonic() < deadline:
            peak = max(peak, receiver._inbox._count)
            item = receiver.get(1.0 if flow_control else 0.5)
            if item is None and not flow_control:
                break
            if item is not None:
                got.add(int.from_bytes(item.payload[:4], "big"))
                time.sleep(0.001)
        return got, receiver.dropped_by, receiver.held_over, peak
    finally:
        sender.close()
        receiver.close()


def test_over_mosquitto_a_slow_receiver_with_flow_control_gets_every_message(mosquitto, prefix):
    got, dropped, held_over, peak = _flood_through(mosquitto, prefix + "-fc", prefix, flow_control=True)
    assert got == set(range(400)) and dropped == {}
    assert peak <= 20 + held_over, (peak, held_over)
    got_plain, dropped_plain, _, _ = _flood_through(mosquitto, prefix + "-plain", prefix + "-p", flow_control=False)
    assert len(got_plain) < 400 and dropped_plain.get("inbox full", 0) > 0   # what flow control prevents
