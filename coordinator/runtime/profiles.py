"""The run directory's record of each client's profiles: ``clients/ID.jsonl`` and ``clients/ID.json``.

Every first answer to a task this coordinator gave becomes one line of
``clients/ID.jsonl``: the round, the task id and objective, the round time the
coordinator measured, when the answer came (``time``, the coordinator's clock), whether it came after its attempt was over (``late``), the client's error
if it could not run the task, and the profile the device sent (checked by
:func:`profiling.schema.clean_profile`). A task still unanswered when its attempt
ends gets a ``missed`` line with the timeout as its round time (it took at least
that long); its late answer, if one comes, adds a line with the same task id and
the real time. Late answers are kept on purpose: a straggler's real times are
exactly what a report about stragglers needs.
``clients/ID.json`` holds the latest of these with the device facts from the
client's hello message, so the facts are stored once per client, not per round.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from profiling.device import device_labels   # re-exported: the metrics endpoint and status group by it
from profiling.history import read_jsonl
from storage.files import write_jsonl_atomic

__all__ = ["ProfileStore", "device_labels"]


class ProfileStore:
    """Appends profile records under ``directory`` (the run's ``clients/``)."""

    def __init__(self, directory: Path, *, completed_rounds: int = 0) -> None:
        self.directory = directory
        # client id -> the latest profile of a training task this process took (not one that says it ran no
        # optimizer step: a calibration, evaluation or secure-aggregation stage says nothing of how fast a
        # device trains)
        self.latest: dict[str, dict[str, Any]] = {}
        self._drop_rounds_after(completed_rounds)

    def _drop_rounds_after(self, completed_rounds: int) -> None:
        """On resume: rounds after the checkpoint run again, so their old lines go."""
        if not self.directory.is_dir():
            return
        for path in self.directory.glob("*.jsonl"):
            rows = read_jsonl(path)
            kept = [r for r in rows if isinstance(r.get("round"), int) and r["round"] <= completed_rounds]
            if len(kept) != len(rows):
                write_jsonl_atomic(path, kept)

    def recorded_seconds(self, client_id: str, objective: str, window: int = 3) -> float | None:
        """The median round time of the client's last ``window`` answered tasks of ``objective`` in this run's
        records, earlier sessions included (None if none): what it takes, when this process has not timed it."""
        path = self.directory / f"{client_id}.jsonl"
        rows = read_jsonl(path) if path.is_file() else []
        times = [r["round_seconds"] for r in rows if r.get("objective") == objective and not r.get("missed")
                 and not r.get("error") and isinstance(r.get("round_seconds"), (int, float))][-window:]
        return statistics.median(times) if times else None

    def add(self, client_id: str, *, round: int, task_id: str, objective: str, round_seconds: float,
            late: bool = False, missed: bool = False, error: str | None = None, refusal: str = "",
            profile: dict[str, Any] | None = None, device: Any = None, model_from: str | None = None) -> None:
        """Record one answer (or, with ``missed``, a task that got none in time; ``round_seconds`` is then
        the timeout, a lower bound); ``refusal``: the kind of an error that says one (``app``); ``model_from``: how
        the device came by the task's model broadcast, with delta broadcasts. ``client_id`` must already be a checked
        id: it names files."""
        self.directory.mkdir(parents=True, exist_ok=True)
        record = {"round": round, "time": time.time(), "task_id": task_id, "objective": objective,
                  "round_seconds": round_seconds,
                  "late": late, "missed": missed, "error": error, **({"refusal": refusal} if refusal else {}),
                  **({"model_from": model_from} if model_from else {}),
                  "profile": profile or {}}
        with open(self.directory / f"{client_id}.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
        if profile and profile.get("steps") != 0:
            self.latest[client_id] = profile
        latest = self.directory / f"{client_id}.json"
        if profile or not latest.exists():   # a missed task has no profile to show: keep the last real one
            latest.write_text(json.dumps({"client_id": client_id, "round": round, "profile": profile or {},
                                          "device": device if isinstance(device, dict) else None}, indent=1),
                              encoding="utf-8")
