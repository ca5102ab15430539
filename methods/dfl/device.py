"""DFL's client side: the alternating local and global stages, the state that stays on the device.

A ``dfl_train`` task arrives with the global invariant extractor, which the client
has already loaded into the model's ``invariant`` branch. Then:

1. Local stage: ``invariant`` is frozen; the specific extractor and the predictor
   learn with cross-entropy + ``mi_min_weight`` * MI(invariant; specific).
2. Global stage: the specific extractor, the predictor and a frozen copy of the
   received invariant extractor ("glob") are fixed; ``invariant`` learns with
   cross-entropy - ``mi_max_weight`` * MI(invariant; glob) + ``mi_min_weight`` *
   MI(invariant; specific).
3. The client sends back what the task's ``up`` names: the invariant tensors (and,
   with diversity transferring, the specific ones).

In both stages the critics learn to raise their MI estimate
(:func:`methods.dfl.model.jsd_mutual_information`); only the extractors' sign differs. With
diversity transferring, the task also fills ``peers`` slots with other clients'
specific extractors, and each stage adds the mean cross-entropy of the predictor
on ``[invariant(x); peer(x)]``.

The specific extractor, the predictor and the critics never leave the device
(unless diversity is on, then the specific extractor does): they live in
``STATE_DIR/dfl_state.safetensors``, loaded at the start of every DFL task and
written atomically after every training task, so a restarted device goes on from
exactly where it was. A device without that file (or with one for another
architecture) initializes them from the run seed and its client id. Each training
task appends a ``dfl_state`` line to the device's history (``profile.jsonl``) with
the SHA-256 of the file it started from and of the one it wrote.

The file names the task that wrote it, and the state before that task is kept beside
it (``dfl_state.previous.safetensors``): a coordinator that resumes from its last
checkpoint sends the round that was in flight again, and a device that had already
trained it starts that task again from the state it had before, instead of training
its own branches twice (so a resumed run computes what an unbroken one does).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import logging
import math
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_safetensors
from torch import nn

from edge_client.objectives import (LocalData, ObjectiveError, ObjectiveOutput, TaskContext, TrainHyper, evaluate,
                                    minibatches, Objective, task_key)
from edge_client.optim import DeviceAdam, DeviceSGD
from edge_client.seeding import private_rng, task_generator
from methods.dfl.model import DEVICE_PARTS, TwoBranchModel, jsd_mutual_information, mi_penalty
from profiling.history import append_history
from profiling.profiler import Profiler
from storage.files import write_atomic, write_tensors_atomic

__all__ = ["DflHyper", "DeviceState", "STATE_FILE", "PREVIOUS_FILE", "dfl_train", "dfl_evaluate", "local_stage", "global_stage",
           "stage_hyper", "device_seed", "refresh"]

log = logging.getLogger("fedge.dfl")
STATE_FILE = "dfl_state.safetensors"
PREVIOUS_FILE = "dfl_state.previous.safetensors"   # the state before the task that wrote STATE_FILE
CRITIC_LR = 1e-3


@dataclass(frozen=True)
class DflHyper:
    """The ``dfl`` part of a task's hyperparameters (``train`` holds the optimizer's)."""

    local_epochs: int = 1
    global_epochs: int = 1
    mi_min_weight: float = 1.0    # MI(invariant; specific), minimized by the extractors
    mi_max_weight: float = 1.0    # MI(invariant; global invariant), maximized by the invariant extractor
    init_seed: int = 0            # the run seed: initializes a device that has no saved state
    peers: int = 0                # peer slots this task filled (diversity transferring)
    refresh_epochs: int = 0       # evaluate: local-stage epochs against the received invariant first

    @classmethod
    def from_dict(cls, hyper: Mapping[str, Any]) -> "DflHyper":
        unknown = sorted(set(hyper) - set(cls.__dataclass_fields__))
        if unknown:
            raise ObjectiveError(f"unknown dfl hyperparameters {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        h = cls(**hyper)
        if h.local_epochs < 0 or h.global_epochs < 0 or h.mi_min_weight < 0 or h.mi_max_weight < 0 or h.peers < 0 \
                or h.refresh_epochs < 0:
            raise ObjectiveError(f"invalid dfl hyperparameters {dict(hyper)!r}: epochs, weights and peers "
                                 "must not be negative")
        return h


def device_seed(init_seed: int, client_id: str) -> int:
    """Seed of a device's first specific branch, predictor and critics: (run seed, client id)."""
    return (init_seed * 1_000_003 + zlib.crc32(client_id.encode())) % (2**63)


