"""A matrix run that a stop cut short goes on from its last round instead of starting over.

Paper-regime runs take up to an hour each on two cores, and a machine that stops every few hours
would otherwise lose the run in flight every time. While a run goes, its run directory lives in
``RESULTS/MATRIX/.unfinished/NAME/run`` (a checkpoint after every round, the clients' state
directories), beside ``progress.json`` (the commit it started at, its seconds so far, the rounds it
was resumed after). ``bench/run_matrix.py`` resumes it from its last checkpoint when it runs the
cell again, and deletes the directory once the run file is written.

A resumed run computes what an unbroken one does: a checkpoint holds the server's whole state, and
devices keep theirs in ``OUT/clients/ID`` and start a task sent again from the state before it (DFL's
branches, FedMA's phase files, error-feedback residuals). Its run file is then checked like any other by
``bench/reproduce.py``. A run begun at other code is not resumed: when the code a cell runs
(``provenance.CODE``) changed since it started, or the tree had changes not committed when it started or
has now (a run file names one commit), the cell is left as it is, to be resumed from a checkout of the
commit it started at (``git worktree add DIR COMMIT``), unless the matrix runs with
``--restart-unfinished``, which starts it over. The directory is all a resume needs, wherever it is: committed
(``git add -f``), it carries a run cut short to a fresh clone (docs/benchmarks.md, "A run cut short").
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from provenance import changes_since
from storage.checkpoint import checkpoint_rounds
from storage.files import write_atomic

__all__ = ["UNFINISHED", "Unfinished", "StartedElsewhere", "other_code"]

UNFINISHED = ".unfinished"


class StartedElsewhere(Exception):
    """An unfinished run started at code other than this checkout's: resume it from there, or start it over."""


def other_code(started: dict[str, Any], now: dict[str, Any]) -> str | None:
    """Why the code now is not the code a run that started at source ``started`` ran (None: it is)."""
    if started.get("dirty") is not False or now.get("dirty") is not False:
        return "the tree had changes not committed when it started or has now"
    later = changes_since(str(started.get("commit")))
    if later is None:
        return f"its commit {started.get('commit')} is unknown to this checkout"
    if later:
        return f"the code changed since it started ({len(later)} commits, the latest: {later[0]})"
    return None



@dataclass
class Unfinished:
    """The directory of one cell's run while it goes, and what it knows of the sessions before."""

    directory: Path
    progress: dict[str, Any] = field(default_factory=dict)
    _session_start: float = 0.0

    @property
    def run_dir(self) -> Path:
        return self.directory / "run"

    @property
    def _progress_file(self) -> Path:
        return self.directory / "progress.json"

    def begin(self, source: dict[str, Any], *, restart: bool = False) -> str | None:
        """Prepare the run: resume it if an earlier session left rounds that can go on, else start afresh.
        Returns what to tell the person running the matrix (None for a plain start). Raises
        :class:`StartedElsewhere` for a run that started at other code, unless ``restart``."""
        done, progress = self._left()
        said = None
        if progress is not None:
            started = progress["source"]
            reason = other_code(started, source)
            if reason is None:
                progress["resumed_after"].append(done)
                self._start(progress)
                return f"resuming after round {done} (started at {started['commit'][:10]})"
            if not restart:
                raise StartedElsewhere(
                    f"{self.directory} holds {done} rounds that started at commit {started['commit'][:10]}, "
                    f"but {reason}: left as it is. Resume it from a checkout of that commit (git worktree add "
                    f"DIR {started['commit'][:10]}, then run the matrix there with --results pointing here), "
                    "or pass --restart-unfinished to start it over")
            said = f"starting over (it had reached round {done}): {reason}"
        shutil.rmtree(self.directory, ignore_errors=True)
        self._start({"source": source, "seconds": 0.0, "resumed_after": []})
        return said

    def describe(self) -> str | None:
        """What an earlier session left here, for a listing (None: nothing)."""
        done, progress = self._left()
        if progress is None:
            return None
        return (f"unfinished: round {done} done in {progress['seconds'] / 3600:.2f} h, "
                f"begun at {progress['source']['commit'][:10]}")

    def _left(self) -> tuple[int, dict[str, Any] | None]:
        """The last checkpointed round an earlier session left and its progress (None: nothing to go on from)."""
        rounds = checkpoint_rounds(self.run_dir / "checkpoints") if self.run_dir.is_dir() else {}
        if not rounds or not self._progress_file.is_file():
            return 0, None
        return max(rounds), json.loads(self._progress_file.read_text(encoding="utf-8"))

    @property
    def resuming(self) -> bool:
        return bool(self.progress.get("resumed_after"))

    def _start(self, progress: dict[str, Any]) -> None:
        self.progress = progress
        self._session_start = time.monotonic()
        self._write(progress["seconds"])

    def seconds(self) -> float:
        """The run's seconds so far: earlier sessions' and this one's."""
        return float(self.progress["seconds"]) + time.monotonic() - self._session_start

    def tick(self) -> None:
        """Record the seconds so far (after each round: a session killed later loses at most a round's)."""
        self._write(self.seconds())

    def _write(self, seconds: float) -> None:
        write_atomic(self._progress_file, json.dumps({**self.progress, "seconds": seconds}, indent=1).encode())

    def finish(self) -> None:
        """The run file is written: the run directory is scratch now."""
        shutil.rmtree(self.directory, ignore_errors=True)
