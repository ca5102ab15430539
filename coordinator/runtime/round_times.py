"""How long each client takes to answer a task, as the coordinator measures it: from publishing the task to
receiving its result, per kind of task (objective). The deadline selection, the profile selection and the
wait of an attempt all read it (:mod:`coordinator.runtime.selection`).
"""

from __future__ import annotations

import statistics
from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["RoundTimes", "SAFETY", "WINDOW", "STRETCH"]

SAFETY = 1.25        # skip when predicted * SAFETY > deadline: leaves room for jitter
WINDOW = 3           # round times the prediction looks at
STRETCH = 2.0        # an attempt waits at most this many round timeouts for clients known to be slower
_KEEP = 8            # round times kept per client and objective (a late answer may update an older one)
_MAX_PENDING = 10_000


class RoundTimes:
    """Recent round times of each client, per objective, as the coordinator measured them."""

    def __init__(self) -> None:
        self._pending: OrderedDict[str, tuple[str, str, float]] = OrderedDict()   # task -> client, objective, sent
        self._times: dict[tuple[str, str], OrderedDict[str, float]] = {}           # (client, objective) -> task -> s
        self._answered: dict[tuple[str, str], OrderedDict[str, float]] = {}        # the same, real answers only

    def sent(self, task_id: str, client_id: str, objective: str, at: float) -> None:
        """A task was published at monotonic time ``at``."""
        self._pending[task_id] = (client_id, objective, at)
        while len(self._pending) > _MAX_PENDING:
            self._pending.popitem(last=False)

    def answered(self, task_id: str, client_id: str, at: float) -> tuple[float, str] | None:
        """The first answer to a task arrived at ``at``: its round time and objective (None if not ours)."""
        entry = self._pending.get(task_id)
        if entry is None or entry[0] != client_id:
            return None
        del self._pending[task_id]
        seconds = at - entry[2]
        self._record(entry[0], entry[1], task_id, seconds)
        self._record(entry[0], entry[1], task_id, seconds, self._answered)
        return seconds, entry[1]

    def missed(self, task_ids: Iterable[str], timeout: float) -> list[tuple[str, str, str]]:
        """Tasks of an attempt that ended: unanswered ones count as ``timeout`` for now.

        Returns (task id, client id, objective) of each; a late answer replaces the timeout with the real time.
        """
        unanswered = []
        for task_id in task_ids:
            entry = self._pending.get(task_id)
            if entry is not None:
                self._record(entry[0], entry[1], task_id, timeout)
                unanswered.append((task_id, entry[0], entry[1]))
        return unanswered

    def busy(self, client_id: str, now: float, horizon: float) -> bool:
        """Whether the client owes an answer to a task sent less than ``horizon`` seconds before ``now``."""
        return any(c == client_id and now - sent < horizon for c, _, sent in self._pending.values())

    def working(self, task_id: str, client_id: str, now: float, timeout: float) -> bool:
        """Whether the client is presumably still working on an unanswered task: it has answered a task of
        this kind before, and less than :data:`SAFETY` times its usual round time (or the timeout, if
        longer) has passed since the task went out. A client never heard from is not presumed working:
        it may be gone, and waiting for it would cost the attempt its whole timeout."""
        entry = self._pending.get(task_id)
        if entry is None or entry[0] != client_id:
            return False
        usual = self.usual(client_id, entry[1])
        return usual is not None and now - entry[2] < SAFETY * max(usual, timeout)

    def deadline(self, clients: Iterable[tuple[str, str]], timeout: float) -> float:
        """How long an attempt waits for ``clients`` ((client, objective) pairs): ``timeout``, or longer when
        one of them usually needs more (:data:`SAFETY` times its usual round time), but at most
        :data:`STRETCH` timeouts. Cutting a known slow device off at the timeout only wastes its work
        and the attempt's; the cap keeps one very slow device from holding every round."""
        usual = [u for client, objective in clients if (u := self.usual(client, objective)) is not None]
        return min(max([timeout, *(SAFETY * u for u in usual)]), STRETCH * timeout)

    def usual(self, client_id: str, objective: str) -> float | None:
        """Median of the client's last :data:`WINDOW` real round times for ``objective`` (misses left out)."""
        times = self._answered.get((client_id, objective))
        return statistics.median(list(times.values())[-WINDOW:]) if times else None

    def _record(self, client_id: str, objective: str, task_id: str, seconds: float,
                into: dict[tuple[str, str], OrderedDict[str, float]] | None = None) -> None:
        times = (self._times if into is None else into).setdefault((client_id, objective), OrderedDict())
        times[task_id] = seconds
        while len(times) > _KEEP:
            times.popitem(last=False)

    def predict(self, client_id: str) -> float | None:
        """Median of the last :data:`WINDOW` round times of the client's slowest objective; None if unknown."""
        medians = [statistics.median(list(times.values())[-WINDOW:])
                   for (client, _), times in self._times.items() if client == client_id and times]
        return max(medians) if medians else None
