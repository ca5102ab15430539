"""amqtt's ways, worked around: its chatty logging, the connection errors it lets escape, and the
subscription table it changes while walking it (measured against amqtt 0.12.1).

Each concerns the embedded broker only (:mod:`coordinator.ops.broker`); kept apart so the
broker's lifecycle reads without them.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

__all__ = ["DEBUG_ENV_VAR", "debug_requested", "configure_amqtt_logging", "quiet_connection_errors",
           "SnapshotDict"]

log = logging.getLogger("coordinator.ops.broker")

#: Set (to anything but "", "0", "false", "no", "off") to see amqtt's own logs at DEBUG.
DEBUG_ENV_VAR = "FEDGE_BROKER_DEBUG"

# Loggers that are chatty at INFO: amqtt logs every connection and state change,
# and the `transitions` state-machine library (used by amqtt) logs every callback.
_NOISY_LOGGERS = ("amqtt", "transitions")


def debug_requested() -> bool:
    value = os.environ.get(DEBUG_ENV_VAR, "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


def configure_amqtt_logging() -> None:
    """Keep amqtt quiet unless the user asked for broker debugging.

    amqtt logs each connect/disconnect at INFO, which would drown the
    coordinator's own progress output in a federation with many clients.
    """
    level = logging.DEBUG if debug_requested() else logging.WARNING
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(level)

def quiet_connection_errors(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Loop exception handler that keeps per-connection noise out of the console.

    amqtt lets some socket errors escape its connection callback (e.g. it
    half-closes a transport the client already dropped), and connection tasks
    still stuck in the CONNECT handshake are cancelled at shutdown; asyncio
    would print a traceback for each.  Those concern one client only, so they
    are logged at DEBUG; anything else goes to the default handler.
    """
    exc = context.get("exception")
    if isinstance(exc, (asyncio.CancelledError, OSError)):
        log.debug("embedded broker: %s: %r", context.get("message"), exc)
        return
    loop.default_exception_handler(context)


class SnapshotDict(dict):
    """A dict whose loops walk a copy of its keys or items, taken when the loop begins.

    amqtt 0.12.1, the latest release, loops over its subscription table with an ``await`` inside
    (sending retained messages to a reconnecting persistent session): a client subscribing a new
    filter meanwhile grows the table, the loop dies with "dictionary changed size during iteration",
    that client's connection handler dies with it, and asyncio prints the traceback. Walking a
    snapshot gives the loop the table as it was when it began, which is what the loop means.
    """

    def __iter__(self):  # type: ignore[override]
        return iter(list(super().keys()))

    def keys(self):  # type: ignore[override]
        return list(super().keys())

    def values(self):  # type: ignore[override]
        return list(super().values())

    def items(self):  # type: ignore[override]
        return list(super().items())
