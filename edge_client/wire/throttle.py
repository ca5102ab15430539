"""Warnings about bad messages, at a rate a console can take.

A flood of garbage produces one warning per message; formatting and writing them to a
terminal alone capped the coordinator at about a thousand messages a second. Here the
first few of each kind in an interval are logged as they come, the rest are counted,
and each interval ends with one line per kind: how many, and an example.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["ThrottledLog"]

_DETAILS = re.compile(r"[0-9a-f]{8,}|\d+")   # ids and numbers: messages that differ only in these are one kind


@dataclass
class ThrottledLog:
    logger: logging.Logger
    interval: float = 10.0          # seconds between summaries
    burst: int = 5                  # events of one kind logged one by one per interval
    clock: Callable[[], float] = time.monotonic
    _counts: dict[str, tuple[int, str]] = field(default_factory=dict)
    _since: float = field(default=-1.0)

    def warning(self, message: str, *args: object) -> None:
        """Log ``message % args`` now, or count it when its kind has had ``burst`` lines this interval."""
        now = self.clock()
        if self._since < 0:
            self._since = now
        self.flush(now)
        text = message % args if args else message
        kind = _DETAILS.sub("#", text)[:120]
        seen, example = self._counts.get(kind, (0, text))
        self._counts[kind] = (seen + 1, example)
        if seen < self.burst:
            self.logger.warning(text)

    def flush(self, now: float | None = None, *, force: bool = False) -> None:
        """At the end of an interval (or ``force``), one line per kind that was counted beyond its burst."""
        now = self.clock() if now is None else now
        if not force and (self._since < 0 or now - self._since < self.interval):
            return
        for kind, (seen, example) in self._counts.items():
            if seen > self.burst:
                self.logger.warning("%d more like this in the last %.0f s: %s", seen - self.burst,
                                    now - self._since, example[:300])
        self._counts.clear()
        self._since = now
