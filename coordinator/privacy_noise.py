"""What central DP's noise does to the mean update at a fleet's size: said before round 1, refused where it swamps.

A round releases (sum of clipped updates + N(0, (z C)^2) per coordinate) / m, m the devices drawn a round
(``clients.per_round``; under Poisson sampling the expected number). The mean update is at most C long, the
noise on it has std z C / m on every coordinate: z / m is the noise per unit of clip norm, whatever C is. The
noise multiplier a target epsilon needs hardly depends on m (it depends on the sampling rate q, the rounds and
delta), so a small fleet buys the same epsilon with far more noise on the mean.

The thresholds are measured, not derived (docs/privacy.md, "How much noise a fleet can take"): on digits (mlp
and cnn, 3 devices, 5 rounds, C = 1) nothing was learned at z / m = 0.1 and learning slowed at 0.03; in the
committed Fashion-MNIST matrix (cnn, 100 rounds) z / m = 0.099 cost 37 points, 0.18 and 0.43 left models near
chance, 0.043 cost 10 points and 0.018 cost 3. So a run refuses z / m >= :data:`REFUSE_RATIO` unless
``privacy.allow_swamping_noise`` is set, and warns from :data:`WARN_RATIO`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.config import RunConfig
    from coordinator.privacy import CentralPrivacy

__all__ = ["NoiseOnMean", "WARN_RATIO", "REFUSE_RATIO", "OVERRIDE_KEY", "run_noise", "refusal", "start_note",
           "divergence_note"]

WARN_RATIO = 0.02      # z / m from which the noise costs accuracy that shows
REFUSE_RATIO = 0.1     # z / m from which the noise swamps the update: a run refuses it
OVERRIDE_KEY = "privacy.allow_swamping_noise"


@dataclass(frozen=True)
class NoiseOnMean:
    """The noise a central-DP round adds to the mean update: multiplier z, clip norm C, m devices a round."""

    noise_multiplier: float
    clip_norm: float
    per_round: float
    sampling_rate: float = 1.0   # q: per_round / expected

    @property
    def ratio(self) -> float:
        """z / m: the noise's std on each coordinate of the mean, per unit of the clip norm that bounds the mean."""
        return self.noise_multiplier / self.per_round

    @property
    def std(self) -> float:
        """z C / m: the noise's std on each coordinate of the mean update (a row's ``dp_noise_std``)."""
        return self.ratio * self.clip_norm

    @property
    def level(self) -> str:
        """"swamps" (at or above :data:`REFUSE_RATIO`), "costs" (at or above :data:`WARN_RATIO`) or "small"."""
        return "swamps" if self.ratio >= REFUSE_RATIO else "costs" if self.ratio >= WARN_RATIO else "small"

    def describe(self) -> str:
        """The figure in one phrase: std z C / m against the clip norm."""
        return (f"the noise on the mean update has std z x C / m = {self.noise_multiplier:.4g} x "
                f"{self.clip_norm:.4g} / {self.per_round:g} = {self.std:.4g} per coordinate, {self.ratio:.4g} x the "
                "clip norm C that bounds the whole mean update")

    def verdict(self) -> str:
        """What that does, by the measured thresholds."""
        if self.level == "swamps":
            return (f"at or above {REFUSE_RATIO:g} x C it swamps the update: runs measured there learned nothing or "
                    "ended near chance (docs/privacy.md)")
        if self.level == "costs":
            return (f"from {WARN_RATIO:g} x C it costs accuracy (about 10 points at 0.04 in the measured runs; "
                    f"{REFUSE_RATIO:g} swamps the update, docs/privacy.md)")
        return f"below {WARN_RATIO:g} x C, where the measured runs lost a few points at most"

    def devices_for(self, ratio: float) -> int:
        """The fewest devices a round that bring z / m below ``ratio`` at this noise multiplier."""
        return math.floor(self.noise_multiplier / ratio) + 1

    def way_out(self, epsilon_at: Callable[[float], float], ratio: float = REFUSE_RATIO) -> str:
        """How to get below ``ratio``: more devices a round at the same sampling rate (the account, and so z,
        stays about the same), or the epsilon whose noise multiplier is ``ratio`` x m (``epsilon_at(z)``)."""
        z = ratio * self.per_round
        epsilon = epsilon_at(z)
        reach = f"epsilon above {epsilon:.4g}" if math.isfinite(epsilon) else "no finite epsilon"
        m = self.devices_for(ratio)
        fleet = math.ceil(m / self.sampling_rate - 1e-9)
        return (f"draw at least {m} devices a round at the same sampling rate q = {self.sampling_rate:g} "
                f"(clients.per_round = {m} of clients.expected = {fleet}, which keeps "
                f"z about the same for the same epsilon), or target a larger epsilon: below {ratio:g} x C at "
                f"{self.per_round:g} devices a round takes z < {z:.4g}, which is {reach} for these rounds and delta")


