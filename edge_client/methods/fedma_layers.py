"""FedMA's layers on both sides: the weight layers in order and their re-indexing to matched neurons.

After the coordinator matches layer ``l`` (:mod:`coordinator.fedma_matching`), every
device moves the inputs of its layer ``l + 1`` to the global neurons it was matched
to, so it computes the same function at the global width; the coordinator cuts a
grown global model back to one device's width with the inverse. Both sides use
these functions, so they live in the device package.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from storage.errors import FedgeError

__all__ = ["FedMAError", "weight_layers", "reindex_next_layer", "client_slice"]


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