class DeviceState:
    """The device-only parts of a DFL model, in one safetensors file written atomically, and the file
    before the last training task's (see the module docstring: a task sent again starts from it)."""

    def __init__(self, directory: Path | None) -> None:
        if directory is None:
            raise ObjectiveError("DFL keeps its specific branch on the device between rounds: start the client "
                                 "with a state directory (--state-dir)")
        self.path = Path(directory) / STATE_FILE
        self.previous = Path(directory) / PREVIOUS_FILE
        self._before: bytes | None = None    # the saved state a training task started from, kept by its save
        self._again = False                  # the task loaded was the one that wrote the saved state

    @staticmethod
    def tensors(model: TwoBranchModel) -> dict[str, torch.Tensor]:
        state = model.state_dict()
        return {k: v for k, v in state.items() if k.split(".", 1)[0] in DEVICE_PARTS}

    def load_into(self, model: TwoBranchModel, seed: int, task: str | None = None) -> str | None:
        """Load the saved parts into ``model``; return the file's SHA-256, or None after initializing.
        ``task``: the training task about to run (:func:`task_key`); if the saved state is that task's own
        output, the state from before it is loaded (or the device initializes, if it had none)."""
        current = self.path.read_bytes() if self.path.is_file() else None
        self._again = task is not None and current is not None and _written_by(self.path) == task
        self._before = current
        data = current
        if self._again:
            data = self.previous.read_bytes() if self.previous.is_file() else None
            log.info("%s was written by this task already (a resumed run sent it again): starting from the state "
                     "before it", self.path)
        expected = {k: (tuple(v.shape), v.dtype) for k, v in self.tensors(model).items()}
        if data is not None:
            try:
                saved = load_safetensors(data)
            except (SafetensorError, ValueError) as exc:
                saved, reason = {}, f"unreadable ({exc})"
            else:
                reason = "for another architecture"
            if {k: (tuple(v.shape), v.dtype) for k, v in saved.items()} == expected:
                model.load_state_dict(saved, strict=False)
                return hashlib.sha256(data).hexdigest()
            log.warning("%s is %s; starting this device's DFL branches afresh", self.path, reason)
        _initialize(model, seed)
        return None

    def save(self, model: TwoBranchModel, task: str | None = None) -> str:
        """Write the device-only parts atomically, naming ``task``; return the SHA-256 of the file.
        The state the task started from becomes the previous one first (unless the task was sent again:
        then the previous one is already what it started from), so a crash between the two writes leaves
        both files holding the old state, never neither."""
        if not self._again:
            if self._before is not None:
                write_atomic(self.previous, self._before)
            else:
                self.previous.unlink(missing_ok=True)
        metadata = {"task": task} if task is not None else None
        return write_tensors_atomic(self.path, self.tensors(model), metadata)


def _written_by(path: Path) -> str | None:
    """The task a state file names (None: written before files named it, or unreadable)."""
    try:
        with safe_open(str(path), framework="pt") as fh:
            return (fh.metadata() or {}).get("task")
    except (OSError, SafetensorError, ValueError):
        return None


def _initialize(model: TwoBranchModel, seed: int) -> None:
    """Fresh device-only parts, the same on every run of this device (global RNG untouched)."""
    with private_rng(seed):
        for part in DEVICE_PARTS:
            for module in getattr(model, part).modules():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()


@contextlib.contextmanager
def _frozen(*modules: nn.Module) -> Iterator[None]:
    """No gradients and eval mode (BatchNorm statistics stay put) for the duration of a stage."""
    flags = [(p, p.requires_grad) for m in modules for p in m.parameters()]
    modes = [(m, m.training) for m in modules]
    for m in modules:
        m.eval().requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
        for m, mode in modes:
            m.train(mode)


# One batch -> (loss for the extractors and predictor, loss for the critics, cross-entropy, MI estimates)
StepLosses = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, float, dict[str, float]]]


