"""Alignment diagnostics: how far clients' neurons drift apart, and whether a method holds them in place.

These are the measurements the papers on neuron alignment use, shared by the round
engine (weight divergence per round), the benchmarks and the methods:

- :func:`permute_hidden` reorders hidden neurons without changing what a plain
  network computes (a layer's output rows and the next layer's input columns move
  together, with bias and normalization); :func:`shuffle_error` measures how much
  the output changes anyway, which is what an activation tied to neuron positions is for.
- :func:`weight_divergence`: per layer, mean over clients of
  ``||W_k - W_avg|| / ||W_avg||``.
- :func:`neuron_matching`: Hungarian assignment of a client's neurons to the global
  model's by their activations; the fraction that keep their index.
- :func:`class_preferences`: per neuron and class, activation times the gradient of
  that class's score, summed over the batch (class preference vectors).

All of them work on the registry's feed-forward models: a chain of Linear/Conv2d
layers, each followed by optional normalization and a ReLU (or a subclass of it,
such as one that encodes the neuron's position), with max-pools and a flatten in
between, ending in the classifier.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from storage.errors import FedgeError

__all__ = [
    "DiagnosticsError",
    "HiddenLayer",
    "hidden_layers",
    "shuffle_permutation",
    "random_permutations",
    "permute_hidden",
    "shuffle_error",
    "weight_divergence",
    "divergence_metrics",
    "hidden_activations",
    "neuron_matching",
    "class_preferences",
]

_PASS_THROUGH = (nn.MaxPool2d, nn.AvgPool2d, nn.Flatten, nn.Dropout, nn.Identity)
_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.GroupNorm)


class DiagnosticsError(FedgeError, ValueError):
    """The model's structure is not one these diagnostics understand."""


@dataclass
class HiddenLayer:
    """One hidden layer: the modules that produce its neurons and the layer that reads them."""

    name: str                          # module name of the producing layer, e.g. "features.0"
    layer: nn.Linear | nn.Conv2d
    norm: nn.Module | None = None
    activation: nn.Module | None = None
    consumer: nn.Linear | nn.Conv2d | None = None

    @property
    def width(self) -> int:
        return self.layer.out_features if isinstance(self.layer, nn.Linear) else self.layer.out_channels

    @property
    def groups(self) -> int:
        """Blocks a function-preserving permutation must keep together (GroupNorm's groups)."""
        return self.norm.num_groups if isinstance(self.norm, nn.GroupNorm) else 1


def hidden_layers(model: nn.Module) -> list[HiddenLayer]:
    """The hidden layers of a feed-forward model, in forward order (the output layer excluded)."""
    found: list[HiddenLayer] = []
    current: HiddenLayer | None = None
    for name, module in model.named_modules():
        if list(module.children()):
            continue
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            if isinstance(module, nn.Conv2d) and module.groups != 1:
                raise DiagnosticsError(f"{name}: grouped convolutions are not supported by these diagnostics")
            if current is not None:
                if current.activation is None:
                    raise DiagnosticsError(f"{current.name} feeds {name} without an activation in between")
                current.consumer = module
                found.append(current)
            current = HiddenLayer(name, module)
        elif current is None or isinstance(module, _PASS_THROUGH):
            continue
        elif isinstance(module, _NORMS) and current.activation is None:
            current.norm = module
        elif isinstance(module, nn.ReLU) and current.activation is None:
            current.activation = module
        else:
            raise DiagnosticsError(f"{name}: {type(module).__name__} after {current.name} is not supported; "
                                   "expected normalization, ReLU, pooling or flatten")
    return found


# --------------------------------------------------------------------------- permutations


def shuffle_permutation(n: int, p_sf: float, rng: np.random.Generator) -> np.ndarray:
    """The position-aware neurons paper's shuffle: each position j, with probability ``p_sf``, swaps with a
    later one."""
    perm = np.arange(n)
    for j in range(n - 1):
        if rng.random() < p_sf:
            k = int(rng.integers(j + 1, n))
            perm[j], perm[k] = perm[k], perm[j]
    return perm


def _grouped_permutation(n: int, groups: int, p_sf: float, rng: np.random.Generator) -> np.ndarray:
    """A shuffle that moves GroupNorm groups as blocks and shuffles inside each group.

    GroupNorm's statistics are taken per group, so only permutations that keep each
    group's members together preserve the network function.
    """
    size = n // groups
    order = shuffle_permutation(groups, p_sf, rng)
    return np.concatenate([order[g] * size + shuffle_permutation(size, p_sf, rng) for g in range(groups)])


