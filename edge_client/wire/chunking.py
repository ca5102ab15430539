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
duplicates, bounds what it holds for incomplete messages per sender (topic), in
total and in number (dropping the oldest first), drops incomplete messages after
a timeout, and verifies the length and hash before handing a message on. Every failure is reported with its reason and
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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from edge_client.wire.transport import Incoming, MessageTooLarge, Transport
from storage.errors import FedgeError

__all__ = ["MAGIC", "HEADER_BYTES", "MIN_MESSAGE_BYTES", "DEFAULT_PACKET_BYTES", "DEFAULT_TIMEOUT",
           "DEFAULT_PARTIAL_BYTES", "DEFAULT_PARTIAL_MESSAGES", "ChunkError", "MessageTooLarge", "Chunk", "split",
           "parse_chunk", "is_chunk", "Reassembler", "ChunkingTransport"]

log = logging.getLogger("fedge.chunking")

MAGIC = b"FDC1"
_HEADER = struct.Struct("<4sB3x16sIIQ32s")
HEADER_BYTES = _HEADER.size
MIN_MESSAGE_BYTES = 1024
DEFAULT_PACKET_BYTES = 256 * 1024
DEFAULT_TIMEOUT = 120.0
_PART_TOPIC = 1
DEFAULT_PARTIAL_BYTES = 64 * 1024 * 1024   # data of incomplete messages a transport holds, all senders
DEFAULT_PARTIAL_MESSAGES = 4096            # incomplete messages a receiver holds at once
_REMEMBERED = 64          # finished message ids kept per sender, to ignore late duplicates
_REMEMBERED_SENDERS = 1024   # senders whose finished ids are kept


class ChunkError(FedgeError, ValueError):
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


class _Header(NamedTuple):
    """A chunk's header, checked, and the size of the data behind it (not yet copied)."""

    message_id: bytes
    index: int
    count: int
    length: int
    digest: bytes
    part_topic: bool
    size: int


def _read_header(payload: bytes) -> _Header:
    """Check a chunk's header without copying its data, so a bad chunk costs no allocation."""
    if len(payload) < HEADER_BYTES or not is_chunk(payload):
        raise ChunkError(f"not a chunk ({len(payload)} bytes without a complete chunk header)")
    _, flags, message_id, index, count, length, digest = _HEADER.unpack_from(payload)
    size = len(payload) - HEADER_BYTES
    if count < 1 or index >= count or count > max(length, 1) or size > length:
        raise ChunkError(f"chunk {index} of {count} with {size} bytes does not fit a {length}-byte message")
    return _Header(message_id, index, count, length, digest, bool(flags & _PART_TOPIC), size)


def parse_chunk(payload: bytes) -> Chunk:
    head = _read_header(payload)
    return Chunk(head.message_id, head.index, head.count, head.length, head.digest, head.part_topic,
                 bytes(payload[HEADER_BYTES:]))


@dataclass
class _Partial:
    first: _Header
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


_Key = tuple[str, bytes]   # (sender, message id)


