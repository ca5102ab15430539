"""What any local broker the coordinator starts hands back: how to reach it, its error, and a free port.

Shared by the embedded amqtt broker (:mod:`coordinator.ops.broker`) and a local Mosquitto
(:mod:`coordinator.ops.mosquitto`), so callers treat both alike.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from storage.errors import FedgeError

__all__ = ["BrokerError", "BrokerEndpoint", "free_port"]


class BrokerError(FedgeError, RuntimeError):
    """The embedded broker could not be started or stopped."""


@dataclass(frozen=True)
class BrokerEndpoint:
    """Everything a client needs to reach a broker.

    Credentials are kept out of :attr:`url` and out of ``repr()`` so that the
    endpoint can be logged or shown in a dashboard without leaking the
    password.
    """

    host: str
    port: int
    username: str | None
    password: str | None = field(repr=False)
    protocol: str = "3.1.1"
    """MQTT protocol version the broker speaks ("3.1.1" or "5")."""
    devices: dict[str, str] = field(default_factory=dict, repr=False)
    """Device id -> password: each device's own login, confined to its own topics."""

    @property
    def url(self) -> str:
        """``mqtt://HOST:PORT`` -- deliberately without credentials."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"mqtt://{host}:{self.port}"


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on *host* that was free a moment ago.

    The OS picks it (bind to port 0), so it will not collide with well-known
    ports.  Another process may still grab it before the caller binds, so
    callers must be ready to retry; :meth:`EmbeddedBroker.start` does.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