def random_permutations(model: nn.Module, p_sf: float = 1.0, seed: int = 0) -> dict[str, torch.Tensor]:
    """One shuffle per hidden layer, keyed by the producing layer's module name.

    ``perm[i]`` is the old index of the neuron that ends up at position ``i``.
    """
    if not 0.0 <= p_sf <= 1.0:
        raise DiagnosticsError(f"the shuffle probability p_sf must be in [0, 1], got {p_sf}")
    rng = np.random.default_rng(seed)
    return {h.name: torch.from_numpy(_grouped_permutation(h.width, h.groups, p_sf, rng))
            for h in hidden_layers(model)}


@torch.no_grad()
def permute_hidden(model: nn.Module, perms: Mapping[str, torch.Tensor]) -> nn.Module:
    """Reorder hidden neurons in place; with plain ReLUs the network computes the same function.

    Moves a layer's output rows (weight, bias), its normalization's per-neuron
    parameters and running statistics, and the next layer's input columns. Encodings
    an activation keeps of its positions stay where they are: they belong to positions,
    not to neurons.
    """
    for h in hidden_layers(model):
        perm = perms.get(h.name)
        if perm is None:
            continue
        if sorted(perm.tolist()) != list(range(h.width)):
            raise DiagnosticsError(f"{h.name}: not a permutation of its {h.width} neurons")
        tensors = [h.layer.weight, h.layer.bias]
        if h.norm is not None:
            tensors += [h.norm.weight, h.norm.bias, getattr(h.norm, "running_mean", None),
                        getattr(h.norm, "running_var", None)]
        for t in tensors:
            if t is not None:
                t.copy_(t[perm])
        w = h.consumer.weight  # type: ignore[union-attr]
        if isinstance(h.consumer, nn.Linear) and isinstance(h.layer, nn.Conv2d):
            blocks = w.view(w.shape[0], h.width, -1)   # a flattened channel is a block of H*W inputs
            blocks.copy_(blocks[:, perm])
        else:
            w.copy_(w[:, perm])
    return model


@torch.no_grad()
def shuffle_error(model: nn.Module, x: torch.Tensor, p_sf: float = 1.0, seed: int = 0) -> float:
    """Output change after shuffling hidden neurons: mean over samples of ||y_shuffled - y|| / output_dim.

    Zero up to rounding for a plain network; positive when the activations tie neurons to positions.
    The model itself is not changed (a copy is shuffled), and both run in eval mode.
    """
    shuffled = permute_hidden(copy.deepcopy(model), random_permutations(model, p_sf, seed)).eval()
    was_training = model.training
    model.eval()
    y = model(x)
    y_shuffled = shuffled(x)
    model.train(was_training)
    return float((y_shuffled - y).norm(dim=1).mean() / y.shape[1])


# --------------------------------------------------------------------------- weight divergence


def _layer_weights(state: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the layers' weight matrices and kernels (not biases, norms or statistics)."""
    return [k for k, v in state.items() if k.endswith("weight") and v.dim() >= 2]


def weight_divergence(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float] | None = None,
                      names: Sequence[str] | None = None) -> dict[str, float]:
    """Per tensor: mean over clients of ``||W_k - W_avg|| / ||W_avg||``.

    ``W_avg`` is the weighted mean of the clients' tensors (the FedAvg average when
    ``weights`` are sample counts; uniform when None). ``names`` defaults to every
    layer's weight matrix or kernel present in the first state.
    """
    if not states:
        raise DiagnosticsError("weight divergence needs at least one client state")
    w = torch.tensor([1.0] * len(states) if weights is None else [float(v) for v in weights], dtype=torch.float64)
    if len(w) != len(states) or not bool((w > 0).all()):
        raise DiagnosticsError("weight divergence needs one positive weight per client state")
    w = w / w.sum()
    out: dict[str, float] = {}
    for name in names if names is not None else _layer_weights(states[0]):
        stack = torch.stack([s[name].to(torch.float64) for s in states])
        avg = torch.tensordot(w, stack, dims=1)
        scale = float(avg.norm())
        if scale > 0:
            out[name] = float((stack - avg).flatten(1).norm(dim=1).mean()) / scale
    return out


def divergence_metrics(states: Sequence[Mapping[str, torch.Tensor]],
                       weights: Sequence[float] | None = None) -> dict[str, Any]:
    """``weight_divergence`` (per layer) and ``weight_divergence_mean``, for a metrics row."""
    per_layer = weight_divergence(states, weights)
    mean = sum(per_layer.values()) / len(per_layer) if per_layer else 0.0
    return {"weight_divergence": per_layer, "weight_divergence_mean": mean}


