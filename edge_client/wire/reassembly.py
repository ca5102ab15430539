"""Putting chunks back together, within bounded memory and time.

Anyone who may publish on a topic the receiver reads can send chunks that never
complete, so the :class:`Reassembler` accepts chunks in any order, ignores
duplicates, bounds what it holds for incomplete messages per sender (topic), in
total and in number (dropping the oldest first), drops incomplete messages after a
timeout, and verifies the length and hash before handing a message on. Every
failure is reported with its reason and the bytes it cost; none raises.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from edge_client.wire.chunk_format import HEADER_BYTES, ChunkError, ChunkHeader, read_header

__all__ = ["DEFAULT_TIMEOUT", "DEFAULT_PARTIAL_MESSAGES", "Assembled", "Reassembler"]

DEFAULT_TIMEOUT = 120.0
DEFAULT_PARTIAL_MESSAGES = 4096            # incomplete messages a receiver holds at once
_REMEMBERED = 64          # finished message ids kept per sender, to ignore late duplicates
_REMEMBERED_SENDERS = 1024   # senders whose finished ids are kept


@dataclass
class _Partial:
    first: ChunkHeader
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
            head = read_header(payload)
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

    def _refuse(self, head: ChunkHeader) -> str:
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