class Reassembler:
    """Puts chunks back together, per sender, within bounded memory and time.

    Bounds: the data held for incomplete messages of one sender (``per_sender_bytes``,
    default ``max_message_bytes``) and of all senders (``total_bytes``, default four
    times ``max_message_bytes``), and the number of incomplete messages
    (``max_partial_messages``), which stops a flood of tiny first chunks that the
    byte bounds alone would let pile up. Going over a bound drops the incomplete
    messages that started first (counted in :attr:`evicted`); a message still
    incomplete ``timeout`` seconds after its first chunk is dropped by
    :meth:`expire` (counted in :attr:`expired`).

    Every chunk costs O(1) amortized however many incomplete messages are held: they
    sit in arrival order (so the oldest, to evict or expire, is at the front) and the
    byte totals are kept running, never summed.
    """

    def __init__(self, *, max_message_bytes: int, per_sender_bytes: int | None = None,
                 total_bytes: int | None = None, max_partial_messages: int = DEFAULT_PARTIAL_MESSAGES,
                 timeout: float = DEFAULT_TIMEOUT, clock: Callable[[], float] = time.monotonic) -> None:
        if max_partial_messages < 1:
            raise ValueError(f"max_partial_messages must be at least 1, got {max_partial_messages}")
        self.max_message_bytes = max_message_bytes
        self.per_sender_bytes = per_sender_bytes or max_message_bytes
        self.total_bytes = total_bytes or 4 * max_message_bytes
        self.max_partial_messages = max_partial_messages
        self.timeout = timeout
        self.clock = clock
        self.evicted = 0     # incomplete messages dropped to stay within a bound
        self.expired = 0     # incomplete messages dropped by the timeout
        self._partial: OrderedDict[_Key, _Partial] = OrderedDict()          # by first chunk's arrival
        self._by_sender: dict[str, OrderedDict[bytes, None]] = {}           # same order, per sender
        self._sender_held: dict[str, int] = {}
        self._held = 0
        # Finished message ids per sender, to ignore late duplicates; senders least
        # recently finished are forgotten first, so many topics cannot grow it without end.
        self._finished: OrderedDict[str, deque[bytes]] = OrderedDict()

    @property
    def held(self) -> int:
        """Bytes of chunk data held for incomplete messages, all senders together."""
        return self._held

    @property
    def partial_messages(self) -> int:
        """How many messages are incomplete right now."""
        return len(self._partial)

    def _finish(self, sender: str, message_id: bytes) -> None:
        ids = self._finished.get(sender)
        if ids is None:
            ids = self._finished[sender] = deque(maxlen=_REMEMBERED)
            if len(self._finished) > _REMEMBERED_SENDERS:
                self._finished.popitem(last=False)
        else:
            self._finished.move_to_end(sender)
        ids.append(message_id)

    def _add(self, key: _Key, partial: _Partial) -> None:
        self._partial[key] = partial
        self._by_sender.setdefault(key[0], OrderedDict())[key[1]] = None

    def _store(self, key: _Key, partial: _Partial, index: int, data: bytes) -> None:
        partial.parts[index] = data
        partial.held += len(data)
        self._sender_held[key[0]] = self._sender_held.get(key[0], 0) + len(data)
        self._held += len(data)

    def _remove(self, key: _Key) -> _Partial:
        partial = self._partial.pop(key)
        sender = key[0]
        ids = self._by_sender[sender]
        del ids[key[1]]
        if not ids:
            del self._by_sender[sender]
        if partial.held:
            left = self._sender_held[sender] - partial.held
            if left:
                self._sender_held[sender] = left
            else:
                del self._sender_held[sender]
            self._held -= partial.held
        self._finish(*key)
        return partial

    def _drop(self, key: _Key, reason: str, extra_wire: int = 0) -> Assembled:
        partial = self._remove(key)
        return Assembled(key[0], wire_bytes=partial.held + len(partial.parts) * HEADER_BYTES + extra_wire,
                         error=f"{reason} (got {len(partial.parts)} of {partial.first.count} chunks)")

    def _evict(self, key: _Key, reason: str, extra_wire: int = 0) -> Assembled:
        self.evicted += 1
        return self._drop(key, reason, extra_wire)

    def feed(self, sender: str, payload: bytes) -> list[Assembled]:
        """Take one chunk from ``sender``; return what completed or failed because of it.

        Everything that can refuse a chunk (its header, the size limits, a finished or
        disagreeing message, a duplicate) is checked before its data is copied.
        """
        now = self.clock()
        wire = len(payload)
        try:
            head = _read_header(payload)
        except ChunkError as exc:
            return [Assembled(sender, wire_bytes=wire, error=str(exc))]
        key = (sender, head.message_id)
        finished = self._finished.get(sender)
        if finished is not None and head.message_id in finished:
            return [Assembled(sender, wire_bytes=wire)]          # a late duplicate
        partial = self._partial.get(key)
        if partial is None:
            refused = self._refuse(head)
            if refused:
                self._finish(sender, head.message_id)
                return [Assembled(sender, wire_bytes=wire, error=refused)]
        elif head[2:6] != partial.first[2:6]:   # count, length, digest, part topic
            return [Assembled(sender, wire_bytes=wire,
                              error=f"chunk {head.index} disagrees with the other chunks of its message")]
        elif head.index in partial.parts:
            return [Assembled(sender, wire_bytes=wire)]          # a duplicate
        elif partial.held + head.size > partial.first.length:
            return [self._drop(key, f"chunks carry more than the declared {partial.first.length} bytes", wire)]
        out: list[Assembled] = []
        if partial is None:
            while len(self._partial) >= self.max_partial_messages:
                out.append(self._evict(next(iter(self._partial)), "dropped: more than "
                                       f"{self.max_partial_messages} incomplete messages"))
            partial = _Partial(head, now)
            self._add(key, partial)
        out += self._make_room(key, head.size, wire)
        if key not in self._partial:   # dropped to make room for itself: its bytes went with it
            return out
        self._store(key, partial, head.index, bytes(payload[HEADER_BYTES:]))
        if len(partial.parts) == partial.first.count:
            out.append(self._complete(key))
        return out

    def _refuse(self, head: _Header) -> str:
        """Why the first chunk seen of a message refuses the whole message, or ``""``."""
        if head.length > self.max_message_bytes:
            return f"chunked message of {head.length} bytes exceeds the limit of {self.max_message_bytes}"
        room = min(self.per_sender_bytes, self.total_bytes)
        if head.length > room:
            return (f"chunked message of {head.length} bytes cannot be reassembled: incomplete messages may hold "
                    f"{room} bytes; raise the reassembler's byte bounds")
        return ""

    def _make_room(self, key: _Key, size: int, wire: int) -> list[Assembled]:
        """Drop the oldest incomplete messages until ``size`` more bytes fit both bounds."""
        out = []
        sender = key[0]
        while self._sender_held.get(sender, 0) + size > self.per_sender_bytes:
            oldest = (sender, next(iter(self._by_sender[sender])))
            out.append(self._evict(oldest, f"dropped: {sender} holds more than {self.per_sender_bytes} bytes "
                                            "of incomplete messages", wire if oldest == key else 0))
            if oldest == key:
                return out
        while self._held + size > self.total_bytes:
            oldest = next(k for k in self._partial if k != key) if len(self._partial) > 1 else key
            out.append(self._evict(oldest, f"dropped: incomplete messages exceed {self.total_bytes} bytes in total",
                                   wire if oldest == key else 0))
            if oldest == key:
                break
        return out

    def _complete(self, key: _Key) -> Assembled:
        partial = self._remove(key)
        count, length = partial.first.count, partial.first.length
        payload = b"".join(partial.parts[i] for i in range(count))
        wire = len(payload) + count * HEADER_BYTES
        if len(payload) != length:
            return Assembled(key[0], wire_bytes=wire, error=f"reassembled {len(payload)} bytes, the chunks "
                                                            f"declared {length}")
        if hashlib.sha256(payload).digest() != partial.first.digest:
            return Assembled(key[0], wire_bytes=wire, error="reassembled message does not match its SHA-256 "
                                                            "(a chunk was altered)")
        return Assembled(key[0], payload=payload, wire_bytes=wire)

    def expire(self) -> list[Assembled]:
        """Drop incomplete messages whose first chunk is older than the timeout.

        They are in arrival order, so this looks only at the ones it drops and one more.
        """
        now = self.clock()
        out = []
        while self._partial:
            key, partial = next(iter(self._partial.items()))
            if now - partial.started <= self.timeout:
                break
            self.expired += 1
            out.append(self._drop(key, f"incomplete after {self.timeout:.0f} s"))
        return out


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
            head = _read_header(payload)     # the header only: the reassembler copies the data if it keeps it
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
