"""FedMA on the device: train, then freeze the matched layers and retrain the rest, phase after phase.

A FedMA pass has one phase per weight layer (:mod:`methods.fedma.strategy`).
In phase 1 the device trains its whole network (the global model, cut to its own
width by the coordinator) and sends layer 1. In phase ``l > 1`` the task brings the
matched global layer ``l - 1`` and this device's assignment of its neurons to the
global ones; the device puts the global layer in place of its own, moves the inputs
of its layer ``l`` to the global neurons (:func:`reindex_next_layer`: the function it
computes does not change), freezes layers ``1 .. l - 1`` and retrains the layers
above; then it sends layer ``l``. The last phase is the classifier's, sent with the
device's label histogram (the coordinator averages each class's row by it).

Between phases the device's own network lives in ``STATE_DIR/fedma/pPASS-lPHASE.safetensors``,
one file per phase of the current pass, written atomically after each (older passes'
files are removed when a pass starts). A coordinator resumed after a crash restarts
from its last checkpoint, which may lie two phases behind what the devices did (its
evaluation and checkpoint trail the training by a round): a phase asked again is
answered from its saved file without training, so the resumed run gets the same layers.

The weight layers in order and their re-indexing to matched neurons (:func:`weight_layers`,
:func:`reindex_next_layer`, :func:`client_slice`) are here too: the coordinator's matching
(:mod:`methods.fedma.matching`) cuts a grown global model back to one device's width with
the inverse, and a device installs no coordinator code.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from edge_client.objectives import LocalData, Objective, ObjectiveError, ObjectiveOutput, TaskContext, train
from methods.common import class_counts
from storage.errors import FedgeError
from storage.files import write_tensors_atomic

__all__ = ["STATE_DIR", "FedmaHyper", "fedma_train", "OBJECTIVES", "phase_file", "FedMAError", "weight_layers",
           "reindex_next_layer", "client_slice"]

STATE_DIR = "fedma"     # under the device's state directory: one file per phase of the current pass


class FedMAError(FedgeError, ValueError):
    """Inputs FedMA cannot work with; the message says how to fix them."""


def weight_layers(model: nn.Module) -> list[str]:
    """Module names of the network's weight layers in forward order: the extractor's convolutions
    and linear layers (``features.N``), then ``classifier``. FedMA's layer ``l`` is entry ``l - 1``."""
    features = getattr(model, "features", None)
    if not isinstance(features, nn.Sequential) or not isinstance(getattr(model, "classifier", None), nn.Linear):
        raise FedMAError(f"FedMA matches the layers of a registry model (features + classifier); "
                         f"{type(model).__name__} is not one")
    names = [f"features.{i}" for i, m in enumerate(features) if isinstance(m, (nn.Conv2d, nn.Linear))]
    return [*names, "classifier"]


def _checked_assignment(assignment: Tensor, global_width: int) -> Tensor:
    if not isinstance(assignment, Tensor) or assignment.dim() != 1 or assignment.is_floating_point() \
            or assignment.dtype == torch.bool:
        raise FedMAError("assignment must be a 1-D integer tensor (one of Matching.assignments)")
    if assignment.numel() and (int(assignment.min()) < 0 or int(assignment.max()) >= global_width):
        raise FedMAError(f"assignment holds indices outside 0..{global_width - 1}: pass the global width of "
                         "the matching the assignment came from")
    if assignment.unique().numel() != assignment.numel():
        raise FedMAError("assignment maps two neurons to the same global neuron: pass one client's assignment "
                         "from match_layer, whose indices are distinct")
    return assignment.to(torch.int64)


def reindex_next_layer(weight: Tensor, assignment: Tensor, global_width: int, per_channel: int = 1) -> Tensor:
    """The next layer's weight with its inputs moved to the global neurons, zeros where the client had none.

    The client then computes what it did before at the global width: the inputs it
    never had are multiplied by zero. ``per_channel`` is H*W when a conv layer is
    flattened into a linear one, so that each channel's block of columns moves together.
    """
    if weight.dim() < 2:
        raise FedMAError(f"weight has shape {tuple(weight.shape)}: pass the next layer's Linear or Conv2d weight")
    if not (isinstance(per_channel, int) and per_channel >= 1):
        raise FedMAError(f"per_channel must be a whole number >= 1 (H*W after a flatten, else 1); got {per_channel!r}")
    assignment = _checked_assignment(assignment, global_width)
    own = assignment.numel()
    if weight.shape[1] != own * per_channel:
        raise FedMAError(f"the weight has {weight.shape[1]} inputs but the assignment covers {own} neurons x "
                         f"per_channel {per_channel} = {own * per_channel}: pass per_channel = H*W when a "
                         "flatten sits between the layers, and the layer right after the matched one")
    out, rest = weight.shape[0], tuple(weight.shape[2:])
    moved = weight.new_zeros((out, global_width, per_channel, *rest))
    moved[:, assignment] = weight.detach().reshape(out, own, per_channel, *rest)
    return moved.reshape(out, global_width * per_channel, *rest)


