"""How the coordinator publishes: one rule for every message it sends.

A message too large for the broker ends the run (no retry can make it fit; the error says
what to change); any other failed publish is logged and left to the protocol's own
recovery (devices re-send results, attempts are retried, retained messages go again after
a reconnect).
"""

from __future__ import annotations

import logging

from coordinator.runtime.run_error import RunError
from edge_client.wire.protocol import StatusBody, encode
from edge_client.wire.transport import MessageTooLarge, Transport, TransportError

__all__ = ["Outbox"]

log = logging.getLogger("fedge.coordinator")


class Outbox:
    """Publishes the coordinator's messages for run ``run_id`` through ``transport``."""

    def __init__(self, transport: Transport, run_id: str) -> None:
        self.transport = transport
        self.run_id = run_id

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> int:
        """Publish (in chunks if needed) and return the bytes sent; a message too large ends the run."""
        try:
            return self.transport.publish(topic, payload, retain=retain)
        except MessageTooLarge as exc:
            raise RunError(f"cannot send to {topic}: {exc}") from None
        except TransportError as exc:
            log.error("could not publish to %s: %s", topic, exc)
            return 0

    def status(self, topic: str, round: int, task_id: str, state: str, reason: str = "") -> None:
        """The coordinator's verdict on one result or claim (``ack`` or ``rejected``), on ``topic``."""
        payload = encode("status", run_id=self.run_id, round=round, task_id=task_id, sender="coordinator",
                         body=StatusBody(state, task_id, reason).to_body())
        self.publish(topic, payload)
