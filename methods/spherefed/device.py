"""SphereFed with Fast Federated Calibration (FFC): the device's side and the algebra both sides share.

SphereFed trains only the feature extractor. Features are L2-normalized onto the
unit sphere and scored by a fixed classifier with orthonormal rows that every party
rebuilds from a seed, so it is never trained and never sent; the local loss is the
squared error between the scores and the one-hot label. After training, FFC
replaces the fixed classifier by the least-squares one on all clients' features,
from sums each client sends once: ``G = sum z z^T``, ``B = sum z y^T`` and ``n``.
Sums are associative, so the coordinator gets the centralized least-squares
solution exactly, without seeing a feature or a label.

The same statistics calibrate a model trained with cross-entropy and a plain linear head
(FedAvg + FFC, ``run.strategy = "fedavg_ffc"``): ``ffc_stats`` then reads the L2-normalized
features of its extractor just the same, and the coordinator puts the solved classifier into a
sphere head in place of the trained linear one (:mod:`methods.spherefed.strategy`).

With ``personalize``, each device also solves the same closed form on its own
sums and keeps that classifier in its state directory
(``STATE_DIR/sphere_classifier.safetensors``, :data:`PERSONAL_CLASSIFIER_FILE`); it
never travels. ``fedge-export RUN_DIR --client-state STATE_DIR`` puts it on the
run's extractor (:mod:`methods.spherefed.export`).

Here: the objectives ``sphere_train`` and ``ffc_stats`` and :class:`FfcStats`
(packing, summing, the Cholesky solve), which the coordinator's strategy
(:mod:`methods.spherefed.strategy`) uses too. The head itself (:class:`SphereHead`,
put on any registry model by the spec's ``head = "sphere"``) is in
:mod:`methods.spherefed.model`, so building a model never imports training code.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from methods.spherefed.model import CLASSIFIER, SphereError, SphereHead
from edge_client.objectives import LocalData, Objective, ObjectiveError, ObjectiveOutput, TaskContext, train
from edge_client.privacy import clip_update
from storage.files import write_tensors_atomic

__all__ = [
    "STAT_NAMES", "WIRE_DTYPES", "WIRE_CODECS", "FALLBACK_RIDGE", "PERSONAL_CLASSIFIER_FILE", "PERSONAL_METADATA",
    "OBJECTIVES", "Calibration", "FfcStats", "FfcHyper", "sphere_head", "head_shape", "sphere_loss",
    "sphere_accuracies",
    "packed_size", "pack_upper", "unpack_upper", "wire_shapes", "wire_numbers", "solve_classifier",
    "feature_stats", "save_personal_classifier", "sphere_train", "ffc_stats", "BOUNDED_NAMES", "clip_stats",
    "floor_eigenvalues", "noise_floor",
]

log = logging.getLogger("fedge.sphere")

STAT_NAMES = ("ffc.gram", "ffc.cross", "ffc.count")   # what an ffc_stats result carries, nothing else
WIRE_DTYPES = {"float64": torch.float64, "float32": torch.float32}
WIRE_CODECS = {"float64": "fp64", "float32": "fp32"}   # the upload codec that carries each exactly
# When G is singular, the ridge used instead of 0, relative to G's mean eigenvalue trace(G) / d.
FALLBACK_RIDGE = 1e-6
# With ffc.personalize: the device's own classifier (float32 [C, d] under CLASSIFIER), in its state directory.
PERSONAL_CLASSIFIER_FILE = "sphere_classifier.safetensors"
PERSONAL_METADATA = "fedge"   # its safetensors metadata key: JSON with ridge, round, dim, classes, ...


def sphere_head(model: nn.Module) -> SphereHead:
    head = getattr(model, "classifier", None)
    if not isinstance(head, SphereHead):
        raise ObjectiveError("this task needs a model with head = sphere; set model.head = \"sphere\"")
    return head


def head_shape(model: nn.Module) -> tuple[int, int]:
    """(d, C) of the model's last layer, a sphere head or a plain linear one: FFC calibrates either
    (a linear head's model is FedAvg + FFC's, whose classifier the coordinator replaces)."""
    head = getattr(model, "classifier", None)
    if isinstance(head, SphereHead):
        return head.in_features, head.out_features
    if type(head) is nn.Linear:
        return head.in_features, head.out_features
    raise ObjectiveError("FFC needs a model whose last layer `classifier` is the sphere head or a plain linear "
                         f"layer, got {type(head).__name__}; set model.head to \"sphere\" or \"linear\" and remove "
                         "the model option that replaced the last layer")


def sphere_loss(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Squared distance between the scores and the one-hot label, summed over classes, mean over samples.

    MSE rather than cross-entropy: scores of unit features on orthonormal rows are
    bounded by 1, so cross-entropy would need a temperature (the paper's argument).
    """
    onehot = F.one_hot(labels, scores.shape[1]).to(scores.dtype)
    return ((scores - onehot) ** 2).sum(dim=1).mean()


