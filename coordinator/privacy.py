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

FFC's calibration pass (:mod:`methods.spherefed`) is one more central release: every device bounds the
L2 norm of its feature statistics (``privacy.ffc_clip``), the coordinator adds Gaussian noise of std
z_ffc x that bound to their sum once (:meth:`CentralPrivacy.release_ffc`), and the account composes one
unsampled ``GaussianDpEvent(z_ffc)`` per pass after the training rounds' events, in the same accountant.

The functions are pure (noise comes from the generator they are given); :class:`CentralPrivacy` and
:class:`LocalPrivacy` hold a run's settings. The clip norm, the rounds accounted and the devices'
participations live in ``ServerState.extra``, so a resumed run continues them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from coordinator.config_sections import PrivacySection
from coordinator.strategies.base import ClientResult, WeightedSum
from edge_client.privacy import fresh_generator
from storage.state import ServerState

if TYPE_CHECKING:
    from coordinator.config import RunConfig

__all__ = ["CentralPrivacy", "LocalPrivacy", "AdaptiveClip", "noisy_mean", "adapted_clip_norm",
           "accounted_noise_multiplier", "epsilon_after", "noise_for_epsilon", "local_epsilon",
           "local_noise_for_epsilon", "fresh_generator", "clipped_count", "noisy_sum", "ffc_epsilon"]

