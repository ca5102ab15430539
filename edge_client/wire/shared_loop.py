"""One selector thread driving many MQTT connections of a process, with its timers.

paho's ``loop_start`` gives every connection a network thread that wakes on its own select()
at least once a second and a socket pair to be woken by (3 file descriptors per connection). A
process holding hundreds of device connections (the fleet benchmark's stand-in devices) pays
for that: measured with 250 idle connections in one process, 251 threads, 757 file descriptors,
1.15 % of a core and +8.3 MB, against 2 threads, 258 descriptors, 0.05 % of a core and +1.0 MB
with one selector driving the same connections through paho's external-loop calls
(``loop_read``, ``loop_write``, ``loop_misc``). With one thread per connection, a burst of
messages also has them all fight over the GIL, while the selector only touches sockets that
are ready.

Everything a :class:`SharedLoop` drives runs on the thread that calls :meth:`SharedLoop.run_once`
(the network, the transports' callbacks, the timers), so paho is never called from two threads
and nothing needs a lock. :class:`~edge_client.wire.mqtt_transport.MqttTransport` takes one as
``loop=`` (one connection each, the same session settings as with its own thread).
"""

from __future__ import annotations

import heapq
import selectors
import time
from collections.abc import Callable
from typing import Any

__all__ = ["SharedLoop"]

MISC_EVERY = 1.0   # seconds between keepalive checks (paho's loop_misc) of every connection


class SharedLoop:
    """A selector over paho clients' sockets, and timers on the same thread."""

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self.clients: list[Any] = []
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self._misc_at = 0.0

    # -- connections --------------------------------------------------------------
    def attach(self, client: Any) -> None:
        """Drive a paho client (before it connects): its sockets are registered as paho opens them."""
        client.on_socket_open = self._opened
        client.on_socket_close = self._closed
        client.on_socket_register_write = self._want_write
        client.on_socket_unregister_write = self._written
        self.clients.append(client)

    def forget(self, sock: Any) -> None:
        """Stop watching a socket that is about to be closed outside paho (a connection dropped on purpose)."""
        self._closed(None, None, sock)

    def _opened(self, client: Any, userdata: Any, sock: Any) -> None:
        self.selector.register(sock, selectors.EVENT_READ, client)

    def _closed(self, client: Any, userdata: Any, sock: Any) -> None:
        try:
            self.selector.unregister(sock)
        except (KeyError, ValueError):
            pass

    def _want_write(self, client: Any, userdata: Any, sock: Any) -> None:
        try:
            self.selector.modify(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, client)
        except (KeyError, ValueError):
            pass

    def _written(self, client: Any, userdata: Any, sock: Any) -> None:
        try:
            self.selector.modify(sock, selectors.EVENT_READ, client)
        except (KeyError, ValueError):
            pass

    # -- timers -------------------------------------------------------------------
    def call_at(self, when: float, action: Callable[[], None]) -> None:
        """Run ``action`` at ``time.monotonic()`` time ``when``, on the loop's thread."""
        self._seq += 1
        heapq.heappush(self._timers, (when, self._seq, action))

    def call_later(self, delay: float, action: Callable[[], None]) -> None:
        self.call_at(time.monotonic() + delay, action)

    # -- running ------------------------------------------------------------------
    def run_once(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds (less when a timer is due sooner) for sockets to be ready, serve
        them, run the timers that are due and, once a second, every connection's keepalive."""
        now = time.monotonic()
        if self._timers:
            timeout = min(timeout, self._timers[0][0] - now)
        self.poll(timeout)
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, action = heapq.heappop(self._timers)
            action()
        if now - self._misc_at >= MISC_EVERY:
            self._misc_at = now
            for client in self.clients:
                client.loop_misc()

    def poll(self, timeout: float) -> None:
        """Serve the sockets ready within ``timeout`` seconds (no timers, no keepalive)."""
        for key, events in self.selector.select(max(0.0, timeout)):
            client = key.data
            if events & selectors.EVENT_READ:
                client.loop_read()
            if events & selectors.EVENT_WRITE and client.socket() is not None:
                client.loop_write()

    def busy(self) -> bool:
        """Something is still to be written on an open connection."""
        return any(c.want_write() for c in self.clients if c.socket() is not None)

    def open_connections(self) -> int:
        return sum(c.socket() is not None for c in self.clients)

    def flush(self, timeout: float) -> None:
        """Serve the sockets until nothing is left to write, or ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self.busy() and time.monotonic() < deadline:
            self.poll(0.05)

    def wait_closed(self, timeout: float) -> None:
        """Serve the sockets until every connection is closed (their DISCONNECT written), or ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while self.open_connections() and time.monotonic() < deadline:
            self.poll(0.05)
