"""Local objectives a task can ask a device to run, by name.

Each objective is a function of the model (already holding the weights the task
sent down), the device's private data, the task's hyperparameters and a seed; it
returns how many samples it used and a few metrics. The client then sends back
exactly the tensors the task asked for. Methods from papers keep their client side
in their folder under ``methods/`` (``device.py``) and are listed in :mod:`edge_client.registry`.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from edge_client.app import App, Samples, evaluate_metrics
from edge_client.data import ClientRows, holdout_split
from edge_client.hyper import ObjectiveError, TrainHyper
from edge_client.optim import DeviceSGD
from edge_client.seeding import task_generator
from profiling.memory_trace import mark
from profiling.profiler import Profiler

__all__ = ["ObjectiveError", "LocalData", "TaskContext", "task_key", "ObjectiveOutput", "OBJECTIVES", "train", "evaluate",
           "shuffle_seed", "TrainHyper", "evaluate_local", "local_data", "holdout_seed",
           "local_data_view", "warm_up", "minibatches",
           "Objective", "DIVERGED", "check_finite_metrics"]

DIVERGED = "training diverged"   # what a device's answer says when its loss or metrics went infinite or NaN


@dataclass(frozen=True)
class LocalData:
    """A device's private data: what it trains on and, optionally, a held-out local test split."""

    x: torch.Tensor  # float32 [N, C, H, W]; a device's own images: edge_client.inputs.PixelInputs, read by rows
    y: torch.Tensor  # int64 [N]
    x_test: torch.Tensor | None = None
    y_test: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def num_test(self) -> int:
        return 0 if self.y_test is None else int(self.y_test.shape[0])

    def to(self, device: torch.device) -> "LocalData":
        """The same data on ``device`` (itself on the CPU: no copy), moved once, not per batch."""
        if self.x.device == device:
            return self
        move = [None if t is None else t.to(device) for t in (self.x, self.y, self.x_test, self.y_test)]
        return LocalData(*move)


def local_data(x: np.ndarray, y: np.ndarray, test_fraction: float, *, seed: int, client_id: str) -> LocalData:
    """A device's LocalData from numpy arrays, holding out ``test_fraction`` for local evaluation."""
    x_tr, y_tr, x_te, y_te = holdout_split(x, y, test_fraction, holdout_seed(seed, client_id))
    return _as_local_data(x_tr, y_tr, x_te, y_te, test_fraction > 0)


def holdout_seed(seed: int, client_id: str) -> int:
    """Seed of a client's local test split: the same rows on every start of that client."""
    return seed ^ zlib.crc32(client_id.encode())


def local_data_view(rows: ClientRows, index: int, test_fraction: float) -> LocalData:
    """Client ``index``'s LocalData in a simulation: the rows :func:`local_data` would give it, as
    tensors that are views of the arrays all clients share (arranged with :func:`holdout_seed`)."""
    return _as_local_data(*rows.client(index), test_fraction > 0)


def _as_local_data(x_tr: np.ndarray, y_tr: np.ndarray, x_te: np.ndarray, y_te: np.ndarray,
                   with_test: bool) -> LocalData:
    """Tensors sharing the arrays' memory (torch.from_numpy copies nothing)."""
    if not with_test:
        return LocalData(torch.from_numpy(x_tr), torch.from_numpy(y_tr))
    return LocalData(torch.from_numpy(x_tr), torch.from_numpy(y_tr), torch.from_numpy(x_te), torch.from_numpy(y_te))


@dataclass(frozen=True)
class TaskContext:
    """Where and when an objective runs: what it may need beyond the model and data."""

    seed: int                  # derived from (run seed, round, client id): reproducible everywhere
    round: int
    client_id: str
    state_dir: Path | None     # survives restarts: local state a method keeps on the device
    profiler: Profiler
    device: torch.device = torch.device("cpu")   # where the model and data live; new tensors go there too
    app: App | None = None     # the app of the task's model spec; None: fedge's own networks (cross-entropy, accuracy)