# --------------------------------------------------------------------------- activations


def _capture(model: nn.Module, x: torch.Tensor, keep_graph: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run the model and collect every hidden layer's post-activation output."""
    acts: dict[str, torch.Tensor] = {}
    handles = []
    for h in hidden_layers(model):
        def hook(module: nn.Module, inputs: Any, output: torch.Tensor, name: str = h.name) -> None:
            acts[name] = output if keep_graph else output.detach()
        handles.append(h.activation.register_forward_hook(hook))  # type: ignore[union-attr]
    try:
        out = model(x)
    finally:
        for handle in handles:
            handle.remove()
    return out, acts


@torch.no_grad()
def hidden_activations(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per hidden layer, each neuron's activations as rows: ``[J, N]`` (``[J, N*H*W]`` for channels)."""
    was_training = model.training
    model.eval()
    _, acts = _capture(model, x, keep_graph=False)
    model.train(was_training)
    return {name: a.transpose(0, 1).reshape(a.shape[1], -1) for name, a in acts.items()}


def unit_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row of ``t`` centred and scaled to unit norm (float64), and which rows vary at all.

    A neuron without variance on the batch (dead, or constant) has no direction to compare:
    its row becomes zeros, so it correlates with nothing, and the mask lets a caller leave it out.
    """
    t = t.to(torch.float64)
    t = t - t.mean(dim=1, keepdim=True)
    norm = t.norm(dim=1, keepdim=True)
    return torch.where(norm > 0, t / norm.clamp_min(1e-12), torch.zeros_like(t)), norm.squeeze(1) > 0


def _correlation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of every row of ``a`` with every row of ``b`` (dead neurons: 0)."""
    return unit_rows(a)[0] @ unit_rows(b)[0].T


def neuron_matching(client: nn.Module, reference: nn.Module, x: torch.Tensor) -> dict[str, float]:
    """Per hidden layer, the fraction of the client's neurons matched to the same index.

    Each client neuron is matched one-to-one to a neuron of ``reference`` (usually the
    global model) by the Hungarian method on ``1 - correlation`` of their activations
    on the fixed batch ``x``. 1.0 means the two models keep their neurons in the same
    order; a shuffled copy scores about 1/J.
    """
    from scipy.optimize import linear_sum_assignment  # only the coordinator side and benchmarks need scipy

    mine, theirs = hidden_activations(client, x), hidden_activations(reference, x)
    if mine.keys() != theirs.keys():
        raise DiagnosticsError("neuron matching needs two models of the same architecture")
    ratios = {}
    for name, a in mine.items():
        b = theirs[name]
        if a.shape[0] != b.shape[0]:
            raise DiagnosticsError(f"{name}: {a.shape[0]} neurons against {b.shape[0]}; widths must agree")
        rows, cols = linear_sum_assignment((1.0 - _correlation(a, b)).numpy())
        ratios[name] = float(np.mean(cols[np.argsort(rows)] == np.arange(a.shape[0])))
    return ratios


def class_preferences(model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int) -> dict[str, torch.Tensor]:
    """Per hidden layer, a ``[J, C]`` matrix: neuron j's preference for class c.

    Entry (j, c) sums, over the batch's class-c samples (and a channel's spatial
    positions), activation x gradient of the class-c score with respect to that
    activation. Computed in eval mode, where samples do not interact, so one backward
    pass of the sum of each sample's own-class score gives every per-sample gradient.
    """
    if y.dim() != 1 or len(y) != len(x) or (len(y) and (int(y.min()) < 0 or int(y.max()) >= num_classes)):
        raise DiagnosticsError(f"labels must be a 1-D tensor of len(x) values in 0..{num_classes - 1}")
    was_training = model.training
    model.eval()
    try:
        with torch.enable_grad():
            scores, acts = _capture(model, x, keep_graph=True)
            names = list(acts)
            grads = torch.autograd.grad(scores.gather(1, y[:, None]).sum(), [acts[n] for n in names])
    finally:
        model.train(was_training)
    out = {}
    for name, g in zip(names, grads):
        a = acts[name].detach()
        contrib = (a * g).reshape(a.shape[0], a.shape[1], -1).sum(dim=2)          # [N, J]
        pref = torch.zeros(num_classes, a.shape[1], dtype=contrib.dtype).index_add_(0, y, contrib)
        out[name] = pref.T.contiguous()
    return out