class _QuietOrders(logging.Filter):
    """dp_accounting warns (through absl) for every fractional RDP order whose series does not converge, and
    leaves that order out of the minimum: nothing is wrong, and it would say so on every round."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


logging.getLogger("absl").addFilter(_QuietOrders())

# ServerState.extra[EXTRA_KEY]: central {"clip_norm": C, "rounds": rounds accounted, "ffc_passes": FFC passes};
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

    FFC's statistics travel as the packed upper triangle of G and as B, so noising that vector
    and unpacking it (mirroring) gives a symmetric noisy G at the sensitivity of the packed vector.
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


def _epsilon(event: Any, delta: float) -> float:
    """Epsilon at ``delta`` of a ``dp_accounting`` event, by the RDP accountant both modes keep."""
    from dp_accounting.rdp import RdpAccountant

    accountant = RdpAccountant()
    accountant.compose(event)
    return float(accountant.get_epsilon(delta))


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
    """``participations`` releases of one device under local DP: its clipped update (norm at most C) plus
    N(0, (z C)^2), for any change of its data (replace-one: two updates within C are up to 2C apart), is
    a Gaussian mechanism of multiplier z C / 2C = z / 2. No sampling: the coordinator knows who took part."""
    import dp_accounting

    return dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(noise_multiplier / 2), participations)


def _ffc_event(passes: int, noise_multiplier: float) -> Any:
    """``passes`` FFC calibration passes under central DP: each device's statistics within the bound B, their
    sum plus N(0, (z_ffc B)^2) per coordinate, every device in it (q = 1, no amplification): a Gaussian
    mechanism of multiplier z_ffc, once per pass."""
    import dp_accounting

    return dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(noise_multiplier), passes)


def epsilon_after(rounds: int, *, sampling_rate: float, noise_multiplier: float, delta: float,
                  ffc_passes: int = 0, ffc_noise_multiplier: float = 0.0) -> float:
    """Epsilon at ``delta`` after ``rounds`` rounds, each a Poisson-sampled Gaussian mechanism, then
    ``ffc_passes`` FFC passes, each an unsampled Gaussian mechanism (one RDP account for all of them)."""
    import dp_accounting

    events = []
    if rounds > 0:
        if noise_multiplier <= 0:
            return math.inf
        events.append(_central_event(rounds, sampling_rate, noise_multiplier))
    if ffc_passes > 0:
        if ffc_noise_multiplier <= 0:
            return math.inf
        events.append(_ffc_event(ffc_passes, ffc_noise_multiplier))
    if not events:
        return 0.0
    return _epsilon(events[0] if len(events) == 1 else dp_accounting.ComposedDpEvent(events), delta)


def ffc_epsilon(passes: int, *, noise_multiplier: float, delta: float) -> float:
    """Epsilon at ``delta`` of ``passes`` private FFC passes alone (what they add to a run without training
    noise; composed with training, :func:`epsilon_after` gives the run's, which is less than the sum)."""
    return epsilon_after(0, sampling_rate=1.0, noise_multiplier=1.0, delta=delta, ffc_passes=passes,
                         ffc_noise_multiplier=noise_multiplier)


def noise_for_epsilon(epsilon: float, *, rounds: int, sampling_rate: float, delta: float, ffc_passes: int = 0,
                      ffc_noise_multiplier: float = 0.0) -> float:
    """The smallest noise multiplier z whose account after ``rounds`` rounds (and ``ffc_passes`` FFC passes at
    ``ffc_noise_multiplier``) stays within ``epsilon`` at ``delta`` (``dp_accounting``'s calibration over the
    same event :func:`epsilon_after` composes): what to set ``privacy.noise_multiplier`` to for a target,
    before the run, instead of finding it by trial."""
    if rounds < 1 or not (0 < sampling_rate <= 1):
        raise ValueError("rounds must be at least 1 and the sampling rate in (0, 1]")
    if ffc_passes < 1:
        return _calibrate(lambda z: _central_event(rounds, sampling_rate, z), epsilon, delta)
    if not ffc_noise_multiplier > 0:
        raise ValueError("FFC passes without noise (ffc_noise_multiplier 0) have no finite epsilon")
    passes = ffc_epsilon(ffc_passes, noise_multiplier=ffc_noise_multiplier, delta=delta)
    if passes >= epsilon:
        raise ValueError(f"{ffc_passes} FFC pass(es) at z_ffc = {ffc_noise_multiplier:g} alone spend epsilon "
                         f"{passes:.4g}, not less than the target {epsilon:g}: raise the FFC noise multiplier")
    import dp_accounting

    return _calibrate(lambda z: dp_accounting.ComposedDpEvent(
        [_central_event(rounds, sampling_rate, z), _ffc_event(ffc_passes, ffc_noise_multiplier)]), epsilon, delta)


def local_epsilon(participations: int, *, noise_multiplier: float, delta: float) -> float:
    """Epsilon at ``delta`` of one device under local DP after ``participations`` releases (RDP account)."""
    if participations <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    return _epsilon(_local_event(participations, noise_multiplier), delta)


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
    ffc_clip: float = PrivacySection.ffc_clip   # L2 bound on one device's FFC statistics (packed G and B together)
    ffc_noise_multiplier: float = PrivacySection.ffc_noise_multiplier   # z_ffc: the noise on the summed statistics has std z_ffc x ffc_clip

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
                   adaptive, p.ffc_clip, p.ffc_noise_multiplier)

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

    def epsilon(self, rounds: int, ffc_passes: int = 0) -> float:
        """The run's epsilon after ``rounds`` training rounds and ``ffc_passes`` FFC passes (one account)."""
        return epsilon_after(rounds, sampling_rate=self.sampling_rate, noise_multiplier=self.accounted_multiplier,
                             delta=self.delta, ffc_passes=ffc_passes, ffc_noise_multiplier=self.ffc_noise_multiplier)

    def kept(self, state: ServerState) -> tuple[float, int]:
        """(clip norm for the next round, rounds accounted so far) from ``state``."""
        kept = state.extra.get(EXTRA_KEY, {})
        return float(kept.get("clip_norm", self.clip_norm)), int(kept.get("rounds", 0))

    def ffc_passes(self, state: ServerState) -> int:
        """FFC passes accounted so far (from ``state``)."""
        return int(state.extra.get(EXTRA_KEY, {}).get("ffc_passes", 0))

    def _keep(self, state: ServerState, **changes: Any) -> ServerState:
        kept = {**state.extra.get(EXTRA_KEY, {}), **changes}
        return dataclasses.replace(state, extra={**state.extra, EXTRA_KEY: kept})

    def stop_before(self, state: ServerState, ffc_passes: int = 0) -> str:
        """Why the next round must not run (it would take epsilon past the target), "" when it may.
        ``ffc_passes``: FFC passes still to come with or after it, which the check counts in."""
        if self.target_epsilon <= 0:
            return ""
        _, rounds = self.kept(state)
        done = self.ffc_passes(state)
        after = self.epsilon(rounds + 1, done + ffc_passes)
        if after <= self.target_epsilon:
            return ""
        planned = f" and {ffc_passes} FFC pass(es)" if ffc_passes else ""
        return (f"privacy: stopping before round {state.round + 1}: it{planned} would take epsilon from "
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
        row: dict[str, Any] = {"dp_mode": "central", "dp_clip_norm": clip, "dp_noise_std": self.noise_multiplier * clip / self.per_round,
                               "dp_clipped_fraction": clipped / len(results) if results else 0.0}
        following = clip
        if self.adaptive is not None:
            a = self.adaptive
            following, noisy = adapted_clip_norm(clip, len(results) - clipped, self.per_round, quantile=a.quantile,
                                                 lr=a.lr, count_std=a.count_noise_multiplier / 2, generator=generator)
            row.update({"dp_next_clip_norm": following, "dp_unclipped_noisy_fraction": noisy})
        row["dp_epsilon"] = self.epsilon(rounds + 1, self.ffc_passes(state))
        return update, self._keep(state, clip_norm=following, rounds=rounds + 1), row

    def release_ffc(self, state: ServerState, sums: Mapping[str, torch.Tensor], clipped: int, devices: int,
                    generator: torch.Generator | None = None) -> tuple[dict[str, torch.Tensor], ServerState,
                                                                       dict[str, Any]]:
        """An FFC pass's noisy sums, ``state`` with one more pass accounted, and the row's ``dp_*`` columns.

        ``sums``: the devices' statistics, each held to ``ffc_clip`` (all of its tensors as one vector),
        summed; they get N(0, (z_ffc x ffc_clip)^2) per coordinate once. No denominator: the least-squares
        solve is the same for any common scale of G and B, so the sum is released as it is.
        """
        generator = generator or fresh_generator()
        std = self.ffc_noise_multiplier * self.ffc_clip
        noisy = noisy_sum(sums, std, generator)
        _, rounds = self.kept(state)
        passes = self.ffc_passes(state) + 1
        row = {"dp_mode": "central", "dp_epsilon": self.epsilon(rounds, passes),
               "dp_ffc_epsilon": ffc_epsilon(passes, noise_multiplier=self.ffc_noise_multiplier, delta=self.delta),
               "dp_ffc_passes": passes, "dp_ffc_clip": self.ffc_clip, "dp_ffc_noise_std": std,
               "dp_ffc_clipped_fraction": clipped / devices if devices else 0.0}
        return noisy, self._keep(state, ffc_passes=passes), row


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

    @classmethod
    def from_config(cls, config: RunConfig) -> LocalPrivacy | None:
        p = config.privacy
        if p.mode != "local":
            return None
        return cls(p.clip_norm, p.noise_multiplier, p.delta, p.target_epsilon)

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

    def stop_before(self, state: ServerState) -> str:
        """Why the next round must not run, "" when it may: any device may be drawn, so the round is refused
        when the device with the most participations, drawn once more, would pass the target."""
        if self.target_epsilon <= 0:
            return ""
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
        return {"dp_mode": "local", "dp_epsilon": self.epsilon(most), "dp_clip_norm": self.clip_norm,
                "dp_noise_std": self.noise_multiplier * self.clip_norm, "dp_max_participations": most,
                "dp_devices": len(counts)}
