"""DFL's client model: an invariant and a specific extractor side by side, a predictor on both.

The network ``dfl`` that DFL's model hook :data:`HOOK` adds (``{"name": "dfl", "backbone": "cnn", ...}``);
any backbone of :mod:`edge_client.models` works, through its ``features`` (the extractor)
and the input size of its ``classifier`` (the representation size). Parameter names say which
branch a tensor belongs to, which is all the protocol and the strategy need:

- ``invariant.*``: the backbone's extractor; the only part that is ever aggregated.
- ``specific.*``: the same backbone at ``specific_width`` times its width; stays on the device.
- ``predictor.*``: one linear layer on ``[invariant(x); specific(x)]``; stays on the device.
- ``mi.spe.*``, ``mi.glob.*``: critics (:class:`PairCritic`) estimating MI(invariant; specific)
  and MI(invariant; global invariant) (:mod:`methods.dfl.device`); stay on the device.
- ``peers.K.*`` (``peers = M > 0``): slots for M other clients' specific extractors,
  filled by diversity transferring; never trained, never saved.

Options of the backbone (``norm``, ``pan``, ...) apply to both extractors.

The critics estimate mutual information between two representations with the Jensen-Shannon
lower bound (Deep InfoMax, :func:`jsd_mutual_information`).

A small critic ``T(a, b)`` scores pairs of representations. Joint pairs come from
the same sample; marginal pairs pair each ``a`` with the ``b`` of another sample of
the batch (a shuffle). The bound

    MI_JSD(a; b) = E_joint[log 2 - softplus(-T(a, b))] - E_marginal[softplus(T(a, b')) - log 2]

is high when the critic can tell joint pairs from shuffled ones, i.e. when ``a`` and
``b`` share information, and near zero when they are independent. The critic is
always trained to raise the bound (a tighter estimate); a method that wants two
representations to share information raises it with its extractors too, one that
wants them disentangled lowers it (:func:`mi_penalty`).

**fedge choice**: the critic sees both representations standardized over the batch
(each feature centred and divided by its spread plus ``STANDARDIZE_EPS``). An
extractor that lowers the bound could otherwise drive it to minus infinity by
inflating its features until the critic's scores explode (seen within one epoch on
Fashion-MNIST); standardized, a feature's scale carries nothing. Centring matters
as much: extractor features share a large common component (cosine similarity
between different samples around 0.9), and a critic that sees it (raw or
L2-normalized features) learned nothing in 75 steps where one on standardized
features reached an estimate of 0.7. The ``STANDARDIZE_EPS`` floor keeps a nearly
constant feature from receiving gradients a thousand times larger than the others.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from edge_client.models import MODELS, ModelHook, ModelSpecError

__all__ = ["TwoBranchModel", "PairCritic", "two_branch", "INVARIANT", "SPECIFIC", "PREDICTOR", "CRITICS", "PEERS",
           "DEVICE_PARTS", "STANDARDIZE_EPS", "part_names", "jsd_mutual_information", "mi_penalty", "HOOK"]

INVARIANT, SPECIFIC, PREDICTOR, CRITICS, PEERS = "invariant", "specific", "predictor", "mi", "peers"
DEVICE_PARTS = (SPECIFIC, PREDICTOR, CRITICS)   # what never leaves the device (without diversity)
STANDARDIZE_EPS = 1e-2   # added to each feature's batch standard deviation
_LOG2 = math.log(2.0)
Build = Callable[[Mapping[str, Any]], nn.Module]


class PairCritic(nn.Module):
    """``T(a, b)``: an MLP on the concatenated pair, each side standardized over the batch; one score per pair."""

    def __init__(self, dim_a: int, dim_b: int, hidden: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim_a + dim_b, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        pair = [_standardize(a.flatten(1)), _standardize(b.flatten(1))]
        return self.net(torch.cat(pair, dim=1)).squeeze(1)


def _standardize(x: torch.Tensor) -> torch.Tensor:
    """Each feature centred and scaled over the batch (a feature constant in the batch becomes 0)."""
    if len(x) < 2:
        return torch.zeros_like(x)
    return (x - x.mean(0)) / (x.std(0) + STANDARDIZE_EPS)


def jsd_mutual_information(critic: PairCritic, a: torch.Tensor, b: torch.Tensor,
                           generator: torch.Generator | None = None) -> torch.Tensor:
    """The Jensen-Shannon MI estimate of a batch of pairs (a scalar; differentiable in all inputs).

    A batch of one sample has no other sample to pair with: its estimate is 0.
    """
    if len(a) != len(b):
        raise ValueError(f"pairs need as many a's as b's, got {len(a)} and {len(b)}")
    if len(a) < 2:
        return a.new_zeros(())
    shuffled = b[torch.randperm(len(b), generator=generator).to(b.device)]
    joint = critic(a, b)
    marginal = critic(a, shuffled)
    return (_LOG2 - F.softplus(-joint)).mean() - (F.softplus(marginal) - _LOG2).mean()


def mi_penalty(estimate: torch.Tensor) -> torch.Tensor:
    """What an extractor minimizes to disentangle: the estimate, floored at 0.

    Mutual information is never negative; a negative estimate only says the critic is
    fooled for now, so pushing it further down teaches the extractor nothing.
    """
    return estimate.clamp(min=0.0)


class TwoBranchModel(nn.Module):
    """``predictor([invariant(x); specific(x)])``, plus the critics and peer slots DFL trains with."""

    def __init__(self, invariant: nn.Module, specific: nn.Module, peers: list[nn.Module], dims: tuple[int, int],
                 num_classes: int, mi_hidden: int) -> None:
        super().__init__()
        d_inv, d_spe = dims
        self.invariant = invariant
        self.specific = specific
        self.predictor = nn.Linear(d_inv + d_spe, num_classes)
        self.mi = nn.ModuleDict({"spe": PairCritic(d_inv, d_spe, mi_hidden),
                                 "glob": PairCritic(d_inv, d_inv, mi_hidden)})
        self.peers = nn.ModuleList(peers)

    def predict(self, inv: torch.Tensor, spe: torch.Tensor) -> torch.Tensor:
        return self.predictor(torch.cat([inv, spe], dim=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.predict(self.invariant(x), self.specific(x))


def _extractor(spec: dict[str, Any], build: Build) -> tuple[nn.Module, int]:
    model = build(spec)
    features, classifier = getattr(model, "features", None), getattr(model, "classifier", None)
    if features is None or not isinstance(classifier, nn.Linear):
        raise ModelSpecError(f"dfl needs a backbone with .features and a linear .classifier; "
                             f"{spec['name']!r} has not")
    return features, classifier.in_features


def two_branch(num_classes: int, in_channels: int, image_size: int, build: Build, backbone: str = "cnn",
               specific_width: float = 1.0, mi_hidden: int = 128, peers: int = 0,
               **options: Any) -> TwoBranchModel:
    """The DFL model over ``backbone``, whose specs ``build`` builds; ``options`` are the backbone's own
    (norm, width, the options of other methods' model hooks, ...)."""
    if backbone not in MODELS:
        raise ModelSpecError(f"dfl backbone must be one of {', '.join(sorted(MODELS))}, "
                             f"got {backbone!r}")
    if isinstance(specific_width, bool) or not isinstance(specific_width, (int, float)) or specific_width <= 0:
        raise ModelSpecError(f"dfl specific_width must be a positive number, got {specific_width!r}")
    for key, value, low in (("mi_hidden", mi_hidden, 1), ("peers", peers, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ModelSpecError(f"dfl {key} must be an integer >= {low}, got {value!r}")
    base = {"name": backbone, "num_classes": num_classes, "in_channels": in_channels, "image_size": image_size,
            **options}
    specific_spec = {**base, "width": float(options.get("width", 1.0)) * specific_width}
    invariant, d_inv = _extractor(base, build)
    specific, d_spe = _extractor(specific_spec, build)
    peer_branches = [_extractor(specific_spec, build)[0] for _ in range(peers)]
    return TwoBranchModel(invariant, specific, peer_branches, (d_inv, d_spe), num_classes, mi_hidden)


def part_names(names: Iterable[str], *parts: str) -> list[str]:
    """The names (sorted) that belong to any of ``parts`` (``invariant``, ``specific``, ...)."""
    prefixes = tuple(p + "." for p in parts)
    return sorted(n for n in names if n.startswith(prefixes))


HOOK = ModelHook(networks={"dfl": two_branch})
