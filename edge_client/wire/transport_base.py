"""What every transport offers: the interface the client loop and the round engine are written against,
the message it hands out and the last will it leaves with the broker.

Transports move opaque byte payloads between topics and never look inside one, so
the same client loop and round engine run over MQTT or in one process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable

__all__ = ["Will", "Incoming", "Transport"]


@dataclass(frozen=True)
class Will:
    """Last-will message the broker publishes if we vanish without disconnecting."""

    topic: str
    payload: bytes
    retain: bool = True


@dataclass(frozen=True)
class Incoming:
    topic: str
    payload: bytes
    # time.monotonic() when the message reached this process, for the receiver's profile
    received_at: float = field(default_factory=time.monotonic, compare=False)
    wire_bytes: int = 0      # bytes it took on the wire (all chunks); set by edge_client.wire.chunking
    error: str = ""          # set instead of a payload when reassembling its chunks failed


class Transport:
    """What the client loop and the coordinator need from a transport."""

    def subscribe(self, topic_filter: str) -> None:
        raise NotImplementedError

    def unsubscribe(self, topic_filter: str) -> None:
        raise NotImplementedError

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        raise NotImplementedError

    def announce(self, topic: str, payload: bytes) -> None:
        """Publish a retained "birth" message now and again after every reconnect.

        A broker that fired our last will during a network drop keeps saying we are
        offline until we say otherwise, so the presence must follow each reconnect.
        """
        self.publish(topic, payload, retain=True)

    def get(self, timeout: float) -> Incoming | None:
        """Next incoming message, or None after ``timeout`` seconds."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def prefer(self, topics: Iterable[str]) -> None:
        """Read these topics' waiting messages before any other's (the results a round waits for)."""
        inbox = getattr(self, "_inbox", None)
        if inbox is not None:
            inbox.prefer(topics)

    @property
    def dropped_by(self) -> dict[str, int]:
        """Messages received but dropped before anyone read them, by reason (a full or flooded inbox)."""
        inbox = getattr(self, "_inbox", None)
        return dict(inbox.dropped_by) if inbox is not None else {}

    # Whether the broker is reachable now (an in-process hub always is), and the connections to it
    # lost since connect(): what a device saw of it. A transport with a broker keeps them up to date.
    connected: bool = True
    disconnects: int = 0

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
