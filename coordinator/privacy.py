"""Differential privacy: the coordinator's noise, the adaptive clip norm and the privacy accounts.

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
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from coordinator.strategies.base import ClientResult, WeightedSum
from edge_client.privacy import fresh_generator
from edge_client.privacy_account import local_event, rdp_epsilon
from storage.state import ServerState

if TYPE_CHECKING:
    from coordinator.config import RunConfig

__all__ = ["CentralPrivacy", "LocalPrivacy", "AdaptiveClip", "noisy_mean", "adapted_clip_norm",
           "accounted_noise_multiplier", "epsilon_after", "noise_for_epsilon", "local_epsilon",
           "local_noise_for_epsilon", "fresh_generator", "clipped_count", "noisy_sum", "release_epsilon"]

# ServerState.extra[EXTRA_KEY]: central {"clip_norm": C, "rounds": rounds accounted,
# "releases": [noise multiplier of each unsampled release so far]};
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


def _calibrate(event: Callable[[float], Any], epsilon: float, delta: float) -> float:
    """The smallest noise multiplier z whose ``event(z)`` stays within ``epsilon`` at ``delta``
    (``dp_accounting``'s calibration, by the same accountant as :func:`_epsilon`)."""
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon must be a positive number, got {epsilon}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    return float(dp_accounting.calibrate_dp_mechanism(RdpAccountant, event, epsilon, delta))


def _central_event(rounds: int, sampling_rate: float, noise_multiplier: float) -> Any:
    """``rounds`` rounds of central DP: each a Poisson-sampled Gaussian mechanism over the noisy sum."""
    import dp_accounting

    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier)), rounds)


def _local_event(participations: int, noise_multiplier: float) -> Any:
    """``participations`` releases of one device under local DP at multiplier ``noise_multiplier``
    (:func:`edge_client.privacy_account.local_event`)."""
    return local_event({noise_multiplier: participations})


def _release_event(multipliers: Sequence[float]) -> Any:
    """Releases with every device in them (q = 1, no amplification): each device's contribution within a
    bound B, their sum plus N(0, (z B)^2) per coordinate, a Gaussian mechanism of multiplier z each."""
    import dp_accounting

    return dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(z) for z in multipliers])


def epsilon_after(rounds: int, *, sampling_rate: float, noise_multiplier: float, delta: float,
                  releases: Sequence[float] = ()) -> float:
    """Epsilon at ``delta`` after ``rounds`` rounds, each a Poisson-sampled Gaussian mechanism, then one
    unsampled Gaussian mechanism per multiplier in ``releases`` (one RDP account for all of them)."""
    import dp_accounting

    events = []
    if rounds > 0:
        if noise_multiplier <= 0:
            return math.inf
        events.append(_central_event(rounds, sampling_rate, noise_multiplier))
    if releases:
        if min(releases) <= 0:
            return math.inf
        events.append(_release_event(releases))
    if not events:
        return 0.0
    return rdp_epsilon(events[0] if len(events) == 1 else dp_accounting.ComposedDpEvent(events), delta)


def release_epsilon(releases: Sequence[float], *, delta: float) -> float:
    """Epsilon at ``delta`` of unsampled releases alone (one per multiplier; composed with training,
    :func:`epsilon_after` gives the run's, which is less than the two added)."""
    return epsilon_after(0, sampling_rate=1.0, noise_multiplier=1.0, delta=delta, releases=releases)


def noise_for_epsilon(epsilon: float, *, rounds: int, sampling_rate: float, delta: float,
                      releases: Sequence[float] = ()) -> float:
    """The smallest noise multiplier z whose account after ``rounds`` rounds (and the unsampled ``releases``)
    stays within ``epsilon`` at ``delta`` (``dp_accounting``'s calibration over the same event
    :func:`epsilon_after` composes): what to set ``privacy.noise_multiplier`` to for a target, before the
    run, instead of finding it by trial."""
    if rounds < 1 or not (0 < sampling_rate <= 1):
        raise ValueError("rounds must be at least 1 and the sampling rate in (0, 1]")
    if not releases:
        return _calibrate(lambda z: _central_event(rounds, sampling_rate, z), epsilon, delta)
    alone = release_epsilon(releases, delta=delta)
    if alone >= epsilon:
        raise ValueError(f"the {len(releases)} release(s) alone spend epsilon {alone:.4g}, not less than the "
                         f"target {epsilon:g}: raise their noise multiplier")
    import dp_accounting

    return _calibrate(lambda z: dp_accounting.ComposedDpEvent(
        [_central_event(rounds, sampling_rate, z), _release_event(releases)]), epsilon, delta)


def local_epsilon(participations: int, *, noise_multiplier: float, delta: float) -> float:
    """Epsilon at ``delta`` of one device under local DP after ``participations`` releases (RDP account)."""
    if participations <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    return rdp_epsilon(_local_event(participations, noise_multiplier), delta)