def task_key(ctx: TaskContext) -> str:
    """What names a training task in state a device keeps: its round and seed. The same task sent again
    after a coordinator resumes has the same key, so the device can start it from its state before it."""
    return f"{ctx.round}:{ctx.seed}"


@dataclass(frozen=True)
class ObjectiveOutput:
    num_samples: int
    metrics: dict[str, float]
    # Tensors to send back when they are not the model's parameters (e.g. statistics);
    # None: the client sends the model parameters the task names in ``up``.
    tensors: dict[str, torch.Tensor] | None = None


def check_finite_metrics(output: ObjectiveOutput, round: int) -> None:
    """Raise ObjectiveError when a metric came out infinite or NaN: the model the task carried (or what
    training made of it) diverged, and saying so is more use than a result that cannot even be encoded."""
    bad = {name: value for name, value in output.metrics.items()
           if isinstance(value, float) and not math.isfinite(value)}
    if bad:
        said = ", ".join(f"{name} is {value}" for name, value in sorted(bad.items()))
        raise ObjectiveError(f"{DIVERGED} ({said} in round {round}): the model the task carried is broken or the "
                             "learning rate is too high")


def warm_up() -> None:
    """Pay one-time costs before the first task, not inside it.

    A first task slower than the rest shows up as a slow first round and makes every
    device look like a straggler to deadline-aware selection. Training uses
    :class:`~edge_client.optim.DeviceSGD`, whose first step costs milliseconds (the
    ``torch.optim.Optimizer`` it replaces imported ``torch._dynamo``: 1.25 s on a 2-core
    x86 server, several seconds on a Raspberry Pi, and 72 MB); one step here keeps it so.
    """
    weight = torch.zeros(1, requires_grad=True)
    weight.grad = torch.ones(1)
    DeviceSGD([weight], lr=0.1, momentum=0.9).step()


def shuffle_seed(seed: int, round: int, client_id: str) -> int:
    """Seed for a client's local shuffling, the same in every process and on resume."""
    return (seed * 1_000_003 + round * 10_007 + zlib.crc32(client_id.encode())) % (2**63)


Criterion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def train(model: nn.Module, data: LocalData, hyper: Mapping[str, Any], ctx: TaskContext, *,
          criterion: Criterion | None = None) -> ObjectiveOutput:
    """SGD on the local data; with ``mu > 0`` adds FedProx's (mu/2)||w - w_global||^2.

    A fresh optimizer each round, so momentum never leaks between rounds.
    ``criterion(scores, labels)``: the loss; a method with its own (a squared error
    against fixed class vectors, say) reuses this loop through it. None: the task's app's loss,
    cross-entropy for fedge's own networks.
    """
    if criterion is None:
        criterion = ctx.app.loss if ctx.app is not None else F.cross_entropy
    h = TrainHyper.from_dict(hyper)
    if len(data) == 0:
        raise ObjectiveError("this device has no training samples")
    params = [p for p in model.parameters() if p.requires_grad]
    anchor = [p.detach().clone() for p in params] if h.mu > 0 else []
    opt = DeviceSGD(params, lr=h.lr, momentum=h.momentum, weight_decay=h.weight_decay)
    mark("optimizer")
    profiler = ctx.profiler
    gen = task_generator(ctx.seed)
    model.train()
    total_loss, seen = 0.0, 0
    per_epoch = math.ceil(len(data) / h.batch_size)
    steps = min(h.epochs * per_epoch, h.max_steps or h.epochs * per_epoch)   # a task may cap them (max_steps)
    last_epoch = max(0, steps - per_epoch)   # the first of the last epoch's worth of steps
    squared, last_seen = 0.0, 0
    batches = itertools.islice(minibatches(data, h.batch_size, h.epochs, gen, profiler), steps)
    for step, (xb, yb) in enumerate(batches):
        scores = model(xb)
        loss = criterion(scores, yb)
        objective = loss
        if anchor:
            objective = loss + 0.5 * h.mu * sum(((p - a) ** 2).sum() for p, a in zip(params, anchor))
        profiler.lap("forward")
        opt.zero_grad()
        objective.backward()
        if h.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, h.max_grad_norm)
        profiler.lap("backward")
        opt.step()
        profiler.lap("optimizer")
        value = float(loss.detach())
        if not math.isfinite(value):
            raise ObjectiveError(f"{DIVERGED} (non-finite loss in round {ctx.round}): the model the task carried "
                                 "is broken or the learning rate is too high")
        total_loss += value * len(yb)
        seen += len(yb)
        if step >= last_epoch:
            squared += _squared_losses(criterion, scores, yb, value)
            last_seen += len(yb)
        profiler.end_step(len(yb))
    mark("training")
    return ObjectiveOutput(num_samples=len(data), metrics={"train_loss": total_loss / max(seen, 1),
                                                           "train_loss_sq": squared / max(last_seen, 1)})


