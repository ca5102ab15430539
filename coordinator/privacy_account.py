"""Central DP's account: the ``dp_accounting`` event a run's rounds amount to, by how their devices are drawn.

A round releases the noisy mean of clipped updates: a Gaussian mechanism of multiplier z on a sum in which one
device's update moves by at most C. What the account may claim beyond that depends on who can know the draw:

- ``"poisson"``: each device joins a round on its own with probability q, from the OS's entropy. Amplification by
  Poisson sampling under add-or-remove-one: ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` per round.
- ``"fixed"``: exactly m = q n devices, uniformly without replacement, from the OS's entropy. A fixed-size draw
  is defined for neighbouring fleets of the same size, so the relation is replace-one: one device's update
  replaced by another, which moves the sum by up to 2C, a Gaussian of multiplier z / 2. Sampled without
  replacement at q, its privacy loss is dominated by Poisson sampling of that mechanism (Zhu, Dong and Wang
  2022, "Optimal Accounting of Differential Privacy via Characteristic Function", for sampling without
  replacement under replace-one): PLD composes ``PoissonSampledDpEvent(q, GaussianDpEvent(z / 2))``, RDP its own
  ``SampledWithoutReplacementDpEvent`` (Wang, Balle and Kasiviswanathan 2019), looser.
- ``"seeded"``: the draw seeded by ``run.seed``, reproducible, which every task carries, so any device can
  recompute who took part in every round: no amplification. Each device composes one
  ``GaussianDpEvent(z)`` per round it was drawn in; the run's epsilon is its most-drawn device's.

With every device in every round (q = 1) nothing is sampled and all three are ``GaussianDpEvent(z)`` per round.
Releases with every device in them (a calibration pass) add one unsampled Gaussian each, at the same relation.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from edge_client.privacy_account import ACCOUNTANTS, DEFAULT_ACCOUNTANT, calibrate, epsilon_of

__all__ = ["CentralAccount", "SAMPLINGS", "DEFAULT_SAMPLING"]

SAMPLINGS = ("poisson", "fixed", "seeded")   # privacy.sampling under central DP
DEFAULT_SAMPLING = "poisson"


@dataclass(frozen=True)
class CentralAccount:
    """How a central-DP run's rounds are drawn and which accountant composes them."""

    sampling: str = DEFAULT_SAMPLING
    sampling_rate: float = 1.0       # q: clients.per_round / clients.expected
    expected: int = 0                # n, clients.expected: the fixed draw's RDP event needs it
    accountant: str = DEFAULT_ACCOUNTANT

    def __post_init__(self) -> None:
        if self.sampling not in SAMPLINGS:
            raise ValueError(f"privacy.sampling must be one of {', '.join(SAMPLINGS)}, got {self.sampling!r}")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"privacy.accountant must be one of {', '.join(ACCOUNTANTS)}, got {self.accountant!r}")
        if not 0 < self.sampling_rate <= 1:
            raise ValueError(f"the sampling rate must be in (0, 1], got {self.sampling_rate}")

    @property
    def sampled(self) -> bool:
        return self.sampling_rate < 1

    @property
    def per_device(self) -> bool:
        """Whether epsilon is a device's, over the rounds it was drawn in (a public draw), not the run's rounds."""
        return self.sampling == "seeded" and self.sampled

    @property
    def replace_one(self) -> bool:
        """Neighbouring fleets differ in one device's data replaced (a fixed-size draw), so sensitivities double."""
        return self.sampling == "fixed" and self.sampled

    @property
    def amplified(self) -> bool:
        return self.sampled and self.sampling != "seeded"

    def _gaussian(self, z: float) -> Any:
        import dp_accounting

        return dp_accounting.GaussianDpEvent(z / 2 if self.replace_one else z)

    def _rounds(self, rounds: int, z: float) -> Any:
        import dp_accounting

        if not self.amplified:
            step: Any = self._gaussian(z)
        elif self.replace_one and self.accountant == "rdp":
            step = dp_accounting.SampledWithoutReplacementDpEvent(
                self.expected, max(1, round(self.sampling_rate * self.expected)), self._gaussian(z))
        else:
            step = dp_accounting.PoissonSampledDpEvent(self.sampling_rate, self._gaussian(z))
        return dp_accounting.SelfComposedDpEvent(step, rounds)

    def event(self, rounds: int, noise_multiplier: float, releases: Sequence[float] = ()) -> Any | None:
        """The ``dp_accounting`` event of ``rounds`` rounds (a device's rounds under ``"seeded"``) at multiplier
        ``noise_multiplier`` and one unsampled release per multiplier in ``releases``; None when nothing ran."""
        import dp_accounting

        events = []
        if rounds > 0:
            events.append(self._rounds(rounds, noise_multiplier))
        if releases:
            events.append(dp_accounting.ComposedDpEvent([self._gaussian(z) for z in releases]))
        if not events:
            return None
        return events[0] if len(events) == 1 else dp_accounting.ComposedDpEvent(events)

    def epsilon(self, rounds: int, noise_multiplier: float, delta: float, releases: Sequence[float] = ()) -> float:
        """Epsilon at ``delta`` after ``rounds`` rounds and the unsampled ``releases`` (one account for all)."""
        if (rounds > 0 and noise_multiplier <= 0) or (releases and min(releases) <= 0):
            return math.inf
        return _cached_epsilon(self, rounds, float(noise_multiplier), float(delta), tuple(float(z) for z in releases))

    def noise_for(self, epsilon: float, rounds: int, delta: float, releases: Sequence[float] = ()) -> float:
        """The smallest noise multiplier whose account after ``rounds`` rounds and ``releases`` stays within
        ``epsilon`` at ``delta``, by this account's accountant."""
        if rounds < 1:
            raise ValueError(f"rounds must be at least 1, got {rounds}")
        if releases:
            alone = self.epsilon(0, 1.0, delta, releases)
            if alone >= epsilon:
                raise ValueError(f"the {len(releases)} release(s) alone spend epsilon {alone:.4g}, not less than the "
                                 f"target {epsilon:g}: raise their noise multiplier")
        return calibrate(lambda z: self.event(rounds, z, releases), epsilon, delta, self.accountant,
                         replace_one=self._rdp_replace_one)

    @property
    def _rdp_replace_one(self) -> bool:
        """dp_accounting's RDP takes a draw without replacement only under its replace-one relation."""
        return self.replace_one and self.accountant == "rdp"

    def describe(self) -> str:
        """One line for a row or a log: what this account assumes."""
        if not self.sampled:
            return f"every device every round, no amplification, {self.accountant.upper()}"
        how = {"poisson": f"Poisson sampling at q = {self.sampling_rate:g}, add or remove one",
               "fixed": f"a secret fixed-size draw at q = {self.sampling_rate:g}, replace one",
               "seeded": "a seeded draw every device can recompute: no amplification, each device's own rounds"}
        return f"{how[self.sampling]}, {self.accountant.upper()}"


@functools.lru_cache(maxsize=4096)
def _cached_epsilon(account: CentralAccount, rounds: int, noise_multiplier: float, delta: float,
                    releases: tuple[float, ...]) -> float:
    """One computation per distinct account: a round asks for the same figure when it checks the target and when
    it reports, and PLD composes in tens of milliseconds to a second."""
    event = account.event(rounds, noise_multiplier, releases)
    if event is None:
        return 0.0
    return epsilon_of(event, delta, account.accountant, replace_one=account._rdp_replace_one)