def _run_stage(trainable: list[nn.Parameter], critics: list[nn.Parameter], losses: StepLosses, data: LocalData,
               h: TrainHyper, epochs: int, gen: torch.Generator, profiler: Profiler) -> dict[str, float]:
    """SGD over the local data for the model; Adam for the critics, whose gradients come only from their own loss."""
    opt = DeviceSGD(trainable, lr=h.lr, momentum=h.momentum, weight_decay=h.weight_decay)
    critic_opt = DeviceAdam(critics, lr=CRITIC_LR)
    sums: dict[str, float] = {}
    seen = 0
    for xb, yb in minibatches(data, h.batch_size, epochs, gen, profiler):
        model_loss, critic_loss, ce, mi = losses(xb, yb)
        profiler.lap("forward")
        opt.zero_grad()
        critic_opt.zero_grad()
        model_loss.backward()
        for p in critics:            # the extractors' loss pushes the critics the wrong way for MI minimization
            p.grad = None
        critic_loss.backward()
        if h.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(trainable + critics, h.max_grad_norm)
        profiler.lap("backward")
        opt.step()
        critic_opt.step()
        profiler.lap("optimizer")
        if not math.isfinite(ce) or not all(math.isfinite(v) for v in mi.values()):
            raise ObjectiveError("DFL training diverged (non-finite loss); lower train.lr")
        for key, value in {"ce": ce, **mi}.items():
            sums[key] = sums.get(key, 0.0) + value * len(yb)
        seen += len(yb)
        profiler.end_step(len(yb))
    return {k: v / max(seen, 1) for k, v in sums.items()}


def _peer_ce(model: TwoBranchModel, peers: Sequence[nn.Module], inv: torch.Tensor, xb: torch.Tensor,
             yb: torch.Tensor) -> torch.Tensor:
    """Diversity transferring: mean cross-entropy of the predictor on [invariant; another client's specific]."""
    if not peers:
        return inv.new_zeros(())
    with torch.no_grad():
        reps = [peer(xb) for peer in peers]
    return sum(F.cross_entropy(model.predict(inv, r), yb) for r in reps) / len(reps)


def local_stage(model: TwoBranchModel, data: LocalData, h: TrainHyper, d: DflHyper, gen: torch.Generator,
                profiler: Profiler, peers: Sequence[nn.Module] = ()) -> dict[str, float]:
    """Specific extractor and predictor learn; the received invariant extractor is fixed."""
    critic = model.mi["spe"]

    def losses(xb: torch.Tensor, yb: torch.Tensor):
        with torch.no_grad():
            inv = model.invariant(xb)
        spe = model.specific(xb)
        ce = F.cross_entropy(model.predict(inv, spe), yb)
        mi = jsd_mutual_information(critic, inv, spe, gen)
        model_loss = ce + _peer_ce(model, peers, inv, xb, yb) + d.mi_min_weight * mi_penalty(mi)
        critic_loss = -jsd_mutual_information(critic, inv, spe.detach(), gen)
        return model_loss, critic_loss, float(ce.detach()), {"mi_inv_spe": float(mi.detach())}

    with _frozen(model.invariant, *peers):
        trainable = [*model.specific.parameters(), *model.predictor.parameters()]
        return _run_stage(trainable, list(critic.parameters()), losses, data, h, d.local_epochs, gen, profiler)


def global_stage(model: TwoBranchModel, data: LocalData, h: TrainHyper, d: DflHyper, gen: torch.Generator,
                 profiler: Profiler, peers: Sequence[nn.Module] = ()) -> dict[str, float]:
    """The invariant extractor learns; specific extractor, predictor and the received invariant are fixed."""
    glob = copy.deepcopy(model.invariant)
    spe_critic, glob_critic = model.mi["spe"], model.mi["glob"]

    def losses(xb: torch.Tensor, yb: torch.Tensor):
        inv = model.invariant(xb)
        with torch.no_grad():
            spe, ref = model.specific(xb), glob(xb)
        ce = F.cross_entropy(model.predict(inv, spe), yb)
        mi_spe = jsd_mutual_information(spe_critic, inv, spe, gen)
        mi_glob = jsd_mutual_information(glob_critic, inv, ref, gen)
        model_loss = (ce + _peer_ce(model, peers, inv, xb, yb) + d.mi_min_weight * mi_penalty(mi_spe)
                      - d.mi_max_weight * mi_glob)
        detached = inv.detach()
        critic_loss = -(jsd_mutual_information(spe_critic, detached, spe, gen)
                        + jsd_mutual_information(glob_critic, detached, ref, gen))
        return model_loss, critic_loss, float(ce.detach()), {"mi_inv_spe": float(mi_spe.detach()),
                                                             "mi_inv_glob": float(mi_glob.detach())}

    with _frozen(glob, model.specific, model.predictor, *peers):
        critics = [*spe_critic.parameters(), *glob_critic.parameters()]
        return _run_stage(list(model.invariant.parameters()), critics, losses, data, h, d.global_epochs, gen,
                          profiler)


