"""The checks around a phase's aggregation: the norm bound before it, finiteness after it.

The norm bound (``aggregate.norm_bound``, :mod:`coordinator.aggregation`) drops results
whose update is far larger than the round's median; a non-finite aggregate ends the run
before it is checkpointed or sent, saying what to change.
"""

from __future__ import annotations

import logging

import torch

from coordinator.aggregation import norm_bound_keep, update_norms
from coordinator.runtime.run_error import RunError
from coordinator.strategies.base import ClientResult
from storage.state import ServerState

__all__ = ["within_norm_bound", "check_finite"]

log = logging.getLogger("fedge.coordinator")


def within_norm_bound(results: list[ClientResult], bound: float, round: int) -> tuple[list[ClientResult], list[str]]:
    """The results whose update norm is within ``bound`` x the round's median, and the ids of the others
    (rejected before aggregation, and logged)."""
    keep = norm_bound_keep(update_norms([r.deltas for r in results]), bound)
    dropped = [r.client_id for r, ok in zip(results, keep) if not ok]
    if dropped:
        log.warning("round %d: rejected %d update(s) above %.3g x the median norm: %s", round,
                    len(dropped), bound, ", ".join(dropped))
    return [r for r, ok in zip(results, keep) if ok], dropped


def check_finite(state: ServerState, round: int, phase: str, rule: str) -> None:
    """A non-finite aggregate ends the run here, saying so: every device would refuse it as a broadcast
    or train it into NaN results, and the run would end later blaming the round timeout."""
    bad = sorted(name for name, tensor in state.params.items() if not bool(torch.isfinite(tensor).all()))
    if bad:
        hint = ("one or a few results large enough to overflow the mean, typically hostile or broken devices: "
                "set aggregate.rule (median, trimmed_mean) or aggregate.norm_bound" if rule == "mean"
                else f"every result was finite, yet aggregate.rule = {rule!r} produced this")
        raise RunError(f"round {round} ({phase}) aggregated to a model with NaN or infinite values in "
                       f"{', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}; it was not checkpointed or sent: "
                       f"{hint}; resume from the last checkpoint once fixed")