def _squared_losses(criterion: Criterion, scores: torch.Tensor, labels: torch.Tensor, batch_loss: float) -> float:
    """The sum of the batch's squared per-sample losses, for ``train_loss_sq``: the mean squared loss of the
    last epoch, which utility-driven client selection (Oort's statistical utility) ranks devices by.

    Exact for cross-entropy; a method's own criterion gives only the batch mean, so its samples count the
    squared batch loss each (a lower bound of the exact figure, by Jensen's inequality).
    """
    if criterion is F.cross_entropy:
        with torch.no_grad():
            return float((F.cross_entropy(scores.detach(), labels, reduction="none") ** 2).sum())
    return batch_loss ** 2 * len(labels)


def minibatches(data: LocalData, batch_size: int, epochs: int, gen: torch.Generator,
                profiler: Profiler) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Shuffled mini-batches, epoch after epoch, each opening a profiler step with its ``data`` lap.

    Every local objective loops this way, so the order of samples (and with it a
    seeded run's result) and the profile's step phases mean the same in all of them.
    The caller ends the step (``profiler.end_step``) after its optimizer step.
    """
    for _ in range(epochs):
        order = torch.randperm(len(data), generator=gen)
        for start in range(0, len(data), batch_size):
            profiler.begin_step()
            idx = order[start:start + batch_size].to(data.x.device)
            xb, yb = data.x[idx], data.y[idx]
            profiler.lap("data")
            yield xb, yb


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on (x, y)."""
    model.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, len(y), batch_size):
        logits = model(x[start:start + batch_size])
        yb = y[start:start + batch_size]
        loss_sum += float(F.cross_entropy(logits, yb, reduction="sum"))
        correct += int((logits.argmax(1) == yb).sum())
    n = max(len(y), 1)
    return loss_sum / n, correct / n


def evaluate_local(model: nn.Module, data: LocalData, hyper: Mapping[str, Any], ctx: TaskContext) -> ObjectiveOutput:
    """Personalized evaluation: the received model on this device's held-out split.

    With ``finetune_epochs > 0`` the model is first trained that many epochs on the local
    train split (the "FedAvg + local fine-tuning" baseline). Nothing is uploaded.
    """
    if data.num_test == 0:
        raise ObjectiveError("this device has no local test split; set data.local_test_fraction > 0")
    epochs = int(hyper.get("finetune_epochs", 0))
    if epochs > 0:
        train(model, data, {**hyper.get("train", {}), "epochs": epochs}, ctx)
    if ctx.app is not None:
        figures = evaluate_metrics(ctx.app, model, Samples(data.x_test, data.y_test))
        return ObjectiveOutput(num_samples=data.num_test, metrics={f"local_{k}": v for k, v in figures.items()},
                               tensors={})
    loss, accuracy = evaluate(model, data.x_test, data.y_test)
    return ObjectiveOutput(num_samples=data.num_test, metrics={"local_accuracy": accuracy, "local_loss": loss},
                           tensors={})


Objective = Callable[[nn.Module, LocalData, Mapping[str, Any], TaskContext], ObjectiveOutput]
# Plain training and personalized evaluation; each method adds its own (edge_client/registry.py).
OBJECTIVES: dict[str, Objective] = {"train": train, "evaluate": evaluate_local}