def run_noise(privacy: CentralPrivacy, clip_norm: float | None = None) -> NoiseOnMean:
    """The noise a run's rounds add to the mean (at ``clip_norm``, the current one under adaptive clipping)."""
    return NoiseOnMean(privacy.noise_multiplier, privacy.clip_norm if clip_norm is None else clip_norm,
                       privacy.per_round, privacy.sampling_rate)


def _epsilon_at(privacy: CentralPrivacy, rounds: int) -> Callable[[float], float]:
    """Epsilon of ``rounds`` rounds (under a seeded draw: a device drawn in all of them) at another multiplier."""
    return lambda z: dataclasses.replace(privacy, noise_multiplier=z).epsilon(rounds)


def refusal(config: RunConfig) -> str:
    """Why the run must not start (its noise swamps the mean update and the override is not set), "" when it may."""
    from coordinator.privacy import CentralPrivacy

    privacy = CentralPrivacy.from_config(config)
    if privacy is None or config.privacy.allow_swamping_noise:
        return ""
    noise = run_noise(privacy)
    if noise.level != "swamps":
        return ""
    return (f"privacy.noise_multiplier = {noise.noise_multiplier:g} with {noise.per_round:g} devices a round: "
            f"{noise.describe()}; {noise.verdict()}. To bring it below {REFUSE_RATIO:g}: "
            f"{noise.way_out(_epsilon_at(privacy, config.run.rounds))}. To run anyway, set {OVERRIDE_KEY} = true")


def start_note(config: RunConfig) -> tuple[str, bool]:
    """What a central-DP run says before round 1 about its noise, and whether it is a warning ("" when off)."""
    from coordinator.privacy import CentralPrivacy

    privacy = CentralPrivacy.from_config(config)
    if privacy is None:
        return "", False
    noise = run_noise(privacy)
    text = f"central DP with {noise.per_round:g} devices a round: {noise.describe()}; {noise.verdict()}"
    if noise.level == "small":
        return text, False
    return f"{text}. Less noise: {noise.way_out(_epsilon_at(privacy, config.run.rounds), WARN_RATIO)}", True


def divergence_note(privacy: CentralPrivacy, clip_norm: float, rounds: int) -> str:
    """What to say when a private round's devices diverged: the noise at the current clip norm and, where it is
    heavy, that it is the cause and how to lower it; where it is small, that the learning rate is the suspect."""
    noise = run_noise(privacy, clip_norm)
    figure = f"under central DP with {noise.per_round:g} devices a round {noise.describe()}; {noise.verdict()}"
    if noise.level == "small":
        return f"{figure}. That noise is small: lower train.lr, or look at what the devices said"
    return (f"{figure}. The noise, not the learning rate, is the likely cause. To lower it: "
            f"{noise.way_out(_epsilon_at(privacy, rounds), WARN_RATIO)}. A private round is not run again: start a "
            "new run with those settings (the rounds this one released are spent)")
