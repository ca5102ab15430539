"""The columns each phase of a round adds to the round's metrics row (``metrics.jsonl``).

The training phase gives the row its main columns (clients selected and returned, with
over-selection those counted and whether the round closed early, the sample-weighted
training loss, the slowest client, bytes per client and the float32 reference they are
measured against); any other phase (a personalized evaluation, a method's own step such
as matching one layer) adds its own, prefixed with its name.
"""

from __future__ import annotations

from typing import Any

from coordinator.runtime.round_book import RoundBook, Tally
from coordinator.strategies.base import ClientResult

__all__ = ["train_columns", "phase_columns"]


def train_columns(book: RoundBook, results: list[ClientResult], totals: Tally, fp32_model_bytes: int) -> dict[str, Any]:
    """The training phase's columns: ``book`` is its last attempt, ``results`` the ones aggregated,
    ``totals`` its traffic over all attempts."""
    n = sum(r.num_samples for r in results)
    selected = len(book.selected)
    slowest = max(book.profiles.items(), key=lambda kv: kv[1].get("seconds") or 0, default=(None, {}))
    # No device reports a loss under local DP (it would be a release without noise): no column then, not a 0.
    losses = ({"train_loss": sum(r.metrics.get("train_loss", 0.0) * r.num_samples for r in results) / n}
              if any("train_loss" in r.metrics for r in results) else {})
    # Over-selection (clients.over_select): the results counted, whether the round closed before every selected
    # device answered, and the devices it told so (their results arrive as ``late`` and ``late_closed``).
    over = ({"counted": len(results), "closed_early": bool(book.closed), "closed_clients": sorted(book.closed)}
            if book.close_at else {})
    return {
        "selected": selected, "returned": len(book.results), **over, "attempts": book.attempt + 1,
        "train_samples": n, **losses,
        "slowest_client": slowest[0], "slowest_seconds": slowest[1].get("seconds"),
        "skipped": book.skipped,
        "bytes_down_per_client": totals.bytes_down // max(selected, 1),
        "bytes_up_per_client": totals.bytes_up // max(len(book.results), 1),
        # the reference: the whole float32 model to and from every selected client
        "fp32_bytes_down": fp32_model_bytes * selected,
        "fp32_bytes_up": fp32_model_bytes * selected,
    }


def phase_columns(phase: str, book: RoundBook, totals: Tally) -> dict[str, Any]:
    """Any other phase's columns, named after it."""
    return {f"{phase}_selected": len(book.selected), f"{phase}_returned": len(book.results),
            f"{phase}_bytes_down": totals.bytes_down, f"{phase}_bytes_up": totals.bytes_up}
