"""Central differential privacy: the coordinator's noise, the adaptive clip norm and the privacy account.

What is protected is one device's whole contribution to a round (client-level DP, McMahan et al.
2018, "Learning Differentially Private Recurrent Language Models"): each device clips its update to
the L2 norm C (:mod:`edge_client.privacy`), every accepted update weighs the same, the sum gets
Gaussian noise of std z x C once, and it is divided by the number of devices selected per round,
a fixed denominator, so that a device's presence moves the released mean by at most C / m whether
or not the others answered. The account is ``dp_accounting``'s RDP accountant over one Poisson-
sampled Gaussian mechanism per round; no formula of it is written here.

With ``adaptive_clip`` the clip norm follows a quantile of the update norms (Andrew et al. 2021,
"Differentially Private Learning with Adaptive Clipping"): each device reports one bit (was its
update clipped), the coordinator counts the bits with noise and takes a geometric step. The count
is a second release; its noise is folded into the multiplier the account uses.

The functions are pure (noise comes from the generator they are given); :class:`CentralPrivacy`
holds a run's settings. The clip norm and the rounds accounted live in ``ServerState.extra``, so a
resumed run continues both.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from coordinator.strategies.base import ClientResult, WeightedSum
from storage.state import ServerState

if TYPE_CHECKING:
    from coordinator.config import RunConfig

__all__ = ["CentralPrivacy", "AdaptiveClip", "noisy_mean", "adapted_clip_norm", "accounted_noise_multiplier",
           "epsilon_after", "noise_for_epsilon", "fresh_generator", "clipped_count"]

class _QuietOrders(logging.Filter):
    """dp_accounting warns (through absl) for every fractional RDP order whose series does not converge, and
    leaves that order out of the minimum: nothing is wrong, and it would say so on every round."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


logging.getLogger("absl").addFilter(_QuietOrders())

EXTRA_KEY = "privacy"   # ServerState.extra[EXTRA_KEY] = {"clip_norm": C, "rounds": rounds accounted}


def fresh_generator() -> torch.Generator:
    """A generator seeded from the operating system's entropy: noise that anyone knowing ``run.seed``
    (it is in config.toml) could regenerate would protect nothing."""
    return torch.Generator().manual_seed(secrets.randbits(63))


def noisy_mean(total: WeightedSum, noise_std: float, denominator: int,
               generator: torch.Generator) -> dict[str, torch.Tensor]:
    """(sum + N(0, noise_std^2) per coordinate) / denominator, float64: the released mean update.

    ``total`` is the fold of the accepted updates, each of weight 1, so ``total.sums`` is their sum
    (from this process alone or merged from aggregation workers' partial sums): the noise is added
    here once, whoever folded.
    """
    if denominator < 1:
        raise ValueError(f"the denominator is the number of devices selected per round, at least 1; got {denominator}")
    if not (noise_std >= 0 and math.isfinite(noise_std)):
        raise ValueError(f"the noise std must be a finite number >= 0, got {noise_std}")
    out = {}
    for name, s in total.sums.items():
        noise = torch.randn(s.shape, dtype=torch.float64, generator=generator) * noise_std
        out[name] = (s.to(torch.float64) + noise) / denominator
    return out


def adapted_clip_norm(clip_norm: float, unclipped: int, denominator: int, *, quantile: float, lr: float,
                      count_std: float, generator: torch.Generator) -> tuple[float, float]:
    """The next clip norm and the noisy share of updates within the current one (Andrew et al.'s
    geometric update): C exp(-lr (b - quantile)) with b = (unclipped + N(0, count_std^2)) / denominator.

    Too many updates within the bound (b > quantile) shrinks it, too few grows it.
    """
    noisy = (unclipped + float(torch.randn((), dtype=torch.float64, generator=generator)) * count_std) / denominator
    return clip_norm * math.exp(-lr * (noisy - quantile)), noisy


def accounted_noise_multiplier(noise_multiplier: float, count_noise_multiplier: float | None) -> float:
    """The multiplier of the one Gaussian mechanism a round amounts to: the sum's alone, or with adaptive
    clipping, the sum's and the count's together, (z^-2 + z_count^-2)^(-1/2) (Andrew et al., Theorem 1)."""
    if count_noise_multiplier is None:
        return noise_multiplier
    if noise_multiplier == 0 or count_noise_multiplier == 0:
        return 0.0
    return (noise_multiplier ** -2 + count_noise_multiplier ** -2) ** -0.5


def epsilon_after(rounds: int, *, sampling_rate: float, noise_multiplier: float, delta: float) -> float:
    """Epsilon at ``delta`` after ``rounds`` rounds, each a Poisson-sampled Gaussian mechanism (RDP account)."""
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    accountant = RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(sampling_rate,
                                                           dp_accounting.GaussianDpEvent(noise_multiplier)), rounds)
    return float(accountant.get_epsilon(delta))


