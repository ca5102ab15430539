"""Mutual information between two representations: the Jensen-Shannon lower bound (Deep InfoMax).

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

import torch
import torch.nn.functional as F

from methods.dfl.model import PairCritic

__all__ = ["jsd_mutual_information", "mi_penalty"]

_LOG2 = math.log(2.0)


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