@torch.no_grad()
def _features(model: nn.Module, x: torch.Tensor, batch_size: int) -> Iterable[tuple[slice, torch.Tensor]]:
    """Unit features in float64 on the CPU (where statistics and classifiers live, whatever device the
    model is on), batch by batch, with the extractor in eval mode."""
    model.eval()
    for start in range(0, len(x), batch_size):
        h = model.features(x[start:start + batch_size]).flatten(1)
        yield slice(start, start + batch_size), F.normalize(h.to(torch.float64), dim=1).cpu()


def sphere_accuracies(model: nn.Module, x: torch.Tensor, y: torch.Tensor, classifiers: Sequence[torch.Tensor],
                      batch_size: int = 1024) -> list[float]:
    """Accuracy on (x, y) of each ``[C, d]`` classifier on the model's unit features (one pass)."""
    correct = [0] * len(classifiers)
    weights = [w.to(torch.float64).cpu() for w in classifiers]
    y = y.cpu()
    for rows, z in _features(model, x, batch_size):
        for i, w in enumerate(weights):
            correct[i] += int(((z @ w.t()).argmax(1) == y[rows]).sum())
    return [c / max(len(y), 1) for c in correct]


# ----------------------------------------------------------------------------- FFC statistics


def packed_size(d: int) -> int:
    """Numbers in the packed upper triangle (diagonal included) of a symmetric d x d matrix."""
    return d * (d + 1) // 2


def pack_upper(m: torch.Tensor) -> torch.Tensor:
    """The upper triangle of a symmetric matrix, row by row, as a 1-D tensor (half the bytes)."""
    if m.dim() != 2 or m.shape[0] != m.shape[1]:
        raise SphereError(f"pack_upper needs a square matrix, got shape {tuple(m.shape)}")
    i, j = torch.triu_indices(m.shape[0], m.shape[0])
    return m[i, j].contiguous()


def unpack_upper(packed: torch.Tensor, d: int) -> torch.Tensor:
    """The symmetric d x d matrix whose packed upper triangle is ``packed``."""
    if tuple(packed.shape) != (packed_size(d),):
        raise SphereError(f"a packed {d} x {d} symmetric matrix has {packed_size(d)} numbers, "
                          f"got shape {tuple(packed.shape)}")
    i, j = torch.triu_indices(d, d)
    m = torch.zeros(d, d, dtype=packed.dtype)
    m[i, j] = packed
    m[j, i] = packed
    return m


