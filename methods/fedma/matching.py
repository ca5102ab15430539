"""FedMA's matching core: which client neurons are the same neuron, and the layers around them.

Clients that start from different initializations (or drift far apart) learn the
same features at different indices, so averaging by index blurs them. FedMA
(Wang et al., ICLR 2020) averages one layer at a time by matching: every client
neuron -- its incoming weights flattened in (input channel, kh, kw) order with
its bias appended -- is read as a noisy copy of some global neuron, and PFNM's
BBP-MAP assigns each client's neurons to global neurons (or to new ones) so that
the posterior is largest. With precisions ``p = 1/sigma`` and ``p0 = 1/sigma0``
and prior mean ``mu0``, global neuron ``i`` keeps

    G_i = p0 mu0 + sum of p w over the client neurons matched to it,
    P_i = p0 + n_i p,          and its value is G_i / P_i.

For a client's neuron ``w`` (``J`` clients in all, ``K`` global neurons so far):

- joining neuron ``i`` scores ``sum_d (p w + G_i)^2 / (p + P_i) - sum_d G_i^2 / P_i
  + log(m / (J - m))`` with ``m = min(n_i, 10)``;
- opening the k-th new neuron scores ``sum_d (p w + p0 mu0)^2 / (p0 + p)
  - sum_d (p0 mu0)^2 / p0 + 2 log(gamma / J) - 2 log k``.

One client at a time, the Hungarian method picks the assignment with the largest
total score. The clients go once in order of decreasing width, then ``sweeps``
times in a seeded random order, each taking its own contribution out and being
matched again. The next layer's inputs are then re-indexed to the global neurons,
and the classifier, whose rows are classes and need no matching, is averaged per
class by how much of that class each client saw. Re-indexing runs on the devices
too, so it lives in :mod:`methods.fedma.device`.

Everything here is a pure function over tensors: no networking, no training.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor

from methods.fedma.device import FedMAError, client_slice, reindex_next_layer

__all__ = [
    "FedMAError",
    "Matching",
    "neuron_vectors",
    "layer_from_vectors",
    "prior_mean_vector",
    "match_layer",
    "reindex_next_layer",
    "client_slice",
    "combine_classifier",
]

POPULARITY_CAP = 10      # n_i counts at most this much in the popularity term, as in the reference
WEIGHT_PRIOR_MEAN = 0.0
BIAS_PRIOR_MEAN = 0.1


@dataclass(frozen=True)
class Matching:
    """One matched layer: the global neurons and where each client's neurons went."""

    global_vectors: Tensor       # (K, D): G_i / P_i, in the clients' (promoted) dtype
    assignments: list[Tensor]    # per client, int64 (J_k,): global index of each of its neurons, distinct
    counts: Tensor               # (K,) int64: n_i, how many client neurons each global neuron holds

    @property
    def width(self) -> int:
        return int(self.global_vectors.shape[0])


def neuron_vectors(weight: Tensor, bias: Tensor) -> Tensor:
    """A layer's neurons as rows, so that matching is the same for Linear and Conv2d layers."""
    if weight.dim() not in (2, 4):
        raise FedMAError(f"weight has shape {tuple(weight.shape)}: pass an nn.Linear weight (out, in) "
                         "or an nn.Conv2d weight (out, in, kh, kw)")
    if tuple(bias.shape) != (weight.shape[0],):
        raise FedMAError(f"bias has shape {tuple(bias.shape)} but the weight has {weight.shape[0]} neurons: "
                         "pass the same layer's bias (FedMA matches layers built with bias=True)")
    dtype = torch.promote_types(weight.dtype, bias.dtype)
    return torch.cat([weight.detach().reshape(weight.shape[0], -1).to(dtype),
                      bias.detach().reshape(-1, 1).to(dtype)], dim=1)


def layer_from_vectors(vectors: Tensor, weight_shape_tail: Sequence[int]) -> tuple[Tensor, Tensor]:
    """The inverse of :func:`neuron_vectors`; ``weight_shape_tail`` is ``(in,)`` or ``(in, kh, kw)``."""
    tail = tuple(int(s) for s in weight_shape_tail)
    if vectors.dim() != 2:
        raise FedMAError(f"vectors must be (neurons, D); got shape {tuple(vectors.shape)}")
    if vectors.shape[1] != math.prod(tail) + 1:
        raise FedMAError(f"vectors have D = {vectors.shape[1]} but a weight of tail {tail} plus a bias needs "
                         f"{math.prod(tail) + 1}: pass the tail of the layer the vectors came from, "
                         "with its input width already re-indexed to the global width")
    weight = vectors[:, :-1].reshape(vectors.shape[0], *tail).contiguous()
    return weight, vectors[:, -1].contiguous()


