"""Which clients are online, as their retained presence messages say, and which of them may be drawn.

A presence that does not decode or parse is logged and dropped; the last word of each
client (``online`` with the facts of its data and device, or ``offline``, which may be
the broker speaking its last will) is kept. Clients benched for leaving tasks unanswered
(:class:`~coordinator.runtime.selection.Absences`) stay online but are not drawn.

Each change of a client's state (online, offline) is appended to the run directory's
``presence.jsonl`` (:class:`PresenceLog`): when a device was away is what a report on
sizing hardware shows beside its memory and temperature over time. The same changes feed the
devices' :class:`~coordinator.runtime.availability.PresenceHistory`, which selection reads.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from coordinator.runtime.availability import PresenceHistory
from coordinator.runtime.selection import Absences
from edge_client.wire.protocol import PresenceBody, ProtocolError, decode
from edge_client.wire.throttle import ThrottledLog

__all__ = ["Roster", "PresenceLog", "PRESENCE_BYTES", "parse_presence", "PRESENCE_FILE"]

log = logging.getLogger("fedge.coordinator")
PRESENCE_BYTES = 1024 * 1024   # the largest presence (or claim) read: neither carries tensors
PRESENCE_FILE = "presence.jsonl"


class PresenceLog:
    """Appends ``{"time", "client_id", "state", "after_round"}`` to ``RUN_DIR/presence.jsonl`` for each change
    of a client's state; ``after_round`` is the last round completed then (0: before the first)."""

    def __init__(self, path: Path, completed_round: Callable[[], int]) -> None:
        self.path = path
        self._completed_round = completed_round

    def __call__(self, client_id: str, state: str) -> None:
        """Append one line; a write that fails (a full disk) is logged, never raised: the log is for reports,
        and a run must not stop for it."""
        line = {"time": time.time(), "client_id": client_id, "state": state, "after_round": self._completed_round()}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(line) + "\n")
        except OSError as exc:
            log.warning("could not record that client %s is %s in %s: %s (free space there for reports to show "
                        "when devices were offline)", client_id, state, self.path, exc)

def parse_presence(client_id: str, payload: bytes) -> PresenceBody | None:
    """The presence ``payload`` on ``client_id``'s presence topic says; None when it is another message or
    another sender's (ignored without a word), ProtocolError when it does not decode or parse."""
    msg = decode(payload, max_bytes=PRESENCE_BYTES)
    if msg.sender != client_id or msg.kind != "presence":
        return None
    return PresenceBody.from_body(msg.body)


class Roster:
    """The clients online and what each announced."""

    def __init__(self, absences: Absences, warn: ThrottledLog,
                 on_change: Callable[[str, str], None] = lambda client_id, state: None,
                 history: PresenceHistory | None = None) -> None:
        self.absences = absences
        self.history = history if history is not None else PresenceHistory()   # sessions, on the wall clock
        self.online: dict[str, PresenceBody] = {}
        self.gone: dict[str, float] = {}   # clients that went offline and stayed away -> when (monotonic)
        self._warn = warn
        self._on_change = on_change   # (client id, "online" or "offline") when a client's state changes

    def on_presence(self, client_id: str, payload: bytes) -> bool:
        """Take a client's presence; True when it announced itself online (its unanswered task may go again)."""
        try:
            body = parse_presence(client_id, payload)
        except ProtocolError as exc:
            self._warn.warning("ignored presence of %s: %s", client_id, exc)
            return False
        if body is None:
            return False
        if body.state == "online":
            if client_id not in self.online:
                log.info("client %s online (%s samples)", client_id, body.num_samples)
                self._on_change(client_id, "online")
                self.history.changed(client_id, True, time.time())
                if self.absences.came_online(client_id):
                    log.info("client %s came back online: it may be selected again, its app checked with its next "
                             "task", client_id)
            if self.absences.returned(client_id, announced=True):
                log.info("client %s announced itself again: it may be selected again", client_id)
            self.online[client_id] = body
            self.gone.pop(client_id, None)
            return True
        if self.online.pop(client_id, None) is not None:
            # A warning: shown without -v, as a device leaving is what a person watching a run needs to know.
            log.warning("client %s went offline", client_id)
            self.gone[client_id] = time.monotonic()
            self._on_change(client_id, "offline")
            self.history.changed(client_id, False, time.time())
        return False

    def missing(self, expected: Mapping[str, str], shown: int = 10) -> list[str]:
        """The devices a wait for clients may be waiting for, each with why it is not there: those that went
        offline during the run, and ``expected`` ones (client id -> why: it took part in the run, it was
        spawned for it) not online; the first ``shown`` of them, then how many more."""
        now = time.monotonic()
        said = [f"{c} (went offline {now - at:.0f} s ago)" for c, at in sorted(self.gone.items(), key=lambda g: -g[1])]
        said += [f"{c} ({why}, not online)" for c, why in sorted(expected.items())
                 if c not in self.online and c not in self.gone]
        return said[:shown] + ([f"{len(said) - shown} more"] if len(said) > shown else [])

    def answering(self) -> list[str]:
        """The online clients selection may draw from: not those benched for unanswered tasks."""
        return self.absences.pool(self.online, 0, retry=False)

    def benched_online(self) -> list[str]:
        """Clients online but benched: they announced themselves and left their tasks unanswered."""
        return sorted(set(self.online) - set(self.answering()))

    def device(self, client_id: str) -> dict[str, Any] | None:
        """The device facts a client announced with its presence, if it is online."""
        presence = self.online.get(client_id)
        return presence.device if presence is not None else None

    def announced_samples(self, client_id: str) -> int | None:
        """The training samples a client announced, if it is online and said."""
        presence = self.online.get(client_id)
        return presence.num_samples if presence is not None else None