def client_slice(global_weight_next: Tensor, assignment: Tensor, per_channel: int = 1) -> Tensor:
    """The next layer's global weight cut back to one client's own width (the inverse of reindex_next_layer).

    FedMA with communication hands each client the global model at its own width:
    the matched layer's rows are ``global_vectors[assignment]``, and this gives the
    columns of the layer after it.
    """
    if global_weight_next.dim() < 2:
        raise FedMAError(f"weight has shape {tuple(global_weight_next.shape)}: pass the next layer's global "
                         "Linear or Conv2d weight")
    if not (isinstance(per_channel, int) and per_channel >= 1):
        raise FedMAError(f"per_channel must be a whole number >= 1 (H*W after a flatten, else 1); got {per_channel!r}")
    if global_weight_next.shape[1] % per_channel:
        raise FedMAError(f"the weight's {global_weight_next.shape[1]} inputs are not a multiple of per_channel "
                         f"{per_channel}: pass per_channel = H*W of the matched conv layer's output")
    global_width = global_weight_next.shape[1] // per_channel
    assignment = _checked_assignment(assignment, global_width)
    out, rest = global_weight_next.shape[0], tuple(global_weight_next.shape[2:])
    blocks = global_weight_next.detach().reshape(out, global_width, per_channel, *rest)[:, assignment]
    return blocks.reshape(out, assignment.numel() * per_channel, *rest).contiguous()


@dataclass(frozen=True)
class FedmaHyper:
    """The ``fedma`` part of a task: which pass and phase, and the assignment of the layer below."""

    pass_index: int
    layer: int                                  # 1-based weight layer this phase sends; the last is the classifier
    assignment: tuple[int, ...] = ()            # phase > 1: global index of each of this device's layer l-1 neurons

    @classmethod
    def from_dict(cls, hyper: Mapping[str, Any]) -> "FedmaHyper":
        try:
            pass_index, layer = int(hyper["pass"]), int(hyper["layer"])
            assignment = tuple(int(i) for i in hyper.get("assignment", ()))
        except (KeyError, TypeError, ValueError) as exc:
            raise ObjectiveError(f"a fedma task needs fedma.pass, fedma.layer and (after phase 1) "
                                 f"fedma.assignment as integers: {exc}") from None
        if pass_index < 0 or layer < 1 or (layer > 1 and not assignment):
            raise ObjectiveError(f"invalid fedma phase {dict(hyper)!r}")
        return cls(pass_index, layer, assignment)


