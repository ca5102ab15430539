"""Chunking: messages larger than a broker's packet limit travel in pieces.

:class:`ChunkingTransport` sits between the protocol and any
:class:`~edge_client.wire.transport_base.Transport`: it splits what is too large on the
way out (in the format of :mod:`edge_client.wire.chunk_format`) and reassembles on the way
in (with :mod:`edge_client.wire.reassembly`).

MQTT retains one message per topic, so the chunks of a *retained* message go to
``TOPIC/0``, ``TOPIC/1``, ... (all retained) and the receiver subscribes to
``TOPIC/+`` as well; chunks of other messages go to the topic itself.

This module is also the import path for the chunk format and the reassembler, which
callers have always found here.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from edge_client.wire.chunk_format import (HEADER_BYTES, MAGIC, MIN_MESSAGE_BYTES, ChunkError, is_chunk, read_header,
                                           split)
from edge_client.wire.reassembly import DEFAULT_PARTIAL_MESSAGES, DEFAULT_TIMEOUT, Assembled, Reassembler
from edge_client.wire.transport_base import Incoming, Transport
from edge_client.wire.transport_errors import MessageTooLarge

__all__ = ["MAGIC", "HEADER_BYTES", "MIN_MESSAGE_BYTES", "DEFAULT_PACKET_BYTES", "DEFAULT_TIMEOUT",
           "DEFAULT_PARTIAL_BYTES", "DEFAULT_PARTIAL_MESSAGES", "ChunkError", "MessageTooLarge", "split",
           "read_header", "is_chunk", "Assembled", "Reassembler", "ChunkingTransport"]

DEFAULT_PACKET_BYTES = 256 * 1024
DEFAULT_PARTIAL_BYTES = 64 * 1024 * 1024   # data of incomplete messages a transport holds, all senders


class ChunkingTransport(Transport):
    """Wraps a transport: splits what is too large on the way out, reassembles on the way in.

    ``get`` returns whole messages with their size on the wire (all chunks) in
    ``Incoming.wire_bytes``; a message that failed to reassemble comes back with an
    empty payload and the reason in ``Incoming.error``, and an ignored duplicate chunk
    with an empty payload and only its bytes. Empty payloads (MQTT's way of clearing
    a retained message) are skipped.
    """

    def __init__(self, inner: Transport, *, max_message_bytes: int = DEFAULT_PACKET_BYTES,
                 max_decoded_bytes: int, chunking: bool = True, timeout: float = DEFAULT_TIMEOUT,
                 max_partial_bytes: int | None = None,
                 max_partial_messages: int = DEFAULT_PARTIAL_MESSAGES) -> None:
        """``max_partial_bytes``: data that incomplete messages may hold, over all topics
        (default the larger of :data:`DEFAULT_PARTIAL_BYTES` and ``max_decoded_bytes``, so
        the largest accepted message always fits); ``max_partial_messages``: how many may
        be incomplete at once. Past either, the oldest incomplete messages are dropped."""
        if max_message_bytes < MIN_MESSAGE_BYTES:
            raise ValueError(f"max_message_bytes must be at least {MIN_MESSAGE_BYTES}, got {max_message_bytes}")
        if max_partial_bytes is None:
            max_partial_bytes = max(DEFAULT_PARTIAL_BYTES, max_decoded_bytes)
        if max_partial_bytes < max_decoded_bytes:
            raise ValueError(f"max_partial_bytes={max_partial_bytes} is below max_decoded_bytes={max_decoded_bytes}, "
                             "so the largest accepted message could never be reassembled; raise max_partial_bytes "
                             "or lower max_decoded_bytes")
        self.inner = inner
        self.max_message_bytes = max_message_bytes
        self.chunking = chunking
        self.reassembler = Reassembler(max_message_bytes=max_decoded_bytes, total_bytes=max_partial_bytes,
                                       max_partial_messages=max_partial_messages, timeout=timeout)
        self._ready: deque[Incoming] = deque()
        self._parts: dict[str, int] = {}     # retained topic -> chunks we last published there
        self._next_expiry = 0.0

    def check_size(self, payload: bytes) -> None:
        """Raise MessageTooLarge when ``payload`` cannot be sent as it is configured."""
        if len(payload) > self.max_message_bytes and not self.chunking:
            raise MessageTooLarge(f"message of {len(payload)} bytes exceeds max_message_bytes="
                                  f"{self.max_message_bytes} and chunking is off; turn chunking on "
                                  "(transport.chunking) or use a more compact codec")

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> int:
        """Publish, in chunks when needed; return the bytes put on the wire (headers included)."""
        self.check_size(payload)
        previous = self._parts.pop(topic, 0) if retain else 0
        if len(payload) <= self.max_message_bytes:
            self.inner.publish(topic, payload, retain=retain)
            stale = range(previous)
            sent = len(payload)
        else:
            chunks = split(payload, self.max_message_bytes, part_topic=retain)
            for i, chunk in enumerate(chunks):
                self.inner.publish(f"{topic}/{i}" if retain else topic, chunk, retain=retain)
            if retain:
                self._parts[topic] = len(chunks)
                self.inner.publish(topic, b"", retain=True)   # clear an older unchunked copy
            stale = range(len(chunks), previous)
            sent = sum(len(c) for c in chunks)
        for i in stale:
            self.inner.publish(f"{topic}/{i}", b"", retain=True)
        return sent

    def announce(self, topic: str, payload: bytes) -> None:
        """A birth message goes to the wrapped transport, which repeats it after reconnects."""
        if len(payload) <= self.max_message_bytes:
            self.inner.announce(topic, payload)
        else:
            self.publish(topic, payload, retain=True)

    def subscribe(self, topic_filter: str, *, parts: bool = False) -> None:
        """Subscribe; ``parts`` also takes the chunks of retained messages (``FILTER/+``)."""
        self.inner.subscribe(topic_filter)
        if parts:
            self.inner.subscribe(topic_filter + "/+")

    def unsubscribe(self, topic_filter: str, *, parts: bool = False) -> None:
        self.inner.unsubscribe(topic_filter)
        if parts:
            self.inner.unsubscribe(topic_filter + "/+")

    def _accept(self, item: Incoming) -> None:
        payload = item.payload
        if not payload:
            return
        if not is_chunk(payload):
            self._ready.append(Incoming(item.topic, payload, item.received_at, wire_bytes=len(payload)))
            return
        topic = item.topic
        base, _, last = topic.rpartition("/")
        try:
            head = read_header(payload)     # the header only: the reassembler copies the data if it keeps it
            if head.part_topic and last != str(head.index):
                raise ChunkError(f"chunk {head.index} of a retained message arrived on {topic}")
        except ChunkError as exc:
            self._ready.append(Incoming(topic, b"", item.received_at, wire_bytes=len(payload), error=str(exc)))
            return
        sender = base if head.part_topic else topic
        for done in self.reassembler.feed(sender, payload):
            self._ready.append(Incoming(done.sender, done.payload, item.received_at, wire_bytes=done.wire_bytes,
                                        error=done.error))

    def _expire(self) -> None:
        now = time.monotonic()
        if now >= self._next_expiry:
            self._next_expiry = now + 1.0
            for done in self.reassembler.expire():
                self._ready.append(Incoming(done.sender, b"", wire_bytes=done.wire_bytes, error=done.error))

    def get(self, timeout: float) -> Incoming | None:
        deadline = time.monotonic() + timeout
        while True:
            self._expire()
            if self._ready:
                return self._ready.popleft()
            item = self.inner.get(max(0.0, deadline - time.monotonic()))
            if item is not None:
                self._accept(item)
            elif time.monotonic() >= deadline:
                return None

    def prefer(self, topics: Iterable[str]) -> None:
        self.inner.prefer(topics)

    def close(self) -> None:
        self.inner.close()

    @property
    def connected(self) -> bool:
        return self.inner.connected

    @property
    def dropped_by(self) -> dict[str, int]:
        return self.inner.dropped_by

    @property
    def disconnects(self) -> int:   # type: ignore[override]
        return self.inner.disconnects