def prior_mean_vector(dim: int, bias_index: int | None = -1, *, weight_mean: float = WEIGHT_PRIOR_MEAN,
                      bias_mean: float = BIAS_PRIOR_MEAN) -> Tensor:
    """The prior mean mu0 per dimension: the reference centers weights at 0 and biases at 0.1."""
    if dim < 1:
        raise FedMAError(f"dim must be at least 1 (the vectors' length D); got {dim}")
    mean = torch.full((dim,), float(weight_mean), dtype=torch.float64)
    if bias_index is not None:
        if not -dim <= bias_index < dim:
            raise FedMAError(f"bias_index {bias_index} is outside vectors of length {dim}: use -1 for vectors "
                             "from neuron_vectors (bias last), or None when there is no bias")
        mean[bias_index] = float(bias_mean)
    return mean


def match_layer(client_vectors: Sequence[Tensor], *, sigma: float = 1.0, sigma0: float = 1.0,
                gamma: float = 7.0, prior_mean: Tensor | None = None, sweeps: int = 5,
                max_width: int | None = None, seed: int = 0) -> Matching:
    """Match one layer's neurons across clients by BBP-MAP (see the module docstring).

    ``prior_mean`` defaults to :func:`prior_mean_vector` with the bias last. ``max_width``
    caps the global width: once it is reached a client's neurons can only join existing
    global neurons. A global neuron left with no client when a client is taken out is
    dropped at once, as in the reference, so it holds no room under the cap while that
    client is matched again, and no sweep ends with an empty global neuron.
    """
    vectors = _checked_clients(client_vectors)
    clients, dim = len(vectors), vectors[0].shape[1]
    widest = max(len(v) for v in vectors)
    for name, value in (("sigma", sigma), ("sigma0", sigma0), ("gamma", gamma)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise FedMAError(f"{name} must be a positive finite number; got {value!r}")
    if not (isinstance(sweeps, int) and sweeps >= 0):
        raise FedMAError(f"sweeps must be a whole number >= 0; got {sweeps!r}")
    if max_width is not None and not (isinstance(max_width, int) and max_width >= widest):
        raise FedMAError(f"max_width {max_width!r} is below the widest client's {widest} neurons, which all "
                         f"need distinct global neurons: set max_width >= {widest}, or None for no cap")
    if prior_mean is None:
        mu0 = prior_mean_vector(dim).numpy()
    else:
        mu0 = prior_mean.detach().to(torch.float64).cpu().numpy()
        if mu0.shape != (dim,) or not np.isfinite(mu0).all():
            raise FedMAError(f"prior_mean must be a finite vector of length D = {dim}; got shape {mu0.shape}: "
                             "build it with prior_mean_vector(D)")

    p, p0 = 1.0 / sigma, 1.0 / sigma0
    scaled = [p * v for v in vectors]
    prior = p0 * mu0
    step = _Step(p=p, p0=p0, prior=prior, log_new=2.0 * math.log(gamma / clients), clients=clients,
                 max_width=max_width)

    order = sorted(range(clients), key=lambda k: -len(vectors[k]))   # stable: ties keep client order
    first = order[0]
    totals = prior + scaled[first]
    counts = np.ones(len(totals), dtype=np.int64)
    assignments: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * clients
    assignments[first] = np.arange(len(totals), dtype=np.int64)
    for k in order[1:]:
        totals, counts, assignments[k] = step.match(totals, counts, scaled[k])

    rng = np.random.default_rng(seed)
    for _ in range(sweeps):
        for k in map(int, rng.permutation(clients)):
            totals, counts = _take_out(totals, counts, assignments, k, scaled[k])
            totals, counts, assignments[k] = step.match(totals, counts, scaled[k])

    dtype = _common_dtype(client_vectors)
    globals_ = totals / (p0 + counts * p)[:, None]
    return Matching(global_vectors=torch.from_numpy(globals_).to(dtype),
                    assignments=[torch.from_numpy(a.copy()) for a in assignments],
                    counts=torch.from_numpy(counts.copy()))


@dataclass(frozen=True)
class _Step:
    """The fixed quantities of one match_layer call, and matching one client against the global layer."""

    p: float
    p0: float
    prior: np.ndarray           # p0 mu0, (D,)
    log_new: float              # 2 log(gamma / J)
    clients: int
    max_width: int | None

    def match(self, totals: np.ndarray, counts: np.ndarray,
              scaled: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Assign one client's neurons (``scaled`` = p w) and add them into G and n."""
        width, own = len(totals), len(scaled)
        precisions = self.p0 + counts * self.p
        sq_own = np.einsum("ld,ld->l", scaled, scaled)
        sq_totals = np.einsum("kd,kd->k", totals, totals)
        popular = np.minimum(counts, POPULARITY_CAP)
        join = ((sq_own[:, None] + 2.0 * (scaled @ totals.T) + sq_totals[None, :]) / (self.p + precisions)
                - sq_totals / precisions + np.log(popular / (self.clients - popular)))
        room = own if self.max_width is None else min(own, self.max_width - width)
        fresh = ((np.einsum("ld,ld->l", scaled + self.prior, scaled + self.prior) / (self.p0 + self.p)
                  - float(self.prior @ self.prior) / self.p0 + self.log_new)[:, None]
                 - 2.0 * np.log(np.arange(1, room + 1, dtype=np.float64))[None, :])
        rows, cols = linear_sum_assignment(-np.hstack([join, fresh]))
        assignment = np.empty(own, dtype=np.int64)
        assignment[rows] = cols
        opened = assignment >= width
        joined = ~opened
        assignment[opened] = width + np.arange(int(opened.sum()))
        totals = totals.copy()
        counts = counts.copy()
        totals[assignment[joined]] += scaled[joined]
        counts[assignment[joined]] += 1
        totals = np.vstack([totals, self.prior + scaled[opened]])
        counts = np.concatenate([counts, np.ones(int(opened.sum()), dtype=np.int64)])
        return totals, counts, assignment


def _take_out(totals: np.ndarray, counts: np.ndarray, assignments: list[np.ndarray], client: int,
              scaled: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Remove one client's neurons from G and n, dropping global neurons nobody holds any more."""
    own = assignments[client]
    totals = totals.copy()
    counts = counts.copy()
    totals[own] -= scaled
    counts[own] -= 1
    keep = counts > 0
    if keep.all():
        return totals, counts
    renumber = np.cumsum(keep) - 1
    for k, assignment in enumerate(assignments):
        if k != client:
            assignments[k] = renumber[assignment]
    return totals[keep], counts[keep]


def _checked_clients(client_vectors: Sequence[Tensor]) -> list[np.ndarray]:
    if len(client_vectors) == 0:
        raise FedMAError("match_layer needs the layer of at least one client; got an empty list")
    arrays = []
    for k, vectors in enumerate(client_vectors):
        if not isinstance(vectors, Tensor) or vectors.dim() != 2 or vectors.shape[0] == 0:
            shape = tuple(vectors.shape) if isinstance(vectors, Tensor) else type(vectors).__name__
            raise FedMAError(f"client {k}'s vectors must be a non-empty (neurons, D) tensor; got {shape}: "
                             "build them with neuron_vectors(weight, bias)")
        if not vectors.is_floating_point():
            raise FedMAError(f"client {k}'s vectors have dtype {vectors.dtype}: pass floating-point weights")
        if vectors.shape[1] != client_vectors[0].shape[1]:
            raise FedMAError(f"client {k}'s neurons have D = {vectors.shape[1]} but client 0's have "
                             f"D = {client_vectors[0].shape[1]}: every client must send the same layer, "
                             "its inputs re-indexed to the previous layer's global width (reindex_next_layer)")
        array = vectors.detach().to(torch.float64).cpu().numpy()
        if not np.isfinite(array).all():
            raise FedMAError(f"client {k}'s vectors contain NaN or infinity: leave that client out of the matching")
        arrays.append(array)
    return arrays


def _common_dtype(tensors: Sequence[Tensor]) -> torch.dtype:
    dtype = tensors[0].dtype
    for tensor in tensors[1:]:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def combine_classifier(weights: Sequence[Tensor], biases: Sequence[Tensor],
                       class_counts: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Average the classifier per class, row c weighted by n_kc / sum_j n_jc.

    A client that never saw class c has an untrained row c, so it should not pull
    the average; a class no client saw falls back to the plain mean.
    """
    if not (len(weights) == len(biases) == len(class_counts)) or not weights:
        raise FedMAError(f"pass one weight, bias and class-count tensor per client (at least one client); got "
                         f"{len(weights)} weights, {len(biases)} biases, {len(class_counts)} class counts")
    shape = tuple(weights[0].shape)
    if len(shape) != 2:
        raise FedMAError(f"classifier weights must be (classes, inputs); client 0's has shape {shape}")
    for k, (weight, bias, count) in enumerate(zip(weights, biases, class_counts)):
        if tuple(weight.shape) != shape:
            raise FedMAError(f"client {k}'s classifier weight has shape {tuple(weight.shape)}, client 0's {shape}: "
                             "re-index every client's classifier to the global width with reindex_next_layer first")
        if tuple(bias.shape) != shape[:1] or tuple(count.shape) != shape[:1]:
            raise FedMAError(f"client {k}'s bias and class counts must have one entry per class ({shape[0]}); "
                             f"got {tuple(bias.shape)} and {tuple(count.shape)}")
    counts = torch.stack([c.detach().to(torch.float64) for c in class_counts])     # (clients, classes)
    if not torch.isfinite(counts).all() or (counts < 0).any():
        raise FedMAError("class counts must be finite and >= 0 (each client's samples per class)")
    totals = counts.sum(dim=0)
    shares = torch.where(totals > 0, counts / totals.clamp_min(1e-300), torch.full_like(counts, 1.0 / len(weights)))
    dtype = _common_dtype(list(weights))
    weight = torch.einsum("kc,kci->ci", shares, torch.stack([w.detach().to(torch.float64) for w in weights]))
    bias = (shares * torch.stack([b.detach().to(torch.float64) for b in biases])).sum(dim=0)
    return weight.to(dtype), bias.to(dtype)
