"""The checks around a phase's aggregation: the norm bound before it, finiteness after it, divergence under DP.

The norm bound (``aggregate.norm_bound``, :mod:`coordinator.aggregation`) drops results
whose update is far larger than the round's median; a non-finite aggregate ends the run
before it is checkpointed or sent, saying what to change. A private training round whose
devices' training diverged ends the run naming the noise the coordinator added, which is
what diverges a small fleet's model far more often than the learning rate.
"""

from __future__ import annotations

import logging

import torch

from coordinator.aggregation import norm_bound_keep, update_norms
from coordinator.config import RunConfig
from coordinator.privacy import CentralPrivacy
from coordinator.privacy_noise import divergence_note
from coordinator.runtime.round_book import RoundNotes
from coordinator.runtime.run_error import RunError
from coordinator.strategies.base import ClientResult
from storage.state import ServerState

__all__ = ["within_norm_bound", "check_finite", "check_private_divergence"]

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


def check_private_divergence(config: RunConfig, state: ServerState, notes: RoundNotes, round: int, *, got: int,
                             needed: int) -> None:
    """Under central DP, a training round with fewer than ``needed`` results because every device that failed
    or was refused had its training diverge ends the run here, naming the noise on the mean against the clip norm:
    the model the devices trained on is the last noisy release, and a private round is never run again."""
    privacy = CentralPrivacy.from_config(config)
    diverged = notes.diverged()
    if privacy is None or got >= needed or not diverged:
        return
    first, why = diverged[0]
    what = why.split(";")[0]   # what happened, without the device's advice (it cannot know the coordinator's noise)
    raise RunError(f"round {round}: the local training of {len(diverged)} device(s) diverged (first: {first}: {what}) "
                   f"on the model the private rounds so far released; "
                   f"{divergence_note(privacy, privacy.kept(state)[0], config.run.rounds)}")
