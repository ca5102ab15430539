"""Chunking: messages larger than a broker's packet limit travel in pieces.

Brokers cap the size of one publish (EMQX 1 MB by default, AWS IoT Core 128 KB,
Mosquitto's ``max_packet_size``), and a float32 model is often larger. A message
above ``max_message_bytes`` is split into chunks, each a 72-byte header and a
slice of the message:

====================  ======================================================
magic (4 bytes)       ``FDC1``; it can never start an envelope or a
                      compressed message
flags (1 byte)        bit 0: the chunk went to ``TOPIC/INDEX`` (retained)
reserved (3 bytes)    zero
message id (16)       random, new for every publish of a message
index, count (u32)    this chunk's position, the number of chunks
length (u64)          the whole message's length
sha256 (32)           the whole message's SHA-256
====================  ======================================================

MQTT retains one message per topic, so the chunks of a *retained* message go to
``TOPIC/0``, ``TOPIC/1``, ... (all retained) and the receiver subscribes to
``TOPIC/+`` as well; chunks of other messages go to the topic itself.

The receiver (:class:`Reassembler`) accepts chunks in any order, ignores
duplicates, bounds what it holds for incomplete messages per sender (topic) and
in total, drops incomplete messages after a timeout, and verifies the length and
hash before handing a message on. Every failure is reported with its reason and
the bytes it cost; none raises. :class:`ChunkingTransport` puts all of this
between the protocol and any :class:`~edge_client.wire.transport.Transport`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from edge_client.wire.transport import Incoming, MessageTooLarge, Transport

__all__ = ["MAGIC", "HEADER_BYTES", "MIN_MESSAGE_BYTES", "DEFAULT_PACKET_BYTES", "DEFAULT_TIMEOUT",
           "ChunkError", "MessageTooLarge", "Chunk", "split", "parse_chunk", "is_chunk", "Reassembler",
           "ChunkingTransport"]

log = logging.getLogger("fedge.chunking")

MAGIC = b"FDC1"
_HEADER = struct.Struct("<4sB3x16sIIQ32s")
HEADER_BYTES = _HEADER.size
MIN_MESSAGE_BYTES = 1024
DEFAULT_PACKET_BYTES = 256 * 1024
DEFAULT_TIMEOUT = 120.0
_PART_TOPIC = 1
_REMEMBERED = 64          # finished message ids kept per sender, to ignore late duplicates


class ChunkError(ValueError):
    """A chunk that cannot be accepted; ``str(err)`` is the logged reason."""


@dataclass(frozen=True)
class Chunk:
    message_id: bytes
    index: int
    count: int
    length: int
    digest: bytes
    part_topic: bool
    data: bytes


def is_chunk(payload: bytes) -> bool:
    return bytes(payload[:4]) == MAGIC


def split(payload: bytes, max_message_bytes: int, *, part_topic: bool = False) -> list[bytes]:
    """The chunks of ``payload``, each at most ``max_message_bytes`` long."""
    if max_message_bytes < MIN_MESSAGE_BYTES:
        raise ValueError(f"max_message_bytes must be at least {MIN_MESSAGE_BYTES}, got {max_message_bytes}")
    step = max_message_bytes - HEADER_BYTES
    count = max(1, -(-len(payload) // step))
    message_id, digest = os.urandom(16), hashlib.sha256(payload).digest()
    flags = _PART_TOPIC if part_topic else 0
    return [_HEADER.pack(MAGIC, flags, message_id, i, count, len(payload), digest) + payload[i * step:(i + 1) * step]
            for i in range(count)]


def parse_chunk(payload: bytes) -> Chunk:
    if len(payload) < HEADER_BYTES or not is_chunk(payload):
        raise ChunkError(f"not a chunk ({len(payload)} bytes without a complete chunk header)")
    _, flags, message_id, index, count, length, digest = _HEADER.unpack_from(payload)
    data = bytes(payload[HEADER_BYTES:])
    if count < 1 or index >= count or count > max(length, 1) or len(data) > length:
        raise ChunkError(f"chunk {index} of {count} with {len(data)} bytes does not fit a {length}-byte message")
    return Chunk(message_id, index, count, length, digest, bool(flags & _PART_TOPIC), data)


@dataclass
class _Partial:
    first: Chunk
    started: float
    parts: dict[int, bytes] = field(default_factory=dict)
    held: int = 0


@dataclass(frozen=True)
class Assembled:
    """What feeding chunks produced: a whole message, a failure, or bytes of an ignored chunk."""

    sender: str
    payload: bytes = b""
    wire_bytes: int = 0
    error: str = ""


class Reassembler:
    """Puts chunks back together, per sender, within bounded memory and time."""

    def __init__(self, *, max_message_bytes: int, per_sender_bytes: int | None = None,
                 total_bytes: int | None = None, timeout: float = DEFAULT_TIMEOUT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_message_bytes = max_message_bytes
        self.per_sender_bytes = per_sender_bytes or max_message_bytes
        self.total_bytes = total_bytes or 4 * max_message_bytes
        self.timeout = timeout
        self.clock = clock
        self._partial: OrderedDict[tuple[str, bytes], _Partial] = OrderedDict()   # oldest first
        self._finished: dict[str, deque[bytes]] = {}

    @property
    def held(self) -> int:
        return sum(p.held for p in self._partial.values())

    def _finish(self, sender: str, message_id: bytes) -> None:
        self._finished.setdefault(sender, deque(maxlen=_REMEMBERED)).append(message_id)

    def _drop(self, key: tuple[str, bytes], reason: str) -> Assembled:
        partial = self._partial.pop(key)
        self._finish(key[0], key[1])
        return Assembled(key[0], wire_bytes=partial.held + len(partial.parts) * HEADER_BYTES,
                         error=f"{reason} (got {len(partial.parts)} of {partial.first.count} chunks)")

    def feed(self, sender: str, payload: bytes) -> list[Assembled]:
        """Take one chunk from ``sender``; return what completed or failed because of it."""
        now = self.clock()
        try:
            chunk = parse_chunk(payload)
        except ChunkError as exc:
            return [Assembled(sender, wire_bytes=len(payload), error=str(exc))]
        key = (sender, chunk.message_id)
        if chunk.message_id in self._finished.get(sender, ()):
            return [Assembled(sender, wire_bytes=len(payload))]          # a late duplicate
        if chunk.length > self.max_message_bytes:
            self._finish(sender, chunk.message_id)
            return [Assembled(sender, wire_bytes=len(payload),
                              error=f"chunked message of {chunk.length} bytes exceeds the limit of "
                                    f"{self.max_message_bytes}")]
        partial = self._partial.get(key)
        if partial is None:
            partial = self._partial[key] = _Partial(chunk, now)
        first = partial.first
        if (chunk.count, chunk.length, chunk.digest, chunk.part_topic) != (first.count, first.length, first.digest,
                                                                          first.part_topic):
            return [Assembled(sender, wire_bytes=len(payload),
                              error=f"chunk {chunk.index} disagrees with the other chunks of its message")]
        if chunk.index in partial.parts:
            return [Assembled(sender, wire_bytes=len(payload))]          # a duplicate
        out = self._make_room(key, len(chunk.data))
        if key not in self._partial:   # its own sender bound could not fit it
            return out
        partial.parts[chunk.index] = chunk.data
        partial.held += len(chunk.data)
        if partial.held > first.length:
            return out + [self._drop(key, f"chunks carry more than the declared {first.length} bytes")]
        if len(partial.parts) == first.count:
            out.append(self._complete(key))
        return out

    def _make_room(self, key: tuple[str, bytes], size: int) -> list[Assembled]:
        """Drop the oldest incomplete messages until ``size`` more bytes fit both bounds."""
        out = []
        sender = key[0]
        while sum(p.held for k, p in self._partial.items() if k[0] == sender) + size > self.per_sender_bytes:
            oldest = next(k for k in self._partial if k[0] == sender)
            out.append(self._drop(oldest, f"dropped: {sender} holds more than {self.per_sender_bytes} bytes "
                                          "of incomplete messages"))
            if oldest == key:
                return out
        while self.held + size > self.total_bytes:
            oldest = next((k for k in self._partial if k != key), key)
            out.append(self._drop(oldest, f"dropped: incomplete messages exceed {self.total_bytes} bytes in total"))
            if oldest == key:
                break
        return out

    def _complete(self, key: tuple[str, bytes]) -> Assembled:
        partial = self._partial.pop(key)
        self._finish(*key)
        payload = b"".join(partial.parts[i] for i in range(partial.first.count))
        wire = len(payload) + partial.first.count * HEADER_BYTES
        if len(payload) != partial.first.length:
            return Assembled(key[0], wire_bytes=wire, error=f"reassembled {len(payload)} bytes, the chunks "
                                                            f"declared {partial.first.length}")
        if hashlib.sha256(payload).digest() != partial.first.digest:
            return Assembled(key[0], wire_bytes=wire, error="reassembled message does not match its SHA-256 "
                                                            "(a chunk was altered)")
        return Assembled(key[0], payload=payload, wire_bytes=wire)

    def expire(self) -> list[Assembled]:
        """Drop incomplete messages whose first chunk is older than the timeout."""
        now = self.clock()
        old = [k for k, p in self._partial.items() if now - p.started > self.timeout]
        return [self._drop(k, f"incomplete after {self.timeout:.0f} s") for k in old]


class ChunkingTransport(Transport):
    """Wraps a transport: splits what is too large on the way out, reassembles on the way in.

    ``get`` returns whole messages with their size on the wire (all chunks) in
    ``Incoming.wire_bytes``; a message that failed to reassemble comes back with an
    empty payload and the reason in ``Incoming.error``, and an ignored duplicate chunk
    with an empty payload and only its bytes. Empty payloads (MQTT's way of clearing
    a retained message) are skipped.
    """

    def __init__(self, inner: Transport, *, max_message_bytes: int = DEFAULT_PACKET_BYTES,
                 max_decoded_bytes: int, chunking: bool = True, timeout: float = DEFAULT_TIMEOUT) -> None:
        if max_message_bytes < MIN_MESSAGE_BYTES:
            raise ValueError(f"max_message_bytes must be at least {MIN_MESSAGE_BYTES}, got {max_message_bytes}")
        self.inner = inner
        self.max_message_bytes = max_message_bytes
        self.chunking = chunking
        self.reassembler = Reassembler(max_message_bytes=max_decoded_bytes, timeout=timeout)
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
            chunk = parse_chunk(payload)
            if chunk.part_topic and last != str(chunk.index):
                raise ChunkError(f"chunk {chunk.index} of a retained message arrived on {topic}")
        except ChunkError as exc:
            self._ready.append(Incoming(topic, b"", item.received_at, wire_bytes=len(payload), error=str(exc)))
            return
        sender = base if chunk.part_topic else topic
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

    def close(self) -> None:
        self.inner.close()
