"""The retained messages every device reads: the run's status and the exchange's model broadcast.

The model broadcast carries the tensors every task of an exchange shares; it is published
only when its bytes change (devices keep the newest ones they got), and again on a retried
attempt. Both messages are published again when the connection to the broker comes back:
a broker restarted without persistence (or before its autosave) has forgotten them, and
devices would park every task for want of a running status, or wait for a broadcast that
never comes. With delta broadcasts (``codec.down_delta``) the delta message goes beside the
model message, retained on its own topic, and is published again with it.
"""

from __future__ import annotations

import logging

import torch

from coordinator.runtime.downlink import Downlink
from coordinator.runtime.outbox import Outbox
from coordinator.runtime.round_book import RoundBook, SentModel
from edge_client.wire.protocol import StatusBody, Topics, encode

__all__ = ["Broadcast"]

log = logging.getLogger("fedge.coordinator")


class Broadcast:
    """Publishes the run status and the model broadcast (retained) and remembers what it last published."""

    def __init__(self, outbox: Outbox, topics: Topics, downlink: Downlink, session: str) -> None:
        self.outbox = outbox
        self.topics = topics
        self.downlink = downlink
        self.session = session
        self.digest = ""             # the model message last published
        self._model_payload = b""    # ... and its bytes, published again after a reconnect
        self._delta_payload = b""    # the delta message published beside it, likewise
        self._status_payload = b""   # the run status last announced, likewise
        self._was_connected = True

    def announce(self, state: str, round: int) -> None:
        """Tell every client the run's state and current round (older tasks are stale)."""
        payload = encode("status", run_id=self.outbox.run_id, round=round, task_id="", sender="coordinator",
                         body=StatusBody(state, session=self.session).to_body())
        self.outbox.publish(self.topics.coordinator_status, payload, retain=True)
        self._status_payload = payload

    def publish_model(self, book: RoundBook, tensors: dict[str, torch.Tensor]) -> str:
        """Publish the exchange's shared tensors (retained) unless already there; return their hash.

        A retry publishes it again even when unchanged: a broker that restarted without
        persistence has lost the retained copy, and devices waiting for it would never get it.
        """
        messages = self.downlink.broadcast(book.round, tensors)
        digest = messages.digest
        if digest != self.digest or book.attempt > 0:
            sent = self.outbox.publish(self.topics.model, messages.payload, retain=True)
            book.tally.bytes_down += sent
            book.tally.bytes_broadcast += sent
            self.digest = digest if sent else ""
            self._model_payload = messages.payload if sent else b""
            sent_delta = 0
            if messages.delta_payload:   # after the model: a device that falls back finds it there
                sent_delta = self.outbox.publish(self.topics.model_delta, messages.delta_payload, retain=True)
                book.tally.bytes_down += sent_delta
                book.tally.bytes_broadcast += sent_delta
                book.tally.bytes_delta += sent_delta
            self._delta_payload = messages.delta_payload if sent_delta else b""
        if messages.model_digest is not None:   # tasks offer the delta only when it is at the broker
            offered = bool(self._delta_payload) and self._delta_payload == messages.delta_payload
            book.sent_model = SentModel(messages.model_digest, messages.delta_digest if offered else None,
                                        messages.base if offered else None, len(messages.payload),
                                        len(messages.delta_payload) if offered else 0)
        return digest

    def reconnected(self, connected: bool) -> bool:
        """Given whether the transport is connected now: True when it has just come back, after publishing the
        run status and the model broadcast again (the caller republishes what else is retained)."""
        came_back = connected and not self._was_connected
        self._was_connected = connected
        if not came_back:
            return False
        log.warning("reconnected to the broker: publishing the run status and the model broadcast again")
        if self._status_payload:
            self.outbox.publish(self.topics.coordinator_status, self._status_payload, retain=True)
        if self._model_payload:
            self.outbox.publish(self.topics.model, self._model_payload, retain=True)
        if self._model_payload and self._delta_payload:
            self.outbox.publish(self.topics.model_delta, self._delta_payload, retain=True)
        return True
