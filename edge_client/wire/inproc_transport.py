"""A broker in memory for one process, and its clients: the same topics, topic filters, retained
messages and last wills as MQTT, so simulations and tests run the real coordinator and client code,
through the real encoder and decoder, without sockets.
"""

from __future__ import annotations

import threading
import uuid

from paho.mqtt.client import topic_matches_sub

from edge_client.wire.inbox import Inbox
from edge_client.wire.transport_base import Incoming, Transport, Will

__all__ = ["InprocHub", "InprocTransport"]


class InprocHub:
    """A broker in memory for one process: topic filters, retained messages, wills.

    It exists so experiments and tests run the real coordinator and client code,
    through the real encoder and decoder, without sockets.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Filters without wildcards by topic, the rest in a list: with hundreds of simulated clients
        # nearly every filter is exact, and a publish must not test each of them.
        self._exact: dict[str, list[InprocTransport]] = {}
        self._wild: list[tuple[str, InprocTransport]] = []
        self._retained: dict[str, bytes] = {}

    def connect(self, client_id: str | None = None, *, will: Will | None = None,
                queue_size: int = 10_000) -> "InprocTransport":
        return InprocTransport(self, client_id or uuid.uuid4().hex, will, queue_size)

    def _subscribe(self, endpoint: "InprocTransport", topic_filter: str) -> None:
        with self._lock:
            if "+" in topic_filter or "#" in topic_filter:
                self._wild.append((topic_filter, endpoint))
            else:
                self._exact.setdefault(topic_filter, []).append(endpoint)
            retained = [(t, p) for t, p in self._retained.items() if topic_matches_sub(topic_filter, t)]
        for topic, payload in retained:
            endpoint._inbox.put(Incoming(topic, payload))

    def _unsubscribe(self, endpoint: "InprocTransport", topic_filter: str) -> None:
        with self._lock:
            self._wild = [(f, e) for f, e in self._wild if not (e is endpoint and f == topic_filter)]
            kept = [e for e in self._exact.pop(topic_filter, []) if e is not endpoint]
            if kept:
                self._exact[topic_filter] = kept

    def _publish(self, topic: str, payload: bytes, retain: bool) -> None:
        with self._lock:
            if retain and payload:
                self._retained[topic] = payload
            elif retain:   # as in MQTT, an empty retained message clears the topic's
                self._retained.pop(topic, None)
            targets = {id(e): e for e in self._exact.get(topic, ())}
            targets.update((id(e), e) for f, e in self._wild if topic_matches_sub(f, topic))
        for endpoint in targets.values():
            endpoint._inbox.put(Incoming(topic, payload))

    def _leave(self, endpoint: "InprocTransport", *, fire_will: bool) -> None:
        with self._lock:
            self._wild = [(f, e) for f, e in self._wild if e is not endpoint]
            self._exact = {f: kept for f, es in self._exact.items() if (kept := [e for e in es if e is not endpoint])}
        if fire_will and endpoint.will is not None:
            self._publish(endpoint.will.topic, endpoint.will.payload, endpoint.will.retain)


class InprocTransport(Transport):
    def __init__(self, hub: InprocHub, client_id: str, will: Will | None, queue_size: int) -> None:
        self.hub = hub
        self.client_id = client_id
        self.will = will
        self._inbox = Inbox(queue_size)

    def connect(self) -> "InprocTransport":
        return self

    def subscribe(self, topic_filter: str) -> None:
        self.hub._subscribe(self, topic_filter)

    def unsubscribe(self, topic_filter: str) -> None:
        self.hub._unsubscribe(self, topic_filter)

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        self.hub._publish(topic, bytes(payload), retain)

    def get(self, timeout: float) -> Incoming | None:
        return self._inbox.get(timeout)

    def close(self) -> None:
        self.hub._leave(self, fire_will=False)

    def drop(self) -> None:
        self.hub._leave(self, fire_will=True)
