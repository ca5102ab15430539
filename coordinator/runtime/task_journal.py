"""Which devices were sent a training task, written down before the tasks go out.

Local differential privacy counts a device's participation when it is given a task, since it may have
sent its noisy update whatever became of the round. The count lives in the checkpoint, written when a
round completes; a coordinator that stops or dies mid-round would lose the round's participations, and
its devices' releases would go unaccounted. So, for a strategy that counts participations
(``Strategy.counts_tasks``), every training exchange's devices are appended to ``OUT/tasks-sent.jsonl``
(flushed to disk) before its tasks are published, and a resumed run replays the lines of rounds after
its checkpoint into its account (:meth:`TaskJournal.replay`) before it runs them again.
"""

from __future__ import annotations

from pathlib import Path

from coordinator.strategies.base import Strategy
from storage.files import append_jsonl_synced, read_jsonl
from storage.state import ServerState

__all__ = ["TaskJournal", "JOURNAL_FILE"]

JOURNAL_FILE = "tasks-sent.jsonl"


class TaskJournal:
    """``OUT/tasks-sent.jsonl``: one line per training exchange, ``{"round": r, "attempt": a, "clients": [...]}``."""

    def __init__(self, out_dir: Path) -> None:
        self.path = Path(out_dir) / JOURNAL_FILE

    def sent(self, round: int, attempt: int, clients: list[str]) -> None:
        """On disk before the tasks are published: a line the coordinator could lose would be a release the
        account misses."""
        append_jsonl_synced(self.path, {"round": round, "attempt": attempt, "clients": sorted(clients)})

    def replay(self, state: ServerState, strategy: Strategy) -> tuple[ServerState, int]:
        """``state`` with the exchanges of rounds after its checkpoint counted in (the tasks went out, the round
        did not complete), and how many were; a torn last line (a crash mid-write) was never followed by tasks."""
        if not self.path.exists():
            return state, 0
        unfinished = [row for row in read_jsonl(self.path) if isinstance(row.get("round"), int)
                      and row["round"] > state.round and isinstance(row.get("clients"), list)]
        for row in unfinished:
            state = strategy.tasked("train", state, frozenset(str(c) for c in row["clients"]))
        return state, len(unfinished)
