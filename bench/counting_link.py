"""A TCP forwarder on loopback that counts the bytes it carries each way, and can be cut: a site broker's uplink.

``bench/fleet.py`` points each site broker's bridge at one of these instead of at the central
broker, so the bytes a site's uplink carries are measured on the wire (MQTT framing and
TCP payload, not the payloads alone) without touching either broker. Up is what the site
sends the centre (what the bridge connected to this forwarder writes), down is what the
centre sends back. The counters only grow, and each change is kept with its wall time, so a
reader can ask for the bytes between two instants taken elsewhere (a round's start and end, as
the coordinator's process saw them) to the millisecond rather than to a sampling period.
``tests/test_sites.py`` cuts one (:meth:`cut`: every connection and the listener closed, so a
reconnecting bridge is refused) and restores it on the same port mid-round.
"""

from __future__ import annotations

import bisect
import selectors
import socket
import threading
import time

__all__ = ["CountingLink"]

READ_BYTES = 256 * 1024   # one recv: large enough that a model broadcast crosses in few system calls
MERGE_S = 0.001           # counts less than this apart share one entry of the history (its time the later one)


class CountingLink:
    """Forwards ``127.0.0.1:port`` (a free port) to ``127.0.0.1:target`` on a thread of its own, counting
    the bytes each way in :attr:`up` and :attr:`down` over every connection it accepted (a bridge that
    reconnects is counted on, and shows in :attr:`connections`)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.up = 0            # bytes from the connecting side (a site's bridge) to the target (the centre)
        self.down = 0          # bytes from the target back
        self.connections = 0   # accepted and forwarded so far
        self.history: list[tuple[float, int, int]] = []   # (time.time(), up, down) after each change
        self._listener = self._listen(0)
        self.port: int = self._listener.getsockname()[1]
        self._running = False
        self._thread: threading.Thread | None = None

    @staticmethod
    def _listen(port: int) -> socket.socket:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(8)
        return listener

    def start(self) -> "CountingLink":
        """Serve until :meth:`stop`; the port listens from construction on, so a bridge may connect first."""
        self._running = True
        self._thread = threading.Thread(target=self._serve, name=f"link-{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the listener and every forwarded connection (within 0.1 s, from the serving thread)."""
        self._running = False
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        else:
            self._listener.close()

    cut = stop

    def restore(self) -> None:
        """Listen again on the same port after :meth:`cut`, counting on from where it stopped."""
        if self._thread is None:
            self._listener = self._listen(self.port)
            self.start()

    def between(self, start: float, end: float) -> tuple[int, int]:
        """Bytes (up, down) counted after wall time ``start`` and up to ``end`` (``time.time()`` values)."""
        def total(at: float) -> tuple[int, int]:
            i = bisect.bisect_right(self.history, at, key=lambda entry: entry[0])
            return self.history[i - 1][1:] if i else (0, 0)

        (up0, down0), (up1, down1) = total(start), total(end)
        return up1 - up0, down1 - down0

    def __enter__(self) -> "CountingLink":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        peer: dict[socket.socket, socket.socket] = {}
        upward: set[socket.socket] = set()   # the accepted sides: what they send goes up
        try:
            while self._running:
                for key, _ in sel.select(0.1):
                    sock = key.fileobj
                    if sock is self._listener:
                        self._accept(sel, peer, upward)
                        continue
                    try:
                        data = sock.recv(READ_BYTES)
                        if data:   # counted as read, before the other side can see it
                            if sock in upward:
                                self.up += len(data)
                            else:
                                self.down += len(data)
                            self._note(time.time())
                            peer[sock].sendall(data)   # blocking: a slow side holds the other back, as TCP would
                            continue
                    except OSError:
                        pass
                    for s in (sock, peer.get(sock)):   # one side closed: close the pair
                        if s is not None and s in peer:
                            sel.unregister(s)
                            peer.pop(s)
                            upward.discard(s)
                            s.close()
        finally:
            for s in peer:
                s.close()
            sel.close()
            self._listener.close()

    def _note(self, now: float) -> None:
        entry = (now, self.up, self.down)
        if self.history and now - self.history[-1][0] < MERGE_S:
            self.history[-1] = entry
        else:
            self.history.append(entry)

    def _accept(self, sel: selectors.BaseSelector, peer: dict[socket.socket, socket.socket],
                upward: set[socket.socket]) -> None:
        inside, _ = self._listener.accept()
        try:
            outside = socket.create_connection(("127.0.0.1", self.target), timeout=2)
        except OSError:   # the target is not up (yet): the bridge retries on its own
            inside.close()
            return
        outside.settimeout(None)
        for s in (inside, outside):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connections += 1
        peer[inside], peer[outside] = outside, inside
        upward.add(inside)
        for s in (inside, outside):
            sel.register(s, selectors.EVENT_READ)
