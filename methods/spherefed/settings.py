"""The ``[spherefed]`` and ``[ffc]`` config sections, apart from the strategy (which imports torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from coordinator.config import RunConfig

SPHEREFED = "spherefed"
FEDAVG_FFC = "fedavg_ffc"
STAT_DTYPES = ("float64", "float32")   # ffc.dtype: the statistics' precision on the wire (device.WIRE_DTYPES)

__all__ = ["SphereFedSection", "FfcSection", "planned_passes", "SPHEREFED", "FEDAVG_FFC", "STAT_DTYPES"]


@dataclass(frozen=True)
class SphereFedSection:
    """``[spherefed]``: local training of SphereFed (docs/spherefed.md)."""

    mu: float = 0.0                 # FedProx's proximal weight in local training (0: off)
    # Keys it no longer reads, and where they went: run files written with them still re-run (bench/reproduce.py).
    renamed: ClassVar[dict[str, str]] = {"lr_schedule": "schedule.lr"}

    def checks(self, config: RunConfig) -> list[tuple[bool, str]]:
        return [(self.mu >= 0, "spherefed.mu must be >= 0")]



@dataclass(frozen=True)
class FfcSection:
    """``[ffc]``: SphereFed's Fast Federated Calibration of the classifier (docs/spherefed.md)."""

    enabled: bool = True            # calibrate SphereFed's classifier after the last round
    every: int = 0                  # ... and every this many rounds (0: only after the last); training continues
                                # against the fixed classifier
    ridge: float = 0.0              # lambda in W^T = (G + lambda I)^-1 B; a singular G falls back to a small one,
                                # logged
    dtype: str = "float64"          # statistics on the wire: float64 (exact) or float32 (half the bytes)
    personalize: bool = False       # clients also solve their own classifier (kept in their state dir), scored locally
                                # on their held-out split (needs data.local_test_fraction > 0 with spawned clients);
                                # fedge-export --client-state exports it
    # Under privacy.mode = "central": the L2 bound on one device's statistics, its packed G and B taken as one vector
    # (each unit feature adds at most sqrt(2), so a device's grows with its samples), and z_ffc: the noise on their
    # sum has std noise_multiplier x clip (docs/privacy.md, "FFC's sums under DP").
    clip: float = 300.0
    noise_multiplier: float = 1.0

    def checks(self, config: RunConfig) -> list[tuple[bool, str]]:
        return [
            (self.every >= 0 and self.ridge >= 0, "ffc.every and ffc.ridge must be >= 0"),
            (self.enabled or self.every == 0, "ffc.every needs ffc.enabled = true"),
            (self.dtype in STAT_DTYPES, "ffc.dtype must be float64 or float32"),
            (not self.personalize or config.data.local_test_fraction > 0 or config.clients.spawn == 0,
             "ffc.personalize needs data.local_test_fraction > 0 for spawned clients"),
            *self._fedavg_checks(config),
            *self._privacy_checks(config),
        ]

    def _privacy_checks(self, config: RunConfig) -> list[tuple[bool, str]]:
        """What FFC's pass can run with under differential privacy or secure aggregation (docs/privacy.md):
        central DP, with the pass's own bound and noise; not local DP or secure aggregation (the statistics
        would leave a device without noise or outside the masked sum), not personal classifiers (each device's
        accuracy reported without noise)."""
        p = config.privacy
        if config.run.strategy not in (SPHEREFED, FEDAVG_FFC) or not self.enabled:
            return []
        checks = [
            (not config.secagg.enabled,
             "secagg.enabled = true cannot run FFC's calibration pass (ffc.enabled = true): each device's feature "
             "statistics would leave it outside the masked sum; use privacy.mode = 'central' without secagg, or "
             "ffc.enabled = false"),
            (p.mode != "local",
             "privacy.mode = 'local' cannot run FFC's calibration pass (ffc.enabled = true): each device's feature "
             "statistics would leave it without noise; use privacy.mode = 'central' or ffc.enabled = false"),
        ]
        if p.mode != "central":
            return checks
        need = "privacy.mode = 'central' with FFC needs"
        checks += [
            (math.isfinite(self.clip) and self.clip > 0,
             f"ffc.clip must be a positive number (the L2 bound on a device's FFC statistics), got {self.clip}"),
            (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0,
             f"ffc.noise_multiplier must be >= 0 (0: no noise on the FFC sums, no privacy), "
             f"got {self.noise_multiplier}"),
            (not self.personalize, f"{need} ffc.personalize = false: each device's own classifier is scored on its "
                                   "data and reported without noise"),
        ]
        if all(ok for ok, _ in checks) and p.target_epsilon > 0 and config.privacy.noise_multiplier > 0:
            from coordinator.privacy import CentralPrivacy   # the account's figures: only for a target to check

            planned = planned_passes(self, 1, config.run.rounds)
            privacy = CentralPrivacy.from_config(config)
            eps = privacy.epsilon(config.run.rounds, [self.noise_multiplier] * planned) if privacy is not None else 0.0
            checks.append((eps <= p.target_epsilon,
                           f"privacy.target_epsilon = {p.target_epsilon:g} is below the {eps:.4g} that run.rounds = "
                           f"{config.run.rounds} and {planned} FFC pass(es) spend, and a run the target stops early "
                           "is never calibrated: raise privacy.noise_multiplier or ffc.noise_multiplier, "
                           "or lower run.rounds (fedge-coordinator privacy --release-noise says what a pass costs)"))
        return checks

    def _fedavg_checks(self, config: RunConfig) -> list[tuple[bool, str]]:
        """FedAvg + FFC calibrates once, after the last round, the global model only."""
        if config.run.strategy != FEDAVG_FFC:
            return []
        return [
            (self.enabled, f"run.strategy = {FEDAVG_FFC!r} is FedAvg with FFC: it needs ffc.enabled = true "
                           "(for FedAvg without calibration use run.strategy = 'fedavg')"),
            (self.every == 0, f"run.strategy = {FEDAVG_FFC!r} calibrates once, after the last round: set "
                              "ffc.every = 0 (its calibrated model ends in a sphere head, which FedAvg does not "
                              "train on)"),
            (not self.personalize, f"run.strategy = {FEDAVG_FFC!r} calibrates the global model only: set "
                                   "ffc.personalize = false (personal classifiers need run.strategy = 'spherefed')"),
        ]


def planned_passes(ffc: FfcSection, first: int, last: int) -> int:
    """FFC passes in rounds ``first`` to ``last`` (the run's last), as :meth:`FfcPhase.calibrates` runs them."""
    if not ffc.enabled or last < first:
        return 0
    return sum(1 for r in range(first, last + 1) if r == last or (ffc.every > 0 and r % ffc.every == 0))
