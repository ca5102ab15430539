"""Differential privacy: the coordinator's noise, the adaptive clip norm and the privacy accounts.

What is protected is one device's whole contribution to a round (client-level DP, McMahan et al.
2018, "Learning Differentially Private Recurrent Language Models"): each device clips its update to
the L2 norm C (:mod:`edge_client.privacy`), every accepted update weighs the same, the sum gets
Gaussian noise of std z x C once, and it is divided by the number of devices selected per round,
a fixed denominator, so that a device's presence moves the released mean by at most C / m whether
or not the others answered. The account (:mod:`coordinator.privacy_account`) is ``dp_accounting``'s, PLD
or RDP (``privacy.accountant``), over the event the draw allows: Poisson-sampled, sampled without
replacement, or not amplified at all when the draw is public (``privacy.sampling``); no formula of it is
written here.

With ``adaptive_clip`` the clip norm follows a quantile of the update norms (Andrew et al. 2021,
"Differentially Private Learning with Adaptive Clipping"): each device reports one bit (was its
update clipped), the coordinator sums the centred bits b - 1/2 with noise and takes a geometric step. The
count is a second release of sensitivity 1/2; its noise is folded into the multiplier the account uses.

With local differential privacy (:class:`LocalPrivacy`) each device adds the noise to its own clipped
update, so the coordinator need not be trusted: it neither clips nor adds noise, and keeps one account
per device, over the rounds that device was given a task in, each a Gaussian mechanism of sensitivity
2C (any change of the device's data) without amplification by sampling.

A method may release more than training's rounds: a pass in which every device sends statistics bounded
in L2 norm (a calibration after training, say). :meth:`CentralPrivacy.release_sum` adds the Gaussian noise
to their sum once and the account composes one unsampled ``GaussianDpEvent(z)`` per such release after
the training rounds' events, in the same accountant; the method says what is bounded and how.

The functions are pure (noise comes from the generator they are given); :class:`CentralPrivacy` and
:class:`LocalPrivacy` hold a run's settings. The clip norm, the rounds accounted and the devices'
participations live in ``ServerState.extra``, so a resumed run continues them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from coordinator.strategies.base import ClientResult, WeightedSum
from edge_client.privacy import fresh_generator
from coordinator.privacy_account import DEFAULT_SAMPLING, CentralAccount
from edge_client.privacy_account import DEFAULT_ACCOUNTANT, calibrate, epsilon_of, local_event
from storage.state import ServerState

if TYPE_CHECKING:
    from coordinator.config import RunConfig

__all__ = ["CentralPrivacy", "LocalPrivacy", "AdaptiveClip", "noisy_mean", "adapted_clip_norm", "centred_count",
           "COUNT_SENSITIVITY", "accounted_noise_multiplier", "epsilon_after", "noise_for_epsilon", "local_epsilon",
           "local_noise_for_epsilon", "fresh_generator", "clipped_count", "noisy_sum", "release_epsilon"]

# ServerState.extra[EXTRA_KEY]: central {"clip_norm": C, "rounds": rounds accounted,
# "releases": [noise multiplier of each unsampled release so far],
# "participations": {device id: rounds drawn in} (privacy.sampling = "seeded" only)};
# local {"participations": {device id: rounds it was given a training task in}}
EXTRA_KEY = "privacy"


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


def noisy_sum(sums: Mapping[str, torch.Tensor], noise_std: float,
              generator: torch.Generator) -> dict[str, torch.Tensor]:
    """``sums`` + N(0, noise_std^2) on every coordinate, float64: a released sum of bounded contributions.

    A symmetric matrix sent as its packed upper triangle, noised so and unpacked (mirrored), stays
    symmetric at the sensitivity of the packed vector.
    """
    if not (noise_std >= 0 and math.isfinite(noise_std)):
        raise ValueError(f"the noise std must be a finite number >= 0, got {noise_std}")
    return {name: s.to(torch.float64) + torch.randn(s.shape, dtype=torch.float64, generator=generator) * noise_std
            for name, s in sums.items()}


# What one device moves the count of adaptive clipping by: its bit enters centred, b - 1/2, so adding or removing
# it moves the sum by 1/2 (Andrew et al.'s sensitivity, which their composition of the two releases assumes).
COUNT_SENSITIVITY = 0.5


def centred_count(unclipped: int, answered: int) -> float:
    """Sum over the answered devices of b - 1/2 (b = 1: the update was within the clip norm): the statistic whose
    noisy value steps the clip norm. One device more or less moves it by at most :data:`COUNT_SENSITIVITY`."""
    if not 0 <= unclipped <= answered:
        raise ValueError(f"unclipped updates ({unclipped}) must be between 0 and the results ({answered})")
    return unclipped - answered / 2


def adapted_clip_norm(clip_norm: float, unclipped: int, answered: int, denominator: int, *, quantile: float,
                      lr: float, count_noise_multiplier: float, generator: torch.Generator) -> tuple[float, float]:
    """The next clip norm and the noisy share of updates within the current one (Andrew et al.'s geometric update):
    C exp(-lr (b - quantile)), with b = (sum of centred bits + N(0, (z_count / 2)^2)) / denominator + 1/2.

    Too many updates within the bound (b > quantile) shrinks it, too few grows it. A device that did not answer
    contributes no bit, which counts as half within: the fixed denominator stands for the devices drawn.
    """
    noise = float(torch.randn((), dtype=torch.float64, generator=generator)) * count_noise_multiplier * COUNT_SENSITIVITY
    noisy = (centred_count(unclipped, answered) + noise) / denominator + 0.5
    return clip_norm * math.exp(-lr * (noisy - quantile)), noisy


def accounted_noise_multiplier(noise_multiplier: float, count_noise_multiplier: float | None) -> float:
    """The multiplier of the one Gaussian mechanism a round amounts to: the sum's alone, or with adaptive
    clipping, the sum's and the centred count's together, (z^-2 + z_count^-2)^(-1/2) (Andrew et al., Theorem 1:
    the sum has sensitivity C and noise z C, the count sensitivity 1/2 and noise z_count / 2)."""
    if count_noise_multiplier is None:
        return noise_multiplier
    if noise_multiplier == 0 or count_noise_multiplier == 0:
        return 0.0
    return (noise_multiplier ** -2 + count_noise_multiplier ** -2) ** -0.5


def epsilon_after(rounds: int, *, sampling_rate: float, noise_multiplier: float, delta: float,
                  releases: Sequence[float] = (), sampling: str = DEFAULT_SAMPLING,
                  accountant: str = DEFAULT_ACCOUNTANT, expected: int = 0) -> float:
    """Epsilon at ``delta`` after ``rounds`` rounds drawn by ``sampling`` at rate ``sampling_rate`` (under
    ``"seeded"``, the rounds of the most-drawn device), then one unsampled Gaussian mechanism per multiplier in
    ``releases``: one account for all of them (:class:`CentralAccount`)."""
    account = CentralAccount(sampling, sampling_rate, expected, accountant)
    return account.epsilon(rounds, noise_multiplier, delta, releases)


def release_epsilon(releases: Sequence[float], *, delta: float, accountant: str = DEFAULT_ACCOUNTANT) -> float:
    """Epsilon at ``delta`` of unsampled releases alone (one per multiplier; composed with training,
    :func:`epsilon_after` gives the run's, which is less than the two added)."""
    return CentralAccount(accountant=accountant).epsilon(0, 1.0, delta, releases)


def noise_for_epsilon(epsilon: float, *, rounds: int, sampling_rate: float, delta: float,
                      releases: Sequence[float] = (), sampling: str = DEFAULT_SAMPLING,
                      accountant: str = DEFAULT_ACCOUNTANT, expected: int = 0) -> float:
    """The smallest noise multiplier z whose account after ``rounds`` rounds (and the unsampled ``releases``)
    stays within ``epsilon`` at ``delta`` (``dp_accounting``'s calibration over the same event
    :func:`epsilon_after` composes, by the same accountant): what to set ``privacy.noise_multiplier`` to for a
    target, before the run, instead of finding it by trial."""
    if rounds < 1 or not (0 < sampling_rate <= 1):
        raise ValueError("rounds must be at least 1 and the sampling rate in (0, 1]")
    return CentralAccount(sampling, sampling_rate, expected, accountant).noise_for(epsilon, rounds, delta, releases)


def local_epsilon(participations: int, *, noise_multiplier: float, delta: float,
                  accountant: str = DEFAULT_ACCOUNTANT) -> float:
    """Epsilon at ``delta`` of one device under local DP after ``participations`` releases."""
    if participations <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    return epsilon_of(local_event({noise_multiplier: participations}), delta, accountant)


def local_noise_for_epsilon(epsilon: float, *, participations: int, delta: float,
                            accountant: str = DEFAULT_ACCOUNTANT) -> float:
    """The smallest device noise multiplier z (noise std z x C on the clipped update) that keeps a device
    within ``epsilon`` at ``delta`` over ``participations`` rounds it takes part in: the calibration of
    :func:`local_epsilon`'s event, for ``privacy.noise_multiplier`` under ``privacy.mode = "local"``."""
    if participations < 1:
        raise ValueError(f"participations must be at least 1, got {participations}")
    return calibrate(lambda z: local_event({z: participations}), epsilon, delta, accountant)


def participations(state: ServerState) -> dict[str, int]:
    """Device id -> rounds it was given a training task in, as ``state`` keeps them (local DP, and central DP over a
    seeded draw: both account each device over its own rounds)."""
    return {k: int(v) for k, v in state.extra.get(EXTRA_KEY, {}).get("participations", {}).items()}


def counted_once_more(counts: Mapping[str, int], clients: frozenset[str]) -> dict[str, int]:
    """``counts`` with one more round for each of ``clients``."""
    return {**counts, **{c: counts.get(c, 0) + 1 for c in clients}}


@functools.lru_cache(maxsize=1024)
def _local_epsilon_cached(participations: int, noise_multiplier: float, delta: float, accountant: str) -> float:
    """:func:`local_epsilon`, once per count: a round asks for the figure of every distinct count it sees."""
    return local_epsilon(participations, noise_multiplier=noise_multiplier, delta=delta, accountant=accountant)


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
    per_round: int              # devices counted per round: the fixed denominator
    # q: the largest chance a device is counted in a round, drawn / expected (with clients.over_select the drawn
    # devices are more than the per_round counted, and a fast device is counted whenever it is drawn)
    sampling_rate: float
    adaptive: AdaptiveClip | None = None
    sampling: str = DEFAULT_SAMPLING         # privacy.sampling: how rounds are drawn, so what the account may claim
    accountant: str = DEFAULT_ACCOUNTANT     # privacy.accountant
    expected: int = 0                        # clients.expected

    @classmethod
    def from_config(cls, config: RunConfig) -> CentralPrivacy | None:
        p = config.privacy
        if p.mode != "central":
            return None
        m = config.selected_per_round
        adaptive = None
        if p.adaptive_clip:
            adaptive = AdaptiveClip(p.target_quantile, p.clip_lr, p.count_noise_multiplier or m / 10)
        return cls(p.clip_norm, p.noise_multiplier, p.delta, p.target_epsilon, m,
                   config.drawn_per_round / config.clients.expected,
                   adaptive, p.sampling or DEFAULT_SAMPLING, p.accountant, config.clients.expected)

    mode: ClassVar[str] = "central"

    @property
    def account(self) -> CentralAccount:
        return CentralAccount(self.sampling, self.sampling_rate, self.expected, self.accountant)

    def upload(self, state: ServerState) -> tuple[float, float | None]:
        """(clip norm, device noise multiplier) a training task carries: the current clip norm, no device noise."""
        return self.kept(state)[0], None

    def took_part(self, state: ServerState, clients: frozenset[str]) -> ServerState:
        """Under a seeded draw, one more round for each of ``clients`` (the account is each device's); otherwise
        the account is per round (in :meth:`release`) and ``state`` is returned as it is."""
        if not self.account.per_device:
            return state
        return self._keep(state, participations=counted_once_more(participations(state), clients))

    def participations(self, state: ServerState) -> dict[str, int]:
        """Device id -> rounds it was drawn in, kept under a seeded draw only."""
        return participations(state)

    @property
    def accounted_multiplier(self) -> float:
        return accounted_noise_multiplier(self.noise_multiplier,
                                          None if self.adaptive is None else self.adaptive.count_noise_multiplier)

    def epsilon(self, rounds: int, releases: Sequence[float] = ()) -> float:
        """The run's epsilon after ``rounds`` training rounds (under a seeded draw: rounds its most-drawn device
        took part in) and the unsampled ``releases`` (one account)."""
        return self.account.epsilon(rounds, self.accounted_multiplier, self.delta, releases)

    def accounted_rounds(self, state: ServerState) -> int:
        """The rounds the account composes so far: the run's, or under a seeded draw its most-drawn device's."""
        if self.account.per_device:
            return max(self.participations(state).values(), default=0)
        return self.kept(state)[1]

    def kept(self, state: ServerState) -> tuple[float, int]:
        """(clip norm for the next round, rounds accounted so far) from ``state``."""
        kept = state.extra.get(EXTRA_KEY, {})
        return float(kept.get("clip_norm", self.clip_norm)), int(kept.get("rounds", 0))

    def releases(self, state: ServerState) -> list[float]:
        """The noise multipliers of the unsampled releases accounted so far (from ``state``)."""
        return [float(z) for z in state.extra.get(EXTRA_KEY, {}).get("releases", [])]

    def _keep(self, state: ServerState, **changes: Any) -> ServerState:
        kept = {**state.extra.get(EXTRA_KEY, {}), **changes}
        return dataclasses.replace(state, extra={**state.extra, EXTRA_KEY: kept})

    def stop_before(self, state: ServerState, planned: Sequence[float] = ()) -> str:
        """Why the next round must not run (it would take epsilon past the target), "" when it may.
        ``planned``: multipliers of the unsampled releases still to come with or after it, counted in. Under a
        seeded draw, the round is refused when the most-drawn device, drawn once more, would pass the target."""
        if self.target_epsilon <= 0:
            return ""
        rounds = self.accounted_rounds(state)
        done = self.releases(state)
        after = self.epsilon(rounds + 1, [*done, *planned])
        if after <= self.target_epsilon:
            return ""
        planned_text = f" and {len(planned)} planned release(s) of every device" if planned else ""
        who = f" (its most-drawn device, in {rounds} rounds so far, drawn again)" if self.account.per_device else ""
        return (f"privacy: stopping before round {state.round + 1}: it{planned_text}{who} would take epsilon from "
                f"{self.epsilon(rounds, done):.4g} to {after:.4g}, past privacy.target_epsilon = "
                f"{self.target_epsilon:g} (delta {self.delta:g}, {self.account.describe()})")

    def release(self, state: ServerState, total: WeightedSum, results: Sequence[ClientResult],
                generator: torch.Generator | None = None) -> tuple[dict[str, torch.Tensor], ServerState,
                                                                    dict[str, Any]]:
        """The round's noisy mean update, ``state`` with the next clip norm and one more round accounted,
        and the row's ``dp_*`` columns. ``total``: the accepted updates folded with weight 1."""
        generator = generator or fresh_generator()
        clip, rounds = self.kept(state)
        update = noisy_mean(total, self.noise_multiplier * clip, self.per_round, generator)
        clipped = clipped_count(results)
        row: dict[str, Any] = {"dp_mode": "central", "dp_sampling": self.sampling, "dp_accountant": self.accountant,
                               "dp_clip_norm": clip, "dp_noise_std": self.noise_multiplier * clip / self.per_round,
                               "dp_clipped_fraction": clipped / len(results) if results else 0.0}
        following = clip
        if self.adaptive is not None:
            a = self.adaptive
            following, noisy = adapted_clip_norm(clip, len(results) - clipped, len(results), self.per_round,
                                                 quantile=a.quantile, lr=a.lr,
                                                 count_noise_multiplier=a.count_noise_multiplier, generator=generator)
            row.update({"dp_next_clip_norm": following, "dp_unclipped_noisy_fraction": noisy})
        state = self._keep(state, clip_norm=following, rounds=rounds + 1)
        if self.account.per_device:
            row["dp_max_participations"] = self.accounted_rounds(state)
        row["dp_epsilon"] = self.epsilon(self.accounted_rounds(state), self.releases(state))
        return update, state, row

    def release_sum(self, state: ServerState, sums: Mapping[str, torch.Tensor], bound: float, noise_multiplier: float,
                    generator: torch.Generator | None = None) -> tuple[dict[str, torch.Tensor], ServerState,
                                                                       dict[str, Any]]:
        """A release with every device in it: ``sums`` of contributions each held to L2 norm ``bound`` (all of a
        device's tensors as one vector) plus N(0, (noise_multiplier x bound)^2) per coordinate, once; ``state``
        with the release accounted; the row's ``dp_epsilon`` (the run's, composed) and ``dp_releases``."""
        if not (bound > 0 and math.isfinite(bound)):
            raise ValueError(f"the bound must be a positive finite number, got {bound}")
        noisy = noisy_sum(sums, noise_multiplier * bound, generator or fresh_generator())
        releases = [*self.releases(state), float(noise_multiplier)]
        row = {"dp_mode": "central", "dp_accountant": self.accountant,
               "dp_epsilon": self.epsilon(self.accounted_rounds(state), releases), "dp_releases": len(releases)}
        return noisy, self._keep(state, releases=releases), row


def clipped_count(results: Sequence[ClientResult]) -> int:
    """How many results say their update was clipped (``metrics["clipped"]``, checked when accepted)."""
    return sum(1 for r in results if r.metrics.get("clipped", 0.0) == 1.0)



@dataclass(frozen=True)
class LocalPrivacy:
    """A run's local DP, resolved from ``[privacy]``: what the tasks carry and the per-device account.

    The devices clip and add the noise; this keeps, in ``ServerState.extra``, how many training rounds
    each device was given a task in, and reports the largest epsilon over the devices.
    """

    clip_norm: float
    noise_multiplier: float     # z: each device's noise has std z x clip_norm per coordinate
    delta: float
    target_epsilon: float       # 0: none
    skip_spent: bool = False    # privacy.spent_devices = "skip": draw around spent devices instead of stopping
    expected: int = 0           # clients.expected: the devices that may be drawn
    required: int = 1           # the results a round needs
    accountant: str = DEFAULT_ACCOUNTANT   # privacy.accountant

    @classmethod
    def from_config(cls, config: RunConfig) -> LocalPrivacy | None:
        p = config.privacy
        if p.mode != "local":
            return None
        return cls(p.clip_norm, p.noise_multiplier, p.delta, p.target_epsilon, p.spent_devices == "skip",
                   config.clients.expected, config.required_results, p.accountant)

    mode: ClassVar[str] = "local"

    def upload(self, state: ServerState) -> tuple[float, float | None]:
        """(clip norm, device noise multiplier) a training task carries."""
        return self.clip_norm, self.noise_multiplier

    def epsilon(self, participations: int) -> float:
        return _local_epsilon_cached(participations, self.noise_multiplier, self.delta, self.accountant)

    def participations(self, state: ServerState) -> dict[str, int]:
        """Device id -> training rounds it was given a task in, so far (from ``state``)."""
        return participations(state)

    def took_part(self, state: ServerState, clients: frozenset[str]) -> ServerState:
        """``state`` with one more participation for each of ``clients``, the devices given a training task."""
        counts = counted_once_more(participations(state), clients)
        return dataclasses.replace(state, extra={**state.extra, EXTRA_KEY: {"participations": counts}})

    def spent(self, state: ServerState) -> frozenset[str]:
        """With ``skip_spent`` and a target, the devices one more participation would take past it (not drawn)."""
        if not self.skip_spent or self.target_epsilon <= 0:
            return frozenset()
        counts = self.participations(state)
        room = {n: self.epsilon(n + 1) <= self.target_epsilon for n in set(counts.values())}   # one call per count
        return frozenset(d for d, n in counts.items() if not room[n])

    def stop_before(self, state: ServerState) -> str:
        """Why the next round must not run, "" when it may. Drawing any device (``spent_devices = "stop"``),
        the round is refused when the device with the most participations, drawn once more, would pass the
        target; drawing around spent devices, when fewer devices than a round's results have room left."""
        if self.target_epsilon <= 0:
            return ""
        if self.skip_spent:
            left = self.expected - len(self.spent(state)) if self.epsilon(1) <= self.target_epsilon else 0
            if left >= self.required:
                return ""
            return (f"privacy: stopping before round {state.round + 1}: {left} of {self.expected} devices have room "
                    f"for another round within privacy.target_epsilon = {self.target_epsilon:g} (delta "
                    f"{self.delta:g}, local DP), fewer than the {self.required} results a round needs")
        most = max(self.participations(state).values(), default=0)
        after = self.epsilon(most + 1)
        if after <= self.target_epsilon:
            return ""
        return (f"privacy: stopping before round {state.round + 1}: a device with {most} participations drawn "
                f"again would go from epsilon {self.epsilon(most):.4g} to {after:.4g}, past privacy.target_epsilon = "
                f"{self.target_epsilon:g} (delta {self.delta:g}, local DP)")

    def row(self, state: ServerState) -> dict[str, Any]:
        """The row's ``dp_*`` columns after a round: the largest epsilon over the devices so far."""
        counts = self.participations(state)
        most = max(counts.values(), default=0)
        row = {"dp_mode": "local", "dp_accountant": self.accountant, "dp_epsilon": self.epsilon(most), "dp_clip_norm": self.clip_norm,
               "dp_noise_std": self.noise_multiplier * self.clip_norm, "dp_max_participations": most,
               "dp_devices": len(counts)}
        if self.skip_spent:
            row["dp_spent_devices"] = len(self.spent(state))
        return row
