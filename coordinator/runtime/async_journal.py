"""What an asynchronous run must not lose when its coordinator dies without a word (SIGKILL, a power cut).

A version's checkpoint holds the buffer as it was then (:mod:`async_buffer`), and a stop that can be
handled (Ctrl-C, SIGTERM, an error) checkpoints the buffer again; a coordinator killed outright does
neither. The results it acknowledged since its last checkpoint would die with it, though their devices
were told they were taken and do not send them again; and the tasks it gave since would be unknown to
the coordinator that resumes, which could then only count their results as late.

So, in ``OUT/async-journal/``:

- every accepted result is written, synced, as ``NNNNNNNN.safetensors`` (its deltas; its task, device,
  base version, sample count and metrics in the metadata) before its device is acknowledged, numbered in
  the order results are taken;
- every task's id, device, base version, deadline and time sent is appended to ``tasks.jsonl``, synced,
  before it is published.

A checkpoint names the last result it accounts for (``extra["async"]["journal"]``): those up to it are
in a version or in the checkpoint's buffer, and their files are deleted once it is written. A resumed
run folds the results after it into its buffer, in the order they were taken (the versions they make
are the ones the dead coordinator made or would have made), and waits for the tasks given since
that no journaled result answers. Nothing here comes from the network: the files are the coordinator's
own, and still checked as they are read.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from coordinator.runtime.run_error import RunError
from coordinator.strategies.base import ClientResult
from storage.files import append_jsonl_synced, read_jsonl, write_jsonl_atomic, write_tensors_atomic

__all__ = ["AsyncJournal", "JournaledResult", "JOURNAL_DIR"]

log = logging.getLogger("fedge.coordinator")

JOURNAL_DIR = "async-journal"
TASKS = "tasks.jsonl"
META = "fedge_async_result"   # the safetensors metadata entry: task, client, version, samples, metrics
_NAME = re.compile(r"^(\d{8,})\.safetensors$")


@dataclass(frozen=True)
class JournaledResult:
    """One result as it was taken: its place in the journal, the task it answered and the version it trained from."""

    seq: int
    task_id: str
    version: int
    result: ClientResult


class AsyncJournal:
    """``OUT/async-journal/``: the results taken and the tasks given since the last checkpoint."""

    def __init__(self, out_dir: Path, mark: int) -> None:
        """``mark``: the last result the checkpoint the run starts from accounts for (0: none)."""
        self.dir = Path(out_dir) / JOURNAL_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.seq = max([mark, *self._files()])   # the next result is numbered after everything on disk

    def _files(self) -> dict[int, Path]:
        return {int(m.group(1)): p for p in self.dir.glob("*.safetensors") if (m := _NAME.match(p.name))}

    # -- writing ---------------------------------------------------------------------------------
    def taken(self, task_id: str, version: int, result: ClientResult) -> int:
        """A result, on disk before its device hears it was taken; its number."""
        meta = {"task_id": task_id, "client_id": result.client_id, "version": version,
                "num_samples": result.num_samples,
                "metrics": {k: float(v) for k, v in result.metrics.items() if isinstance(v, (int, float))}}
        with self._writing("a result"):
            write_tensors_atomic(self.dir / f"{self.seq + 1:08d}.safetensors", result.deltas,
                                 {META: json.dumps(meta)})
        self.seq += 1
        return self.seq

    def given(self, task_id: str, client_id: str, version: int, deadline: float, sent: float) -> None:
        """A task, on disk before it is published, with until when its result is waited for and when it was sent
        (Unix times)."""
        with self._writing("a task"):
            append_jsonl_synced(self.dir / TASKS, {"task_id": task_id, "client_id": client_id, "version": version,
                                                   "deadline": deadline, "sent": sent})

    @contextmanager
    def _writing(self, what: str) -> Iterator[None]:
        """A journal that cannot be written ends the run (what it has not written did not happen), saying how to
        go on."""
        try:
            yield
        except OSError as exc:
            raise RunError(f"could not journal {what} in {self.dir} ({exc.strerror or exc}); what it journaled "
                           "before is safe: free space and run again with --resume") from None

    def forget(self, mark: int, version: int) -> None:
        """A checkpoint of ``version`` accounting for the results up to ``mark`` is written: their files go, and
        the lines of tasks given before ``version`` (those still in flight are in the checkpoint)."""
        for seq, path in self._files().items():
            if seq <= mark:
                path.unlink(missing_ok=True)
        path = self.dir / TASKS
        if path.exists():
            write_jsonl_atomic(path, [t for t in self._tasks() if t["version"] >= version])

    # -- reading, on resume ------------------------------------------------------------------------
    def results_after(self, mark: int) -> list[JournaledResult]:
        """The results taken after ``mark``, in the order they were taken; a file that does not read is skipped
        with a warning (it was written atomically: only damage after the fact makes one)."""
        found = []
        for seq, path in sorted(self._files().items()):
            if seq <= mark:
                continue
            try:
                found.append(self._read(seq, path))
            except (SafetensorError, OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("skipped %s, which does not read as a journaled result (%s): that result is lost",
                            path, exc)
        return found

    @staticmethod
    def _read(seq: int, path: Path) -> JournaledResult:
        with safe_open(str(path), framework="pt") as fh:
            meta = json.loads((fh.metadata() or {})[META])
            deltas = {name: fh.get_tensor(name) for name in fh.keys()}
        if not isinstance(meta, dict):
            raise ValueError("its metadata is not a JSON object")
        task_id, client_id, version = meta["task_id"], meta["client_id"], meta["version"]
        samples, metrics = meta["num_samples"], meta["metrics"]
        if not (isinstance(task_id, str) and isinstance(client_id, str) and isinstance(version, int)
                and isinstance(samples, int) and samples >= 0 and isinstance(metrics, dict)
                and all(isinstance(v, (int, float)) for v in metrics.values())):
            raise ValueError("its metadata lacks a task id, client id, version, sample count or metrics")
        if not all(bool(torch.isfinite(v).all()) for v in deltas.values()):
            raise ValueError("its values are not all finite")
        result = ClientResult(client_id, samples, {}, {str(k): float(v) for k, v in metrics.items()}, deltas)
        return JournaledResult(seq, task_id, version, result)

    def tasks_since(self, version: int) -> dict[str, list[Any]]:
        """The tasks given from ``version`` on: task id -> [client, version, deadline, sent] (the checkpoint's
        in-flight form)."""
        return {t["task_id"]: [t["client_id"], t["version"], t["deadline"], t["sent"]] for t in self._tasks()
                if t["version"] >= version}

    def _tasks(self) -> list[dict[str, Any]]:
        path = self.dir / TASKS
        if not path.exists():
            return []
        return [t for t in read_jsonl(path) if isinstance(t.get("task_id"), str) and isinstance(t.get("client_id"), str)
                and isinstance(t.get("version"), int) and isinstance(t.get("deadline"), (int, float))
                and isinstance(t.get("sent"), (int, float))]
