"""MQTT connections driven by one shared selector loop (edge_client.wire.shared_loop), against Mosquitto.

Two transports on one loop and one thread: they connect without blocking, deliver to each other,
count what they move, and after a lost connection come back with their subscriptions and their
online presence, as a transport with paho's own thread does.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from edge_client.wire.shared_loop import SharedLoop
from edge_client.wire.transport import BrokerSettings, MqttTransport, Will


def _until(loop: SharedLoop, done: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        loop.run_once(0.05)


def test_transports_on_one_loop_connect_deliver_count_and_come_back(mosquitto: str, prefix: str) -> None:
    loop = SharedLoop()
    arrivals: list[str] = []
    traffic = {0: 0, 1: 0}

    def count(direction: int, size: int) -> None:
        traffic[direction] += size

    settings = BrokerSettings(url=mosquitto, protocol="5")
    will = Will(f"{prefix}/presence/a", b"offline")
    a = MqttTransport(settings, f"{prefix}-a", will=will, loop=loop, on_message=lambda: arrivals.append("a"),
                      counter=count)
    b = MqttTransport(settings, f"{prefix}-b", loop=loop, on_message=lambda: arrivals.append("b"))
    a.subscribe(f"{prefix}/to-a")        # before connecting: renewed on every connect
    b.subscribe(f"{prefix}/presence/#")
    assert a.connect() is a and not a.connected   # connecting happens on the loop
    b.connect()
    _until(loop, lambda: a.connected and b.connected)
    a.announce(f"{prefix}/presence/a", b"online")
    _until(loop, lambda: "b" in arrivals)
    assert b.get(0.0).payload == b"online"

    b.publish(f"{prefix}/to-a", b"x" * 1000)
    _until(loop, lambda: "a" in arrivals)
    got = a.get(0.0)
    assert (got.topic, got.payload) == (f"{prefix}/to-a", b"x" * 1000)
    assert traffic == {0: 1000, 1: len(b"online")}
    assert (a.connects, a.disconnects) == (1, 0)

    # The broker's side of the connection is gone: a reconnects on the loop's timer, subscribes again
    # and says it is online again.
    loop.flush(2.0)   # the PUBACK of what a took, or the broker sends it again on the new connection
    a._client.socket().shutdown(socket.SHUT_RDWR)
    _until(loop, lambda: a.disconnects == 1)
    _until(loop, lambda: a.connected and a.connects == 2)
    _until(loop, lambda: arrivals.count("b") >= 3)   # the will the broker fired, then the presence again
    presences = [m.payload for m in iter(lambda: b.get(0.0), None)]
    assert presences == [b"offline", b"online"]
    b.publish(f"{prefix}/to-a", b"again")
    _until(loop, lambda: arrivals.count("a") == 2)
    assert a.get(0.0).payload == b"again"

    a.close()
    b.close()
    loop.wait_closed(5.0)
    assert loop.open_connections() == 0
