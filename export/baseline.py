"""How an exported model compares with the model its run started from, so that a worse one is never shipped unsaid.

A run evaluates its initial model before round 1 (``metrics.jsonl``'s round 0 row) on the same test split the
export measures on. A model whose test accuracy ends below that one is worse than the random start: training
diverged, or noise (central DP on a small fleet, docs/privacy.md) drowned it. The export still writes it (the
file may be wanted for a diagnosis), but says so in its log and on its card.
"""

from __future__ import annotations

from typing import Any

from export.source import RunSource

__all__ = ["against_start"]


def against_start(test_accuracy: float, source: RunSource, data_spec: str) -> dict[str, Any] | None:
    """The card's ``initial_model`` entry: round 0's test accuracy, the change to ``test_accuracy`` and whether the
    exported model is worse (with the ``warning`` to show); None when the run recorded no round-0 accuracy or the
    export measured on other data than the run's."""
    initial = source.initial.get("test_accuracy")
    if not isinstance(initial, (int, float)) or isinstance(initial, bool) or data_spec != source.data_spec:
        return None
    entry: dict[str, Any] = {"round": 0, "test_accuracy": float(initial),
                             "accuracy_change": test_accuracy - float(initial), "worse": test_accuracy < initial}
    if entry["worse"]:
        entry["warning"] = (f"this model is worse than the one its run started from: test accuracy {test_accuracy:.4f} "
                            f"against {initial:.4f} for the initial model (round 0 of the run){_noise(source)}; "
                            "look at the run's rows (train_loss, failed) before deploying it")
    return entry


def _noise(source: RunSource) -> str:
    """Under central DP, the noise the exported round's mean update took against the clip norm, from its row."""
    std, clip = source.metrics.get("dp_noise_std"), source.metrics.get("dp_clip_norm")
    if source.metrics.get("dp_mode") != "central" or not isinstance(std, (int, float)) or not clip:
        return ""
    return (f"; central DP added noise of std {std / clip:.3g} x the clip norm to each round's mean update "
            "(docs/privacy.md: from 0.1 it swamps the update)")
