"""What happens to a round once it is trained: its test-set evaluation, its row and its checkpoint.

A round's checkpoint is written the moment its aggregate exists, with its row beside it in
``metrics.jsonl`` (:class:`RunRecords`), so a coordinator killed at any moment after that resumes
from that round. The evaluation runs on a thread of its own while the next round trains (at most
one at a time: they share the evaluation network) and outlasts it; until it is done the row says
``"evaluation": "pending"``, and it is then rewritten with the evaluation's columns. A trained
round waits in :class:`TrainedRounds` until its evaluation is done, and rounds are completed
(their rows reported) in round order. Each waiting round holds a snapshot of the state it ended
on, so what is evaluated is what that round produced and was checkpointed.

A coordinator killed while an evaluation ran leaves its row pending; the resumed run evaluates
that round's checkpoint again (:meth:`RunRecords.evaluate_pending`) before it trains, which gives
the same columns: the evaluation is a function of the checkpointed state and the test split.
With ``checkpoint.keep = "last"`` the checkpoints of pending rows are kept until their rows are
complete, for that purpose.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from coordinator.runtime.run_error import RunError
from coordinator.strategies.base import Strategy
from edge_client.registry import build_aside
from storage.checkpoint import checkpoint_rounds, load_checkpoint, prune_checkpoints, save_checkpoint
from storage.files import read_jsonl, write_jsonl_atomic
from storage.state import ServerState

__all__ = ["EvalData", "Evaluation", "RunRecords", "TrainedRound", "TrainedRounds", "snapshot", "write_checkpoint",
           "EVALUATION", "PENDING"]

log = logging.getLogger("fedge.coordinator")

Complete = Callable[[dict[str, Any]], None]   # a round's finished row (its evaluation in it)
EVALUATION = "evaluation"   # the column of a row whose evaluation is not in it yet ...
PENDING = "pending"         # ... because it still runs (or ran in a process that died)
MISSING = "missing"         # ... and cannot be done again: the round's checkpoint is gone


@dataclass(frozen=True)
class EvalData:
    x: torch.Tensor
    y: torch.Tensor


@dataclass
class TrainedRound:
    """A trained round whose row is complete once its test-set evaluation (if any) is done."""

    row: dict[str, Any]
    evaluation: Future[dict[str, Any]] | None = None      # None: no evaluation this round


def snapshot(state: ServerState) -> ServerState:
    """A copy of ``state`` that nothing done in later rounds can change."""
    return dataclasses.replace(state, params={k: v.detach().clone() for k, v in state.params.items()},
                               spec=copy.deepcopy(state.spec), extra=copy.deepcopy(state.extra),
                               buffers={k: v.detach().clone() for k, v in state.buffers.items()})


class Evaluation:
    """The strategy's evaluation of a state on the coordinator's test split, on the evaluation device
    and a network of its own (rebuilt only when the spec changes)."""

    def __init__(self, strategy: Strategy, data: EvalData, device: torch.device) -> None:
        self.strategy = strategy
        self.data = data
        self.device = device
        self._model: nn.Module | None = None
        self._model_key = ""
        self._torch_threads = torch.get_num_threads()   # what the evaluation thread uses

    def _prepare(self, state: ServerState) -> Callable[[], dict[str, Any]]:
        """The evaluation of ``state`` as work to run, on the evaluation network and device."""
        key = json.dumps(state.spec, sort_keys=True)
        if key != self._model_key:
            self._model, self._model_key = build_aside(state.spec).to(self.device), key
        if self.data.x.device != self.device:   # moved once, not per evaluation
            self.data = EvalData(self.data.x.to(self.device), self.data.y.to(self.device))
        model, data = self._model, self.data

        def work() -> dict[str, Any]:
            model.load_state_dict(state.params, strict=False)
            return self.strategy.evaluate(state, model, data.x, data.y)
        return work

    def now(self, state: ServerState) -> dict[str, Any]:
        """Evaluate ``state`` here and now (never while a background evaluation runs: they share the network)."""
        return self._prepare(state)()

    def in_background(self, state: ServerState) -> Future[dict[str, Any]]:
        """Evaluate ``state`` (a snapshot) on a new thread."""
        evaluation = self._prepare(state)
        future: Future[dict[str, Any]] = Future()

        def work() -> None:
            torch.set_num_threads(self._torch_threads)   # a new thread would take the default of the moment
            try:
                future.set_result(evaluation())
            except BaseException as exc:   # handed to the run's thread, which raises it
                future.set_exception(exc)

        threading.Thread(target=work, name=f"fedge-evaluate-{state.round}", daemon=True).start()
        return future


class TrainedRounds:
    """Trained rounds whose rows wait for their evaluation, completed in round order."""

    def __init__(self) -> None:
        self._waiting: deque[TrainedRound] = deque()
        self._complete: Complete = lambda row: None

    @contextmanager
    def completing(self, complete: Complete) -> Iterator[TrainedRounds]:
        """Hand each round added meanwhile to ``complete(row)`` as soon as its evaluation is done, and all of
        them at the end. If something ends the block early, the evaluations under way are waited for first
        (a resumed run need not do them again); an evaluation that failed ends the run."""
        self._complete = complete
        try:
            yield self
            self.complete(wait=True)
        except BaseException:
            try:   # the evaluations under way: a resumed run need not do them again
                self.complete(wait=True)
            except Exception as exc:
                log.error("could not complete the rows of the rounds trained before the run stopped: %s", exc)
            raise
        finally:
            self._waiting.clear()
            self._complete = lambda row: None

    def add(self, trained: TrainedRound) -> None:
        self._waiting.append(trained)

    def complete(self, wait: bool = False) -> None:
        """Complete trained rounds in order while their evaluation is done (``wait``: wait for it)."""
        while self._waiting:
            head = self._waiting[0]
            if head.evaluation is not None and not wait and not head.evaluation.done():
                return
            self._waiting.popleft()
            try:
                if head.evaluation is not None:
                    try:
                        head.row.update(head.evaluation.result())
                    except Exception as exc:
                        raise RunError(f"the test-set evaluation of round {head.row['round']} failed: "
                                       f"{type(exc).__name__}: {exc}; its checkpoint is written: run again with "
                                       "--resume to evaluate it again and go on") from exc
                    head.row.pop(EVALUATION, None)
                self._complete(head.row)
            except BaseException:
                self._waiting.clear()   # a later round's row must not be completed before this one's
                raise


def write_checkpoint(out: Path, state: ServerState, info: dict[str, Any], *, keep_all: bool) -> Path:
    """Save ``state`` as the checkpoint of its round in ``out/checkpoints``; a full disk ends the run, saying
    how to go on."""
    try:
        return save_checkpoint(out / "checkpoints", state, info, keep_all=keep_all)
    except OSError as exc:
        raise RunError(f"could not write the checkpoint of round {state.round} in {out / 'checkpoints'} "
                       f"({exc.strerror or exc}); the checkpoints before it are intact: free space and run "
                       "again with --resume") from None


class RunRecords:
    """A run's ``metrics.jsonl`` and ``checkpoints/``, written so that a coordinator killed at any moment loses
    no round it aggregated: each round's row and checkpoint go to disk as soon as it is trained
    (:meth:`trained`), its evaluation's columns when they come (:meth:`completed`)."""

    def __init__(self, out: Path, rows: list[dict[str, Any]], *, checkpoint: Callable[[ServerState], Path],
                 keep_all: bool, on_round: Callable[[dict[str, Any]], None]) -> None:
        self.path = out / "metrics.jsonl"
        self.checkpoints = out / "checkpoints"
        self.rows = rows
        self._checkpoint = checkpoint      # writes a state as its round's checkpoint (every one kept)
        self._keep_all = keep_all
        self._on_round = on_round

    @staticmethod
    def read(out: Path, up_to_round: int) -> list[dict[str, Any]]:
        """The rows of rounds up to the last checkpoint (a resumed run drops those past it: it trains them again)."""
        path = out / "metrics.jsonl"
        if not path.exists():
            return []
        return [r for r in read_jsonl(path) if isinstance(r.get("round"), int) and r["round"] <= up_to_round]

    @staticmethod
    def pending(out: Path, up_to_round: int) -> list[int]:
        """The rounds up to the last checkpoint whose evaluation a stopped coordinator left undone."""
        return [r["round"] for r in RunRecords.read(out, up_to_round) if r.get(EVALUATION) == PENDING]

    def write(self) -> None:
        write_jsonl_atomic(self.path, self.rows)

    def trained(self, row: dict[str, Any], state: ServerState, *, evaluating: bool) -> None:
        """A round is aggregated: its row (``evaluating``: marked pending until its evaluation comes), then its
        checkpoint, so that a checkpoint always has its row."""
        if evaluating:
            row[EVALUATION] = PENDING
        self.rows.append(row)
        self.write()
        self._checkpoint(state)
        self._prune()

    def completed(self, row: dict[str, Any]) -> None:
        """A round's row is whole (its evaluation in it, if it had one): written again, and reported."""
        self.write()
        self._prune()
        self._on_round(row)

    def complete(self, row: dict[str, Any], state: ServerState) -> None:
        """A round whose row is whole at once (evaluated in line): row, checkpoint, report."""
        self.trained(row, state, evaluating=False)
        self._on_round(row)

    def evaluate_pending(self, evaluate: Callable[[ServerState], dict[str, Any]]) -> None:
        """On resume: the rows a killed coordinator left pending, evaluated again from their rounds'
        checkpoints; a row whose checkpoint is gone says ``"evaluation": "missing"``."""
        found = checkpoint_rounds(self.checkpoints)
        for row in [r for r in self.rows if r.get(EVALUATION) == PENDING]:
            path = found.get(row["round"])
            if path is None:
                log.warning("round %d's evaluation was lost with the coordinator that ran it, and its checkpoint "
                            "is gone: its row has no test-set columns", row["round"])
                row[EVALUATION] = MISSING
            else:
                log.info("evaluating round %d again: the coordinator that trained it stopped before its "
                         "evaluation was done", row["round"])
                row.update(evaluate(load_checkpoint(path)[0]))
                row.pop(EVALUATION)
            self.completed(row)

    def _prune(self) -> None:
        """``checkpoint.keep = "last"``: the newest checkpoint, and those of rows whose evaluation is pending."""
        if not self._keep_all:
            prune_checkpoints(self.checkpoints, {r["round"] for r in self.rows if r.get(EVALUATION) == PENDING})