def local_noise_for_epsilon(epsilon: float, *, participations: int, delta: float) -> float:
    """The smallest device noise multiplier z (noise std z x C on the clipped update) that keeps a device
    within ``epsilon`` at ``delta`` over ``participations`` rounds it takes part in: the calibration of
    :func:`local_epsilon`'s event, for ``privacy.noise_multiplier`` under ``privacy.mode = "local"``."""
    if participations < 1:
        raise ValueError(f"participations must be at least 1, got {participations}")
    return _calibrate(lambda z: _local_event(participations, z), epsilon, delta)


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
    sampling: str = "fixed"     # privacy.sampling: how rounds are drawn ("poisson": as the account assumes)

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
                   adaptive, p.sampling)

    mode: ClassVar[str] = "central"

    def upload(self, state: ServerState) -> tuple[float, float | None]:
        """(clip norm, device noise multiplier) a training task carries: the current clip norm, no device noise."""
        return self.kept(state)[0], None

    def took_part(self, state: ServerState, clients: frozenset[str]) -> ServerState:
        """Central DP's account is per round (in :meth:`release`), not per device: ``state`` as it is."""
        return state

    @property
    def accounted_multiplier(self) -> float:
        return accounted_noise_multiplier(self.noise_multiplier,
                                          None if self.adaptive is None else self.adaptive.count_noise_multiplier)

    def epsilon(self, rounds: int, releases: Sequence[float] = ()) -> float:
        """The run's epsilon after ``rounds`` training rounds and the unsampled ``releases`` (one account)."""
        return epsilon_after(rounds, sampling_rate=self.sampling_rate, noise_multiplier=self.accounted_multiplier,
                             delta=self.delta, releases=releases)

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
        ``planned``: multipliers of the unsampled releases still to come with or after it, counted in."""
        if self.target_epsilon <= 0:
            return ""
        _, rounds = self.kept(state)
        done = self.releases(state)
        after = self.epsilon(rounds + 1, [*done, *planned])
        if after <= self.target_epsilon:
            return ""
        planned_text = f" and {len(planned)} planned release(s) of every device" if planned else ""
        return (f"privacy: stopping before round {state.round + 1}: it{planned_text} would take epsilon from "
                f"{self.epsilon(rounds, done):.4g} to {after:.4g}, past privacy.target_epsilon = "
                f"{self.target_epsilon:g} (delta {self.delta:g})")

    def release(self, state: ServerState, total: WeightedSum, results: Sequence[ClientResult],
                generator: torch.Generator | None = None) -> tuple[dict[str, torch.Tensor], ServerState,
                                                                    dict[str, Any]]:
        """The round's noisy mean update, ``state`` with the next clip norm and one more round accounted,
        and the row's ``dp_*`` columns. ``total``: the accepted updates folded with weight 1."""
        generator = generator or fresh_generator()
        clip, rounds = self.kept(state)
        update = noisy_mean(total, self.noise_multiplier * clip, self.per_round, generator)
        clipped = clipped_count(results)
        row: dict[str, Any] = {"dp_mode": "central", "dp_sampling": self.sampling, "dp_clip_norm": clip,
                               "dp_noise_std": self.noise_multiplier * clip / self.per_round,
                               "dp_clipped_fraction": clipped / len(results) if results else 0.0}
        following = clip
        if self.adaptive is not None:
            a = self.adaptive
            following, noisy = adapted_clip_norm(clip, len(results) - clipped, self.per_round, quantile=a.quantile,
                                                 lr=a.lr, count_std=a.count_noise_multiplier / 2, generator=generator)
            row.update({"dp_next_clip_norm": following, "dp_unclipped_noisy_fraction": noisy})
        row["dp_epsilon"] = self.epsilon(rounds + 1, self.releases(state))
        return update, self._keep(state, clip_norm=following, rounds=rounds + 1), row

    def release_sum(self, state: ServerState, sums: Mapping[str, torch.Tensor], bound: float, noise_multiplier: float,
                    generator: torch.Generator | None = None) -> tuple[dict[str, torch.Tensor], ServerState,
                                                                       dict[str, Any]]:
        """A release with every device in it: ``sums`` of contributions each held to L2 norm ``bound`` (all of a
        device's tensors as one vector) plus N(0, (noise_multiplier x bound)^2) per coordinate, once; ``state``
        with the release accounted; the row's ``dp_epsilon`` (the run's, composed) and ``dp_releases``."""
        if not (bound > 0 and math.isfinite(bound)):
            raise ValueError(f"the bound must be a positive finite number, got {bound}")
        noisy = noisy_sum(sums, noise_multiplier * bound, generator or fresh_generator())
        _, rounds = self.kept(state)
        releases = [*self.releases(state), float(noise_multiplier)]
        row = {"dp_mode": "central", "dp_epsilon": self.epsilon(rounds, releases), "dp_releases": len(releases)}
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

    @classmethod
    def from_config(cls, config: RunConfig) -> LocalPrivacy | None:
        p = config.privacy
        if p.mode != "local":
            return None
        return cls(p.clip_norm, p.noise_multiplier, p.delta, p.target_epsilon, p.spent_devices == "skip",
                   config.clients.expected, config.required_results)

    mode: ClassVar[str] = "local"

    def upload(self, state: ServerState) -> tuple[float, float | None]:
        """(clip norm, device noise multiplier) a training task carries."""
        return self.clip_norm, self.noise_multiplier

    def epsilon(self, participations: int) -> float:
        return local_epsilon(participations, noise_multiplier=self.noise_multiplier, delta=self.delta)

    def participations(self, state: ServerState) -> dict[str, int]:
        """Device id -> training rounds it was given a task in, so far (from ``state``)."""
        return {k: int(v) for k, v in state.extra.get(EXTRA_KEY, {}).get("participations", {}).items()}

    def took_part(self, state: ServerState, clients: frozenset[str]) -> ServerState:
        """``state`` with one more participation for each of ``clients``, the devices given a training task."""
        counts = self.participations(state)
        for client in clients:
            counts[client] = counts.get(client, 0) + 1
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
        row = {"dp_mode": "local", "dp_epsilon": self.epsilon(most), "dp_clip_norm": self.clip_norm,
               "dp_noise_std": self.noise_multiplier * self.clip_norm, "dp_max_participations": most,
               "dp_devices": len(counts)}
        if self.skip_spent:
            row["dp_spent_devices"] = len(self.spent(state))
        return row
