"""When each device goes offline and comes back, and when its CPU is throttled: a seeded timeline
built before the policy starts (the same for every policy of a lab), and a thread that applies it
and logs every change with its time.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from lab.fleet import Device

__all__ = ["Event", "timeline", "Scheduler"]


@dataclass(frozen=True)
class Event:
    t: float             # seconds since the policy's start
    device: str
    action: str          # link_down | link_up | throttle | unthrottle
    fraction: float = 1.0


def _availability(device: Device, rng: random.Random, horizon: float) -> list[Event]:
    a = device.availability
    if a.kind == "offline":
        return [Event(t, device.id, action) for start, end in a.windows if start < horizon
                for t, action in ((start, "link_down"), (end, "link_up"))]
    if a.kind != "intermittent":
        return []
    events, t = [], 0.0
    online = rng.random() >= a.offline_fraction   # start in the long-run mix of states
    if not online:
        events.append(Event(0.0, device.id, "link_down"))
    while t < horizon:
        t += rng.expovariate(1.0 / (a.online_mean_s if online else a.offline_mean_s))
        online = not online
        if t < horizon:
            events.append(Event(t, device.id, "link_up" if online else "link_down"))
    return events


def _throttle(device: Device, rng: random.Random, horizon: float) -> list[Event]:
    th = device.throttle
    if th is None:
        return []
    events, t = [], rng.uniform(0, th.every_s)   # devices do not all heat up at once
    while t < horizon:
        events += [Event(t, device.id, "throttle", th.fraction), Event(t + th.for_s, device.id, "unthrottle")]
        t += th.every_s
    return events


def timeline(devices: tuple[Device, ...], seed: int, horizon: float) -> list[Event]:
    """Every change of every device up to ``horizon`` seconds, in time order."""
    events: list[Event] = []
    for device in devices:
        rng = random.Random(f"{seed}:{device.id}")
        events += _availability(device, rng, horizon) + _throttle(device, rng, horizon)
    return sorted(events, key=lambda e: (e.t, e.device, e.action))


class Scheduler:
    """Applies a timeline on a thread of its own; ``log`` holds every change applied."""

    def __init__(self, events: list[Event], apply: Callable[[Event], None], say: Callable[[str], None]) -> None:
        self.events, self.apply, self.say = events, apply, say
        self.log: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lab-scheduler", daemon=True)
        self.started = 0.0

    def start(self) -> None:
        self.started = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        for event in self.events:
            if self._stop.wait(max(0.0, self.started + event.t - time.monotonic())):
                return
            entry = {"t": round(time.monotonic() - self.started, 3), "at": datetime.now(timezone.utc).isoformat(),
                     "device": event.device, "action": event.action}
            if event.action == "throttle":
                entry["fraction"] = event.fraction
            try:
                self.apply(event)
            except Exception as exc:   # a failed change is logged and the lab goes on
                entry["error"] = str(exc)
            self.log.append(entry)
            self.say(f"[{entry['t']:7.1f}s] {event.device}: {event.action}"
                     + (f" to {event.fraction:.0%}" if event.action == "throttle" else "")
                     + (f" FAILED: {entry['error']}" if "error" in entry else ""))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
