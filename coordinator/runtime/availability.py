"""Each device's presence history, and whether it is likely to stay online long enough for a task.

A device's retained presence says when it comes online and (its own word, or the broker's last will)
when it goes offline. :class:`PresenceHistory` keeps, per device, the lengths of its last
:data:`KEEP` completed online sessions, when its current session began and when it was last seen, on
the coordinator's wall clock (so the history survives a restart in the checkpoint).

Its prediction is the mean residual life of the device's own sessions: given that the current session
is ``a`` seconds old, the expected remaining time is the mean of ``s - a`` over its past sessions
``s`` longer than ``a``. Nothing is predicted (None) for a device with fewer than ``min_sessions``
completed sessions, one not online, or one already online longer than any session it had: too little
is known, and a selection must not leave a device out on a guess. :func:`likely_gone` compares that
with the device's expected task time: a device expected to go offline before it finishes a task would
only cost the round its deadline.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PresenceHistory", "Presence", "likely_gone", "KEEP"]

KEEP = 20   # completed sessions kept per device: enough for a mean, little enough for a checkpoint


@dataclass
class Presence:
    """One device's history: completed session lengths (seconds, oldest first), the current session's start
    and when it was last seen online (wall-clock seconds; None: not online now, or never seen)."""

    sessions: list[float] = field(default_factory=list)
    online_since: float | None = None
    last_seen: float | None = None


class PresenceHistory:
    """Online sessions per device, from the roster's changes of state (``changed``)."""

    def __init__(self) -> None:
        self.devices: dict[str, Presence] = {}

    def changed(self, client_id: str, online: bool, now: float) -> None:
        """The device came online (``online``) or went offline at wall-clock time ``now``."""
        p = self.devices.setdefault(client_id, Presence())
        if online:
            if p.online_since is None:
                p.online_since = now
        elif p.online_since is not None:
            p.sessions = (p.sessions + [max(0.0, now - p.online_since)])[-KEEP:]
            p.online_since = None
        p.last_seen = now

    def remaining(self, client_id: str, now: float, min_sessions: int) -> float | None:
        """Expected seconds the device stays online from ``now`` (module docstring); None when unknown."""
        p = self.devices.get(client_id)
        if p is None or p.online_since is None or len(p.sessions) < max(1, min_sessions):
            return None
        age = max(0.0, now - p.online_since)
        longer = [s - age for s in p.sessions if s > age]
        return sum(longer) / len(longer) if longer else None

    def offline_for(self, client_id: str, now: float) -> float | None:
        """Seconds since the device was last seen online (0 while it is; None if never seen)."""
        p = self.devices.get(client_id)
        if p is None or p.last_seen is None:
            return None
        return 0.0 if p.online_since is not None else max(0.0, now - p.last_seen)

    def saved(self) -> dict[str, Any]:
        """The history as JSON, for the run's checkpoint."""
        return {c: {"sessions": p.sessions, "online_since": p.online_since, "last_seen": p.last_seen}
                for c, p in sorted(self.devices.items())}

    def restore(self, saved: Mapping[str, Any]) -> None:
        """Take a checkpoint's history back. Open sessions are closed without a length: whether the device
        stayed online while no coordinator watched is unknown, and its retained presence starts a new one."""
        for c, p in saved.items():
            if not isinstance(p, Mapping):
                continue
            sessions = [float(s) for s in p.get("sessions", []) if isinstance(s, (int, float)) and s >= 0][-KEEP:]
            seen = p.get("last_seen")
            self.devices[str(c)] = Presence(sessions, None, float(seen) if isinstance(seen, (int, float)) else None)


def likely_gone(pool: list[str], need: int, history: PresenceHistory, task_seconds: Callable[[str], float | None],
                now: float, min_sessions: int) -> tuple[list[str], dict[str, str]]:
    """``pool`` minus the devices expected to go offline before they would finish a task, and why each was left
    out. When that leaves fewer than ``need``, those with the most of their task covered are put back."""
    short: dict[str, tuple[float, float]] = {}
    for c in pool:
        left, task = history.remaining(c, now, min_sessions), task_seconds(c)
        if left is not None and task is not None and left < task:
            short[c] = (left, task)
    keep = [c for c in pool if c not in short]
    for c in sorted(short, key=lambda c: (-short[c][0] / short[c][1], c))[:max(0, need - len(keep))]:
        keep.append(c)
        del short[c]
    why = {c: f"likely offline in {left:.0f} s, before its task's {task:.0f} s" for c, (left, task) in short.items()}
    return sorted(keep), why
