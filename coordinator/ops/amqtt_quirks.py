"""amqtt's ways, worked around: its chatty logging, the errors it lets escape, the deliveries it keeps
until shutdown, and the subscription table it changes while walking it (measured against amqtt 0.12.1).

Each concerns the embedded broker only (:mod:`coordinator.ops.broker`); kept apart so the
broker's lifecycle reads without them.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

__all__ = ["DEBUG_ENV_VAR", "debug_requested", "configure_amqtt_logging", "quiet_loop_errors",
           "settle_deliveries", "SnapshotDict"]

log = logging.getLogger("coordinator.ops.broker")

#: Set (to anything but "", "0", "false", "no", "off") to see amqtt's own logs at DEBUG.
DEBUG_ENV_VAR = "FEDGE_BROKER_DEBUG"

# Loggers that are chatty at INFO: amqtt logs every connection and state change,
# and the `transitions` state-machine library (used by amqtt) logs every callback.
_NOISY_LOGGERS = ("amqtt", "transitions")

# Above CRITICAL: no record of these loggers passes.
_MUTED = logging.CRITICAL + 1


def debug_requested() -> bool:
    value = os.environ.get(DEBUG_ENV_VAR, "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


def configure_amqtt_logging() -> None:
    """Mute amqtt unless the user asked for broker debugging (:data:`DEBUG_ENV_VAR`).

    Muted, not merely kept at WARNING: amqtt logs each connect/disconnect at INFO, which would
    drown the coordinator's own progress output, and at WARNING and ERROR (with tracebacks) it
    logs what is routine for fedge: a subscriber that takes more than amqtt's fixed 5 s to
    acknowledge a delivery (the coordinator acknowledges a message when it takes it, and a busy
    machine may take longer), the acknowledgement that comes after that, and at shutdown every
    such delivery again. None of it is the user's to fix; the run reports what concerns it.
    """
    level = logging.DEBUG if debug_requested() else _MUTED
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(level)


def quiet_loop_errors(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Exception handler of the broker's event loop: what escapes amqtt goes to this module's DEBUG log.

    amqtt lets some socket errors escape its connection callback (e.g. it half-closes a
    transport the client already dropped), connection tasks still stuck in the CONNECT
    handshake are cancelled at shutdown, and a delivery task whose exception nobody
    retrieved is reported when it is collected; asyncio would print a traceback for each,
    through its own logger, which :func:`configure_amqtt_logging` does not mute. Installed
    unless broker debugging is on, when asyncio's default handler shows them.
    """
    exc = context.get("exception")
    log.debug("embedded broker: %s: %r", context.get("message"), exc, exc_info=exc)


async def settle_deliveries(broker: Any, timeout: float) -> None:
    """Let the broker's deliveries in flight end (for up to ``timeout`` s), then collect how each ended.

    amqtt keeps the task of every delivery it starts in a queue it empties only from the front
    as later messages arrive, and its shutdown logs each failed one (a PUBACK that did not come
    within its 5 s) as an ERROR with a traceback. Called before ``broker.shutdown()``: what ended
    is logged here at DEBUG and taken out of that queue, so the shutdown finds only deliveries
    still in flight, which it cancels. Without amqtt's internals (another version), nothing is done.
    """
    tasks = getattr(broker, "_tasks_queue", None)
    queued = getattr(broker, "_broadcast_queue", None)
    if tasks is None or queued is None:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (not queued.empty() or any(not t.done() for t in tasks)) and loop.time() < deadline:
        await asyncio.sleep(0.02)
    for task in [t for t in tasks if t.done()]:
        tasks.remove(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("embedded broker: a delivery failed: %r", task.exception())


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