def _load_state(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except (OSError, SafetensorError) as exc:
        raise ObjectiveError(f"this device's FedMA state {path} cannot be read ({exc}); it cannot go on with "
                             "this pass and will join the next one") from None


def phase_file(state_dir: Path, pass_index: int, layer: int) -> Path:
    """Where the device's network after phase ``layer`` of pass ``pass_index`` is kept."""
    return Path(state_dir) / STATE_DIR / f"p{pass_index}-l{layer}.safetensors"


def _forget_other_passes(state_dir: Path, pass_index: int, *, keep_same_pass: bool = True) -> None:
    """Phase 1 starts a chain afresh: earlier passes' files (and a stale chain of this pass) go."""
    for old in (Path(state_dir) / STATE_DIR).glob("p*-l*.safetensors"):
        if not (keep_same_pass and old.name.startswith(f"p{pass_index}-")):
            old.unlink(missing_ok=True)


def _fingerprint(model: nn.Module, hyper: Mapping[str, Any], names: list[str]) -> str:
    """What the task brought (its hyperparameters and the received layers): a saved phase answers a
    repeated task only if it was computed from the same, not from another run's task."""
    digest = hashlib.sha256(json.dumps(hyper, sort_keys=True, default=str).encode())
    for name in names:
        for p in ("weight", "bias"):
            digest.update(model.get_submodule(name).get_parameter(p).detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _save_state(path: Path, model: nn.Module, h: FedmaHyper, task: str) -> None:
    write_tensors_atomic(path, {k: v for k, v in model.state_dict().items() if v.is_floating_point()},
                         {"pass": str(h.pass_index), "layer": str(h.layer), "task": task})


def _continue_pass(model: nn.Module, h: FedmaHyper, saved: dict[str, torch.Tensor], layers: list[str]) -> None:
    """Load the saved network into ``model`` around the global layer ``l - 1`` the task brought,
    with layer ``l``'s inputs moved to the global neurons."""
    below, layer = layers[h.layer - 2], layers[h.layer - 1]
    current = model.state_dict()
    global_width = current[f"{below}.weight"].shape[0]
    own_width = saved[f"{below}.weight"].shape[0]
    if len(h.assignment) != own_width:
        raise ObjectiveError(f"the assignment has {len(h.assignment)} entries for this device's {own_width} "
                             f"neurons of {below}")
    per_channel = _per_channel_of(saved, below, layer)
    try:
        moved = reindex_next_layer(saved[f"{layer}.weight"], torch.tensor(h.assignment), global_width, per_channel)
    except FedMAError as exc:
        raise ObjectiveError(f"cannot re-index {layer}: {exc}") from None
    state = {k: v for k, v in saved.items() if not k.startswith(f"{below}.")}   # the global layer stays
    state[f"{layer}.weight"] = moved
    for name, value in state.items():
        if name in current and tuple(current[name].shape) != tuple(value.shape):
            raise ObjectiveError(f"this device's saved {name} has shape {tuple(value.shape)}, the phase's network "
                                 f"{tuple(current[name].shape)}")
    model.load_state_dict(state, strict=False)


def _per_channel_of(saved: Mapping[str, torch.Tensor], below: str, layer: str) -> int:
    width, inputs = saved[f"{below}.weight"].shape[0], saved[f"{layer}.weight"].shape[1]
    if inputs % width:
        raise ObjectiveError(f"saved {layer} reads {inputs} inputs, not a multiple of {below}'s {width} neurons")
    return inputs // width


def fedma_train(model: nn.Module, data: LocalData, hyper: Mapping[str, Any], ctx: TaskContext) -> ObjectiveOutput:
    """One FedMA phase on this device; the client then sends layer ``fedma.layer`` of ``model``."""
    h = FedmaHyper.from_dict(hyper.get("fedma", {}))
    if ctx.state_dir is None:
        raise ObjectiveError("FedMA keeps each device's network between phases: start the client with a "
                             "state directory (fedge-client run --state-dir DIR)")
    path = phase_file(ctx.state_dir, h.pass_index, h.layer)
    layers = weight_layers(model)
    if h.layer > len(layers):
        raise ObjectiveError(f"fedma.layer {h.layer}: this network has {len(layers)} weight layers")
    frozen = {f"{name}.{p}" for name in layers[:h.layer - 1] for p in ("weight", "bias")}
    received = _fingerprint(model, hyper, layers[: h.layer - 1][-1:] if h.layer > 1 else layers)
    if path.exists():                            # asked again after a coordinator restart: the same answer
        saved, meta = _load_state(path)
        if meta.get("task") == received:
            model.load_state_dict(saved, strict=False)
            return _output(model, data, {"fedma_repeated": 1.0})
    if h.layer == 1:
        _forget_other_passes(ctx.state_dir, h.pass_index, keep_same_pass=False)
    else:
        before = phase_file(ctx.state_dir, h.pass_index, h.layer - 1)
        if not before.exists():
            raise ObjectiveError(f"this device has no FedMA state of phase {h.layer - 1} of pass {h.pass_index} "
                                 f"(it missed a phase); it joins the next pass")
        saved, _ = _load_state(before)
        _continue_pass(model, h, saved, layers)
    params = dict(model.named_parameters())
    try:
        for name in frozen:
            params[name].requires_grad_(False)
        out = train(model, data, hyper.get("train", {}), ctx)
    finally:
        for p in params.values():   # the network may be cached and reused by the next task
            p.requires_grad_(True)
    _save_state(path, model, h, received)
    return _output(model, data, out.metrics, out.num_samples)


def _output(model: nn.Module, data: LocalData, metrics: Mapping[str, float], num_samples: int | None = None
            ) -> ObjectiveOutput:
    counts = class_counts(data.y, int(model.classifier.out_features))
    return ObjectiveOutput(len(data) if num_samples is None else num_samples, {**metrics, **counts})


OBJECTIVES: dict[str, Objective] = {"fedma_train": fedma_train}
