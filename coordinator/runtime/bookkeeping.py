"""What happens to a round once it is trained: its test-set evaluation, its row and its checkpoint.

The evaluation runs on a thread of its own while the next round trains (at most one at a
time: they share the evaluation network); a trained round waits in :class:`TrainedRounds`
until its evaluation is done, and rounds are completed (row written, then checkpoint) in
round order. Each waiting round holds a snapshot of the state it ended on, so what is
evaluated and checkpointed is what that round produced.
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
from storage.checkpoint import save_checkpoint
from storage.state import ServerState

__all__ = ["EvalData", "Evaluation", "TrainedRound", "TrainedRounds", "snapshot", "write_checkpoint"]

log = logging.getLogger("fedge.coordinator")

Complete = Callable[[dict[str, Any], ServerState], None]   # a round's finished row and the state it ended on


@dataclass(frozen=True)
class EvalData:
    x: torch.Tensor
    y: torch.Tensor


@dataclass
class TrainedRound:
    """A trained round whose row is complete once its test-set evaluation (if any) is done."""

    row: dict[str, Any]
    state: ServerState                                      # snapshot: what is evaluated and checkpointed
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
        self._complete: Complete = lambda row, state: None

    @contextmanager
    def completing(self, complete: Complete) -> Iterator[TrainedRounds]:
        """Hand each round added meanwhile to ``complete(row, state)`` as soon as its evaluation is done, and
        all of them at the end. If something ends the block early, rows already trained are completed first
        (a resumed run need not train them again); an evaluation that failed ends the run."""
        self._complete = complete
        try:
            yield self
            self.complete(wait=True)
        except BaseException:
            try:   # keep what was trained: a resumed run need not do it again
                self.complete(wait=True)
            except Exception as exc:
                log.error("could not complete the rows of the rounds trained before the run stopped: %s", exc)
            raise
        finally:
            self._waiting.clear()
            self._complete = lambda row, state: None

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
                                       f"{type(exc).__name__}: {exc}") from exc
                self._complete(head.row, head.state)
            except BaseException:
                self._waiting.clear()   # a later round's row must not be written before this one's
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
