"""A TCP forwarder on loopback that a test can cut and restore: the uplink between a site broker's
bridge and the central broker, so a test can drop it mid-round without touching either broker."""

from __future__ import annotations

import selectors
import socket
import threading

from coordinator.ops.broker_endpoint import free_port

__all__ = ["CuttableLink"]


class CuttableLink:
    """Forwards ``127.0.0.1:port`` to ``127.0.0.1:target``. :meth:`cut` closes every connection and the
    listener (a reconnecting bridge is refused), :meth:`restore` listens again on the same port."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_port()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._thread: threading.Thread | None = None
        self._running = False
        self.connections = 0   # accepted so far: a bridge's reconnects show here

    def start(self) -> "CuttableLink":
        self.restore()
        return self

    def restore(self) -> None:
        with self._lock:
            if self._running:
                return
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(8)
            self._listener, self._running = listener, True
            self._thread = threading.Thread(target=self._serve, args=(listener,), daemon=True)
            self._thread.start()

    def cut(self) -> None:
        with self._lock:
            self._running = False
            pairs, self._pairs = self._pairs, []
        if self._thread is not None:
            self._thread.join(5)
        for a, b in pairs:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    stop = cut

    def _serve(self, listener: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ)
        peer: dict[socket.socket, socket.socket] = {}
        try:
            while self._running:
                for key, _ in sel.select(0.05):
                    sock = key.fileobj
                    if sock is listener:
                        inside, _ = listener.accept()
                        try:
                            outside = socket.create_connection(("127.0.0.1", self.target), timeout=2)
                        except OSError:
                            inside.close()
                            continue
                        outside.settimeout(None)
                        self.connections += 1
                        peer[inside], peer[outside] = outside, inside
                        for s in (inside, outside):
                            sel.register(s, selectors.EVENT_READ)
                        with self._lock:
                            self._pairs.append((inside, outside))
                        continue
                    try:
                        data = sock.recv(65536)
                        if data:
                            peer[sock].sendall(data)
                            continue
                    except OSError:
                        pass
                    for s in (sock, peer.get(sock)):
                        if s is not None and s in peer:
                            sel.unregister(s)
                            peer.pop(s, None)
                            s.close()
        finally:
            sel.close()
            listener.close()
