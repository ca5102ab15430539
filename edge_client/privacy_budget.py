"""A device's own privacy budget under local differential privacy: the device, not the coordinator, decides.

Under ``privacy.mode = "local"`` the task says how much noise the device adds (``upload.noise_multiplier``)
and the coordinator keeps an account per device; a coordinator that lied (no noise, a tiny multiplier, or
task after task) could spend a device's privacy and report otherwise. A device given a budget
(``fedge-client run --privacy-budget EPSILON``) keeps its own ledger of every noisy update it released, in
its state directory, across runs and restarts, and refuses, with a reason the coordinator logs:

- any task whose result would carry something about its data without its own noise (no
  ``upload.noise_multiplier``: plain training, evaluation, statistics, secure-aggregation stages);
- a noise multiplier below its floor (``--min-noise-multiplier``);
- a task that would take its epsilon, at its delta, past the budget (the same account as the
  coordinator's default, PLD, :mod:`edge_client.privacy_account`, composed over the multipliers it actually
  used; a coordinator set to the looser RDP accountant stops its run before the device's budget refuses).

A release is written to the ledger (atomically, on disk) before the result is sent; a ledger that cannot
be written or read stops the device from sending anything. A task already in the ledger (a repeat of
one sent) is not counted twice.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_client.privacy_account import MISSING_ACCOUNTANT, epsilon_of, local_event
from storage.errors import FedgeError
from storage.files import write_atomic

__all__ = ["BudgetSettings", "PrivacyBudget", "PrivacyBudgetError", "LEDGER_FILE"]

LEDGER_FILE = "privacy-ledger.json"


class PrivacyBudgetError(FedgeError, ValueError):
    """A task this device's privacy budget refuses, or a ledger it cannot trust; nothing is sent.

    ``final``: every further task of the run would be refused too (the run's tasks carry no noise, or too
    little, or the budget is spent), so the device withdraws from it; a ledger that could not be written
    is not final."""

    def __init__(self, message: str, *, final: bool = False) -> None:
        super().__init__(message)
        self.final = final


@dataclass(frozen=True)
class BudgetSettings:
    """What the device holds itself to: epsilon at delta over everything it ever releases, and a floor on z."""

    epsilon: float
    delta: float = 1e-5
    min_noise_multiplier: float = 0.0

    def __post_init__(self) -> None:
        if not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise PrivacyBudgetError(f"the privacy budget must be a positive epsilon, got {self.epsilon}")
        if not 0 < self.delta < 1:
            raise PrivacyBudgetError(f"the privacy delta must be in (0, 1), well below 1 / the fleet's size; "
                                     f"got {self.delta}")
        if not (self.min_noise_multiplier >= 0 and math.isfinite(self.min_noise_multiplier)):
            raise PrivacyBudgetError(f"the minimum noise multiplier must be a number >= 0, got "
                                     f"{self.min_noise_multiplier}")


class PrivacyBudget:
    """The ledger in ``state_dir`` and the checks made against it before a task runs and before it is sent."""

    def __init__(self, settings: BudgetSettings, state_dir: Path | None) -> None:
        if state_dir is None:
            raise PrivacyBudgetError("a privacy budget needs a state directory to keep its ledger in "
                                     "(--state-dir): a budget forgotten at each restart would bound nothing")
        try:
            import dp_accounting  # noqa: F401
        except ImportError:
            raise PrivacyBudgetError(MISSING_ACCOUNTANT) from None
        self.settings = settings
        self.path = Path(state_dir) / LEDGER_FILE
        self.releases = self._read()

    def _read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        try:
            releases = json.loads(self.path.read_text(encoding="utf-8"))["releases"]
            if not isinstance(releases, list) or not all(
                    isinstance(r, dict) and isinstance(r.get("task"), str) and isinstance(r.get("z"), (int, float))
                    and math.isfinite(r["z"]) and r["z"] >= 0 for r in releases):
                raise ValueError("a release without a task id or a noise multiplier")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PrivacyBudgetError(f"the privacy ledger {self.path} cannot be read ({exc}); this device will "
                                     "not release anything it cannot account: restore the file from a backup "
                                     "(deleting it forgets what was spent)") from None
        return releases

    def spent(self, extra: float | None = None) -> float:
        """Epsilon at the budget's delta over the ledger, with one more release at multiplier ``extra``."""
        counts = Counter(float(r["z"]) for r in self.releases)
        if extra is not None:
            counts[float(extra)] += 1
        if not counts:
            return 0.0
        if 0.0 in counts:
            return math.inf
        return epsilon_of(local_event(counts), self.settings.delta)

    def counted(self, task_id: str) -> bool:
        return any(r["task"] == task_id for r in self.releases)

    def refusal(self, task_id: str, objective: str, noise_multiplier: float | None) -> str | None:
        """Why this device will not run the task, or None."""
        s = self.settings
        if noise_multiplier is None:
            return (f"this device keeps a privacy budget (epsilon {s.epsilon:g} at delta {s.delta:g}) and sends "
                    f"only updates it adds its own noise to; a {objective!r} task without upload.noise_multiplier "
                    "would release its data without it: run the coordinator with privacy.mode = 'local'")
        if noise_multiplier < s.min_noise_multiplier:
            return (f"upload.noise_multiplier {noise_multiplier:g} is below this device's floor of "
                    f"{s.min_noise_multiplier:g}: raise privacy.noise_multiplier on the coordinator")
        if self.counted(task_id):
            return None
        after = self.spent(noise_multiplier)   # one account per task; the one without it only to say why
        if after > s.epsilon:
            return (f"this device's privacy budget is spent: one more update at noise multiplier "
                    f"{noise_multiplier:g} would take its epsilon from {self.spent():.4g} to {after:.4g}, past its "
                    f"budget of {s.epsilon:g} at delta {s.delta:g} ({len(self.releases)} updates released)")
        return None

    def record(self, task_id: str, run_id: str, round: int, noise_multiplier: float) -> None:
        """Write the release down before it is sent; a ledger that cannot be written stops the send."""
        if self.counted(task_id):
            return
        release = {"task": task_id, "run": run_id, "round": round, "z": float(noise_multiplier), "time": time.time()}
        try:
            write_atomic(self.path, json.dumps({"releases": [*self.releases, release]}, indent=1).encode("utf-8"))
        except OSError as exc:
            raise PrivacyBudgetError(f"could not write the privacy ledger {self.path} ({exc}); the update was not "
                                     "sent") from None
        self.releases.append(release)