def noise_for_epsilon(epsilon: float, *, rounds: int, sampling_rate: float, delta: float) -> float:
    """The smallest noise multiplier z whose account after ``rounds`` rounds stays within ``epsilon`` at
    ``delta`` (``dp_accounting``'s calibration over the same event :func:`epsilon_after` composes): what to
    set ``privacy.noise_multiplier`` to for a target, before the run, instead of finding it by trial."""
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon must be a positive number, got {epsilon}")
    if rounds < 1 or not (0 < sampling_rate <= 1) or not (0 < delta < 1):
        raise ValueError("rounds must be at least 1, the sampling rate in (0, 1] and delta in (0, 1)")
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    def event(z: float) -> dp_accounting.DpEvent:
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(sampling_rate, dp_accounting.GaussianDpEvent(z)), rounds)

    return float(dp_accounting.calibrate_dp_mechanism(RdpAccountant, event, epsilon, delta))


@dataclass(frozen=True)
class AdaptiveClip:
    """Adaptive clipping's settings, the count's noise multiplier resolved."""

    quantile: float
    lr: float
    count_noise_multiplier: float


@dataclass(frozen=True)
class CentralPrivacy:
    """A run's central DP, resolved from ``[privacy]``: what the strategy's aggregation and the account use."""

    clip_norm: float            # the starting clip norm
    noise_multiplier: float     # z on the sum
    delta: float
    target_epsilon: float       # 0: none
    per_round: int              # devices selected per round: the fixed denominator
    sampling_rate: float        # per_round / expected
    adaptive: AdaptiveClip | None = None

    @classmethod
    def from_config(cls, config: RunConfig) -> CentralPrivacy | None:
        p = config.privacy
        if p.mode != "central":
            return None
        m = config.selected_per_round
        adaptive = None
        if p.adaptive_clip:
            adaptive = AdaptiveClip(p.target_quantile, p.clip_lr, p.count_noise_multiplier or m / 10)
        return cls(p.clip_norm, p.noise_multiplier, p.delta, p.target_epsilon, m, m / config.clients.expected,
                   adaptive)

    @property
    def accounted_multiplier(self) -> float:
        return accounted_noise_multiplier(self.noise_multiplier,
                                          None if self.adaptive is None else self.adaptive.count_noise_multiplier)

    def epsilon(self, rounds: int) -> float:
        return epsilon_after(rounds, sampling_rate=self.sampling_rate, noise_multiplier=self.accounted_multiplier,
                             delta=self.delta)

    def kept(self, state: ServerState) -> tuple[float, int]:
        """(clip norm for the next round, rounds accounted so far) from ``state``."""
        kept = state.extra.get(EXTRA_KEY, {})
        return float(kept.get("clip_norm", self.clip_norm)), int(kept.get("rounds", 0))

    def stop_before(self, state: ServerState) -> str:
        """Why the next round must not run (it would take epsilon past the target), "" when it may."""
        if self.target_epsilon <= 0:
            return ""
        _, rounds = self.kept(state)
        after = self.epsilon(rounds + 1)
        if after <= self.target_epsilon:
            return ""
        return (f"privacy: stopping before round {state.round + 1}: it would take epsilon from "
                f"{self.epsilon(rounds):.4g} to {after:.4g}, past privacy.target_epsilon = {self.target_epsilon:g} "
                f"(delta {self.delta:g})")

    def release(self, state: ServerState, total: WeightedSum, results: Sequence[ClientResult],
                generator: torch.Generator | None = None) -> tuple[dict[str, torch.Tensor], ServerState,
                                                                    dict[str, Any]]:
        """The round's noisy mean update, ``state`` with the next clip norm and one more round accounted,
        and the row's ``dp_*`` columns. ``total``: the accepted updates folded with weight 1."""
        generator = generator or fresh_generator()
        clip, rounds = self.kept(state)
        update = noisy_mean(total, self.noise_multiplier * clip, self.per_round, generator)
        clipped = clipped_count(results)
        row: dict[str, Any] = {"dp_clip_norm": clip, "dp_noise_std": self.noise_multiplier * clip / self.per_round,
                               "dp_clipped_fraction": clipped / len(results) if results else 0.0}
        following = clip
        if self.adaptive is not None:
            a = self.adaptive
            following, noisy = adapted_clip_norm(clip, len(results) - clipped, self.per_round, quantile=a.quantile,
                                                 lr=a.lr, count_std=a.count_noise_multiplier / 2, generator=generator)
            row.update({"dp_next_clip_norm": following, "dp_unclipped_noisy_fraction": noisy})
        row["dp_epsilon"] = self.epsilon(rounds + 1)
        kept = {**state.extra, EXTRA_KEY: {"clip_norm": following, "rounds": rounds + 1}}
        return update, dataclasses.replace(state, extra=kept), row


def clipped_count(results: Sequence[ClientResult]) -> int:
    """How many results say their update was clipped (``metrics["clipped"]``, checked when accepted)."""
    return sum(1 for r in results if r.metrics.get("clipped", 0.0) == 1.0)