def _two_branch(model: nn.Module) -> TwoBranchModel:
    if not isinstance(model, TwoBranchModel):
        raise ObjectiveError(f"DFL objectives need the two-branch model (model name 'dfl'), got "
                             f"{type(model).__name__}; run them with run.strategy = 'dfl'")
    return model


def stage_hyper(hyper: Mapping[str, Any]) -> tuple[TrainHyper, DflHyper]:
    """A task's training and DFL settings; the epoch count is each stage's own, not the task's."""
    train = {k: v for k, v in dict(hyper.get("train", {})).items() if k != "epochs"}  # each stage has its own
    return TrainHyper.from_dict(train), DflHyper.from_dict(hyper.get("dfl", {}))


def dfl_train(model: nn.Module, data: LocalData, hyper: Mapping[str, Any], ctx: TaskContext) -> ObjectiveOutput:
    """One round of DFL on this device: local stage, global stage, save the device-only parts."""
    model = _two_branch(model)
    h, d = stage_hyper(hyper)
    if len(data) == 0:
        raise ObjectiveError("this device has no training samples")
    if d.peers > len(model.peers):
        raise ObjectiveError(f"the task fills {d.peers} peer slots but the model has {len(model.peers)}")
    store = DeviceState(ctx.state_dir)
    loaded = store.load_into(model, device_seed(d.init_seed, ctx.client_id), task=task_key(ctx))
    gen = task_generator(ctx.seed)
    model.train()
    peers = list(model.peers)[:d.peers]
    local = local_stage(model, data, h, d, gen, ctx.profiler, peers)
    glob = global_stage(model, data, h, d, gen, ctx.profiler, peers)
    saved = store.save(model, task=task_key(ctx))
    append_history(store.path.parent, "dfl_state", {"round": ctx.round, "loaded": loaded, "saved": saved})
    metrics = {"train_loss": glob.get("ce", local.get("ce", 0.0)), "local_stage_loss": local.get("ce", 0.0),
               "mi_inv_spe": glob.get("mi_inv_spe", local.get("mi_inv_spe", 0.0)),
               "mi_inv_glob": glob.get("mi_inv_glob", 0.0), "state_initialized": float(loaded is None)}
    return ObjectiveOutput(num_samples=len(data), metrics=metrics)


def refresh(model: TwoBranchModel, data: LocalData, h: TrainHyper, d: DflHyper, epochs: int,
            ctx: TaskContext) -> dict[str, float]:
    """DFL's local stage (``epochs`` epochs) against the invariant extractor in ``model`` now.

    Why: under partial participation a device's specific extractor and predictor last learned
    when it was last selected, against that round's invariant extractor; paired with a newer one
    they read features that have moved on (docs/evidence/dfl.md, "Stale devices"). Seeded as a training
    task of this context would be."""
    model.train()
    return local_stage(model, data, h, dataclasses.replace(d, local_epochs=epochs), task_generator(ctx.seed),
                       ctx.profiler)


def dfl_evaluate(model: nn.Module, data: LocalData, hyper: Mapping[str, Any], ctx: TaskContext) -> ObjectiveOutput:
    """Personalized accuracy: the received global invariant branch with this device's own specific
    branch and predictor, on its held-out split. A device that has not trained yet uses its
    initial branches. With ``dfl.refresh_epochs`` the specific branch and predictor first learn
    that many local-stage epochs against the received invariant branch (the task's ``train``
    settings). Nothing is uploaded, nothing is saved: the next task starts from the saved state."""
    model = _two_branch(model)
    if data.num_test == 0:
        raise ObjectiveError("this device has no local test split; set data.local_test_fraction > 0 "
                             "(--local-test-fraction on a device)")
    h, d = stage_hyper(hyper)
    DeviceState(ctx.state_dir).load_into(model, device_seed(d.init_seed, ctx.client_id))
    if d.refresh_epochs > 0:
        if len(data) == 0:
            raise ObjectiveError("dfl.refresh_epochs needs training samples on this device; it has none")
        refresh(model, data, h, d, d.refresh_epochs, ctx)
    loss, accuracy = evaluate(model, data.x_test, data.y_test)
    return ObjectiveOutput(num_samples=data.num_test, metrics={"local_accuracy": accuracy, "local_loss": loss},
                           tensors={})


OBJECTIVES: dict[str, Objective] = {"dfl_train": dfl_train, "dfl_evaluate": dfl_evaluate}