def wire_shapes(d: int, num_classes: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the tensors of an ffc_stats result: packed G, B, n."""
    return {"ffc.gram": (packed_size(d),), "ffc.cross": (d, num_classes), "ffc.count": (1,)}


def wire_numbers(d: int, num_classes: int) -> int:
    """Numbers in one client's FFC statistics: d(d+1)/2 + dC + 1."""
    return packed_size(d) + d * num_classes + 1


@dataclass(frozen=True)
class Calibration:
    """The solved classifier and how it was solved."""

    weight: torch.Tensor    # [C, d] float64
    ridge: float            # the lambda actually used
    rank: int               # numerical rank of G
    singular: bool          # G was singular, so ``ridge`` is the fallback rather than the requested one


def solve_classifier(gram: torch.Tensor, cross: torch.Tensor, ridge: float = 0.0, *,
                     precision: torch.dtype = torch.float64, level: int = logging.WARNING) -> Calibration:
    """``W^T = (G + ridge I)^-1 B`` by a Cholesky factorization in float64.

    With ``ridge = 0`` and G singular (numerically rank-deficient: an eigenvalue at
    most d * eps * the largest, NumPy's matrix_rank rule, with the eps of the
    ``precision`` the sums travelled in) there is no unique solution; a small ridge
    (FALLBACK_RIDGE times G's mean eigenvalue, and above that rounding level) is
    used instead and logged (at ``level``: a device's own small G is expected to
    be singular).
    """
    d = gram.shape[0]
    g = gram.to(torch.float64)
    eig = torch.linalg.eigvalsh(g)
    top = float(eig[-1]) if d else 0.0
    tol = max(top, 0.0) * d * torch.finfo(precision).eps
    if d and float(eig[0]) < -tol:   # a sum of z z^T has no negative eigenvalue beyond rounding
        raise SphereError(f"the FFC statistics are not a Gram matrix (eigenvalue {float(eig[0]):.3g} < 0); "
                          "a client sent sums that no features produce")
    rank = int((eig > tol).sum())
    singular = ridge == 0 and rank < d
    used = float(ridge)
    if singular:
        used = max(FALLBACK_RIDGE * float(torch.trace(g)) / max(d, 1), tol, 1e-12)
        log.log(level, "FFC: the Gram matrix G is singular (numerical rank %d of %d), so ridge 0 has no unique "
                "solution; solving with ridge %.3g instead (set ffc.ridge > 0 to choose it)", rank, d, used)
    eye = torch.eye(d, dtype=torch.float64)
    for _ in range(4):   # rounding can leave a nearly singular G + ridge I not quite positive definite
        chol, info = torch.linalg.cholesky_ex(g + used * eye)
        if int(info) == 0:
            break
        used = max(used * 10, FALLBACK_RIDGE)
        log.warning("FFC: G + ridge I is not positive definite in float64; retrying with ridge %.3g", used)
    else:
        raise SphereError(f"FFC could not factor G + ridge I even with ridge {used:.3g}; set a larger ffc.ridge")
    return Calibration(torch.cholesky_solve(cross.to(torch.float64), chol).t().contiguous(), used, rank, singular)


@dataclass(frozen=True)
class FfcStats:
    """One client's (or a sum of clients') FFC statistics, in float64."""

    gram: torch.Tensor    # [d, d], sum of z z^T
    cross: torch.Tensor   # [d, C], sum of z y^T (y one-hot)
    count: int            # n

    @classmethod
    def zeros(cls, d: int, num_classes: int) -> "FfcStats":
        return cls(torch.zeros(d, d, dtype=torch.float64), torch.zeros(d, num_classes, dtype=torch.float64), 0)

    def __add__(self, other: "FfcStats") -> "FfcStats":
        if self.gram.shape != other.gram.shape or self.cross.shape != other.cross.shape:
            raise SphereError(f"cannot add FFC statistics of shapes {tuple(self.cross.shape)} and "
                              f"{tuple(other.cross.shape)}; all clients must run the same model")
        return FfcStats(self.gram + other.gram, self.cross + other.cross, self.count + other.count)

    @staticmethod
    def reduce(parts: Iterable["FfcStats"]) -> "FfcStats":
        total: FfcStats | None = None
        for part in parts:
            total = part if total is None else total + part
        if total is None:
            raise SphereError("no FFC statistics to sum")
        return total

    def to_wire(self, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
        """Packed G, B and n: d(d+1)/2 + dC + 1 numbers in ``dtype``."""
        return {"ffc.gram": pack_upper(self.gram).to(dtype), "ffc.cross": self.cross.to(dtype).contiguous(),
                "ffc.count": torch.tensor([float(self.count)], dtype=dtype)}

    @classmethod
    def from_wire(cls, tensors: Mapping[str, torch.Tensor], d: int, num_classes: int) -> "FfcStats":
        """Statistics from a result's tensors (names and shapes checked), summed in float64 from here on."""
        shapes = wire_shapes(d, num_classes)
        if set(tensors) != set(shapes):
            raise SphereError(f"FFC statistics are {sorted(shapes)}, got {sorted(tensors)}")
        for name, shape in shapes.items():
            if tuple(tensors[name].shape) != shape:
                raise SphereError(f"{name} has shape {tuple(tensors[name].shape)}, expected {shape}")
        count = float(tensors["ffc.count"][0])
        if not (math.isfinite(count) and count >= 1 and count == int(count)):
            raise SphereError(f"ffc.count must be a positive whole number of samples, got {count}")
        return cls(unpack_upper(tensors["ffc.gram"].to(torch.float64), d), tensors["ffc.cross"].to(torch.float64),
                   int(count))

    def solve(self, ridge: float = 0.0, *, precision: torch.dtype = torch.float64,
              level: int = logging.WARNING) -> Calibration:
        return solve_classifier(self.gram, self.cross, ridge, precision=precision, level=level)


BOUNDED_NAMES = ("ffc.gram", "ffc.cross")   # what central DP bounds and noises; the count enters no solve


def clip_stats(wire: Mapping[str, torch.Tensor], bound: float) -> tuple[dict[str, torch.Tensor], bool]:
    """Wire statistics with packed G and B scaled, by one factor, to an L2 norm of at most ``bound``
    (all their numbers as one vector; :func:`edge_client.privacy.clip_update`), and whether they were.

    One factor for both keeps the device's least-squares problem what it was, each of its samples
    weighted by the factor; G and B scaled apart would tilt its solution. The packed triangle (what
    travels and what the coordinator's noise covers) counts an off-diagonal entry once. The count
    is left as it is: no solve reads it (the coordinator checks it against ``num_samples``).
    """
    bounded, clipped = clip_update({k: wire[k] for k in BOUNDED_NAMES}, bound)
    return {**wire, **bounded}, clipped


def floor_eigenvalues(gram: torch.Tensor, floor: float) -> torch.Tensor:
    """The symmetric matrix ``gram`` with every eigenvalue raised to at least ``floor`` (float64).

    A noisy Gram matrix is symmetric but may be indefinite, and its small eigenvalues are the noise's;
    raising them to the noise's scale makes the solve well posed. Post-processing: it costs no privacy.
    """
    if not (floor >= 0 and math.isfinite(floor)):
        raise SphereError(f"the eigenvalue floor must be a finite number >= 0, got {floor}")
    eig, vec = torch.linalg.eigh(gram.to(torch.float64))
    return (vec * eig.clamp(min=floor)) @ vec.t()


def noise_floor(noise_std: float, d: int) -> float:
    """2 sigma sqrt(d): about the spectral norm of a symmetric d x d matrix of N(0, sigma^2) entries (the
    semicircle law's edge), so the eigenvalues of a noisy G below it say nothing the noise does not."""
    return 2.0 * noise_std * math.sqrt(d)


def feature_stats(model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int,
                  batch_size: int = 256) -> FfcStats:
    """G, B and n over (x, y) with the model's extractor (eval mode), accumulated in float64."""
    dim, _ = head_shape(model)
    y = y.cpu()
    total = FfcStats.zeros(dim, num_classes)
    gram, cross = total.gram, total.cross
    for rows, z in _features(model, x, batch_size):
        gram += z.t() @ z
        cross += z.t() @ F.one_hot(y[rows], num_classes).to(torch.float64)
    return FfcStats(gram, cross, len(y))


def save_personal_classifier(state_dir: Path, own: Calibration, *, round: int, client_id: str,
                             samples: int) -> Path:
    """Keep a device's own classifier in ``state_dir/PERSONAL_CLASSIFIER_FILE``, written atomically.

    The weight is float32 ``[C, d]`` under ``CLASSIFIER``; the metadata says how it was
    solved and for which model (``dim`` = d, ``classes`` = C), so an export can check it.
    """
    classes, dim = own.weight.shape
    info = {"round": int(round), "client_id": client_id, "ridge": own.ridge, "rank": own.rank,
            "singular": own.singular, "samples": int(samples), "dim": int(dim), "classes": int(classes)}
    path = Path(state_dir) / PERSONAL_CLASSIFIER_FILE
    write_tensors_atomic(path, {CLASSIFIER: own.weight.to(torch.float32)}, {PERSONAL_METADATA: json.dumps(info)})
    return path


# ----------------------------------------------------------------------------- objectives


def sphere_train(model: nn.Module, data: LocalData, hyper: Mapping[str, Any], ctx: TaskContext) -> ObjectiveOutput:
    """Local SphereFed training: the usual local SGD (FedProx's ``mu`` included), squared-error loss,
    against the fixed classifier whatever the model last received."""
    sphere_head(model).reset()
    return train(model, data, hyper, ctx, criterion=sphere_loss)


@dataclass(frozen=True)
class FfcHyper:
    dtype: str = "float64"       # on the wire: float64 or float32
    personalize: bool = False    # also solve this client's own classifier (kept in the state dir, scored locally)
    ridge: float = 0.0           # lambda of that personal solve
    batch_size: int = 256
    # Central DP (ffc.clip): G (packed) and B, as one vector, scaled to this L2 norm at most before they
    # are sent. None: sent as they are.
    clip: float | None = None

    @classmethod
    def from_dict(cls, hyper: Mapping[str, Any]) -> "FfcHyper":
        unknown = sorted(set(hyper) - set(cls.__dataclass_fields__))
        if unknown:
            raise ObjectiveError(f"unknown ffc_stats hyperparameters {unknown}; known: "
                                 f"{sorted(cls.__dataclass_fields__)}")
        h = cls(**hyper)
        clip_ok = h.clip is None or (isinstance(h.clip, (int, float)) and not isinstance(h.clip, bool)
                                     and math.isfinite(h.clip) and h.clip > 0)
        if h.dtype not in WIRE_DTYPES or not isinstance(h.personalize, bool) or not h.ridge >= 0 \
                or not math.isfinite(h.ridge) or h.batch_size < 1 or not clip_ok:
            raise ObjectiveError(f"invalid ffc_stats hyperparameters {dict(hyper)!r}: dtype is one of "
                                 f"{', '.join(WIRE_DTYPES)}, ridge >= 0, batch_size >= 1, clip a positive number")
        return h


def ffc_stats(model: nn.Module, data: LocalData, hyper: Mapping[str, Any], ctx: TaskContext) -> ObjectiveOutput:
    """FFC statistics of this device's whole training split with the received extractor.

    The extractor's features are L2-normalized whatever the model's head (a plain linear
    head's model is calibrated onto a sphere head by the coordinator), so the statistics
    are the same algebra for SphereFed and FedAvg + FFC. Only G (packed), B and n leave
    the device. With ``personalize`` (sphere head only) the device also solves its own
    classifier from its G and B, keeps it in its state directory (when it has one;
    :func:`save_personal_classifier`, never sent) and reports its accuracy on the held-out
    split, next to the fixed classifier's.
    """
    h = FfcHyper.from_dict(hyper)
    if len(data) == 0:
        raise ObjectiveError("FFC needs local training samples and this device has none; it cannot contribute "
                             "statistics (the coordinator calibrates from the other clients)")
    _, classes = head_shape(model)
    # personalization scores the fixed classifier too, which only the sphere head has
    head = sphere_head(model) if h.personalize else None
    if isinstance(model.classifier, SphereHead):
        model.classifier.reset()
    started = time.perf_counter()
    stats = feature_stats(model, data.x, data.y, classes, h.batch_size)
    metrics: dict[str, float] = {"ffc_seconds": time.perf_counter() - started}
    if head is not None and (data.num_test or ctx.state_dir is not None):
        started = time.perf_counter()
        own = stats.solve(h.ridge, level=logging.INFO)
        if ctx.state_dir is not None:
            save_personal_classifier(ctx.state_dir, own, round=ctx.round, client_id=ctx.client_id,
                                     samples=stats.count)
        if data.num_test:
            fixed_acc, own_acc = sphere_accuracies(model, data.x_test, data.y_test, [head.fixed, own.weight])
            metrics.update(ffc_local_accuracy=own_acc, ffc_local_accuracy_fixed=fixed_acc)
        metrics.update(ffc_local_ridge=own.ridge, ffc_personalize_seconds=time.perf_counter() - started)
    wire = stats.to_wire(WIRE_DTYPES[h.dtype])
    if h.clip is not None:
        wire, clipped = clip_stats(wire, h.clip)
        metrics["ffc_clipped"] = float(clipped)
    return ObjectiveOutput(num_samples=len(data), metrics=metrics, tensors=wire)


OBJECTIVES: dict[str, Objective] = {"sphere_train": sphere_train, "ffc_stats": ffc_stats}
