"""The receive queue every transport delivers through: bounded, fair between topics, rate-limited per topic.

Incoming messages wait here until the client loop or the round engine reads them; a
flooding or broken sender is cut off here, before its messages cost a decode.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from typing import Callable, Iterable

from edge_client.wire.throttle import ThrottledLog
from edge_client.wire.transport_base import Incoming

__all__ = ["Inbox", "Ack", "DEFAULT_MAX_BYTES"]

log = logging.getLogger("fedge.transport")

Ack = Callable[[], None] | None   # acknowledges one message to its sender (the broker)
DEFAULT_MAX_BYTES = 256 * 1024 * 1024


class Inbox:
    """What arrived and is not read yet: one queue per topic, served in turn, bounded in total and per topic.

    A device flooding its own topic (or a broken one resending in a loop) must not
    crowd out everyone else: a topic may hold at most ``share`` of the inbox's messages
    and bytes, beyond which its newest messages are dropped, and :meth:`get` takes one
    message from each topic in turn, so the others' results are read at their own pace
    however much one topic holds. Each topic also has a token bucket (``burst`` messages,
    refilled at ``rate`` a second): a legitimate device sends a few chunked messages a
    round, so a topic publishing faster than that for long is flooding, and its excess is
    dropped on arrival, before it costs a decode. Topics named by :meth:`prefer` (the
    result topics of the clients selected this round) are served before the rest. Drops
    are counted by reason (:attr:`dropped_by`) and their warnings throttled.

    Backpressure: a message put with an ``ack`` (the transport's MQTT acknowledgement) is
    acknowledged when it is taken by :meth:`get`, or at once when it is dropped as a flood, so
    a broker honouring the receive maximum (``window``) never has more than that many
    messages delivered and not taken. Such a message is never dropped for a full inbox: it
    is already in memory, and dropping it costs its sender a re-send of the whole result. A
    broker that releases more than one message per acknowledgement (Mosquitto 2.0.11 sends a
    whole window after each) is held back by acknowledging only while the inbox holds at most
    one window: the acknowledgements of messages taken meanwhile wait, one sent per later
    take. What was kept beyond the bounds anyway is counted in :attr:`held_over`.
    """

    def __init__(self, maxsize: int, max_bytes: int = DEFAULT_MAX_BYTES, share: float = 0.25,
                 rate: float = 200.0, burst: int = 2_000, window: int = 0) -> None:
        self.maxsize, self.max_bytes, self.window = maxsize, max_bytes, window
        self.topic_messages = max(1, int(maxsize * share))
        self.topic_bytes = max(1, int(max_bytes * share))
        self.rate, self.burst = rate, burst
        self._buckets: dict[str, tuple[float, float]] = {}   # topic -> (tokens, when counted)
        self._preferred: frozenset[str] = frozenset()
        self._queues: OrderedDict[str, deque[tuple[Incoming, Ack]]] = OrderedDict()   # topics in serving order
        self._bytes: dict[str, int] = {}
        self._count = self._total_bytes = 0
        self._ready = threading.Condition()
        self._unacked: deque[Callable[[], None]] = deque()   # taken, acknowledgement held back
        self.dropped_by: Counter[str] = Counter()
        self.held_over = 0      # acknowledged-on-take messages kept past the bounds after waiting for room
        self._warn = ThrottledLog(log)

    @property
    def dropped(self) -> int:
        return sum(self.dropped_by.values())

    def put(self, item: Incoming, ack: Ack = None) -> None:
        """Queue ``item``; with ``ack``, acknowledge it when taken, and keep it even when the inbox is full."""
        size = len(item.payload)
        with self._ready:
            held = len(self._queues.get(item.topic, ()))
            if not self._take_token(item.topic, item.received_at):
                reason = "one topic over its rate limit"
            elif held >= self.topic_messages or self._bytes.get(item.topic, 0) + size > self.topic_bytes:
                reason = "one topic over its share of the inbox"
            elif self._full(size) and ack is None:
                reason = "inbox full"
            else:
                self.held_over += ack is not None and self._full(size)
                self._append(item, ack, size)
                return
            self.dropped_by[reason] += 1
        if ack is not None:
            ack()   # a flood is not taken: let the broker move on
        self._warn.warning("dropped a message on %s: %s", item.topic, reason)

    def _full(self, size: int) -> bool:
        return self._count >= self.maxsize or self._total_bytes + size > self.max_bytes

    def _append(self, item: Incoming, ack: Ack, size: int) -> None:
        """Queue ``item`` (call holding the lock)."""
        queue_ = self._queues.get(item.topic)
        if queue_ is None:
            queue_ = self._queues[item.topic] = deque()
        queue_.append((item, ack))
        self._bytes[item.topic] = self._bytes.get(item.topic, 0) + size
        self._count += 1
        self._total_bytes += size
        self._ready.notify()

    def prefer(self, topics: Iterable[str]) -> None:
        """Serve these topics' messages before any other's until the next call."""
        with self._ready:
            self._preferred = frozenset(topics)

    def _take_token(self, topic: str, now: float) -> bool:
        """Spend one of the topic's tokens; False when it has none left (call holding the lock)."""
        tokens, then = self._buckets.get(topic, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate)
        if tokens < 1.0:
            self._buckets[topic] = (tokens, now)
            return False
        self._buckets[topic] = (tokens - 1.0, now)
        if len(self._buckets) > 4 * self.maxsize:   # forget topics whose bucket has refilled
            full = [t for t, (k, w) in self._buckets.items() if k + (now - w) * self.rate >= self.burst]
            for t in full:
                del self._buckets[t]
        return True

    def get(self, timeout: float) -> Incoming | None:
        deadline = time.monotonic() + max(0.0, timeout)
        item: Incoming | None = None
        with self._ready:
            while not self._queues:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._warn.flush()
                    break
                self._ready.wait(remaining)
            else:
                item, taken = self._take()
                if taken is not None:
                    self._unacked.append(taken)
            # One held-back acknowledgement per call: after a take while at most a window waits, or when quiet.
            ack = self._unacked.popleft() if self._unacked and self._count <= self.window else None
        if ack is not None:
            ack()
        return item

    def _take(self) -> tuple[Incoming, Ack]:
        """The next message in serving order, out of its queue (call holding the lock)."""
        topic = next((t for t in self._queues if t in self._preferred), None) if self._preferred else None
        if topic is None:
            topic = next(iter(self._queues))
        queue_ = self._queues[topic]
        item, ack = queue_.popleft()
        if queue_:
            self._queues.move_to_end(topic)     # the next topic's turn
        else:
            del self._queues[topic]
            self._bytes.pop(topic, None)
        if topic in self._bytes:
            self._bytes[topic] -= len(item.payload)
        self._count -= 1
        self._total_bytes -= len(item.payload)
        return item, ack
