"""Label histograms: the one fact about its data that some methods ask a device to report.

A device reports how many samples of each class it trained on as result metrics
``class_count/C`` (:func:`class_counts`); a coordinator weighs parts of the model by them
(Fed2's groups by their classes' samples, FedMA's classifier rows by class). Both sides
read them here, so the format has one definition.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["CLASS_COUNT", "class_counts", "counts_of", "histogram_problem", "label_histogram"]

CLASS_COUNT = "class_count/"   # result metrics "class_count/C": samples of class C the device trained on


def class_counts(y: torch.Tensor, num_classes: int) -> dict[str, float]:
    """The label histogram as result metrics: ``class_count/C`` for every class."""
    counts = torch.bincount(y.to(torch.int64), minlength=num_classes)
    return {f"{CLASS_COUNT}{c}": float(n) for c, n in enumerate(counts[:num_classes].tolist())}


def counts_of(metrics: Mapping[str, Any]) -> torch.Tensor | None:
    """The class counts in a result's metrics, in class order (float64); None if any class is missing."""
    keys = [k for k in metrics if k.startswith(CLASS_COUNT)]
    try:
        classes = sorted(int(k.removeprefix(CLASS_COUNT)) for k in keys)
    except ValueError:
        return None
    if not classes or classes != list(range(len(classes))):
        return None
    return torch.tensor([float(metrics[f"{CLASS_COUNT}{c}"]) for c in classes], dtype=torch.float64)


def histogram_problem(metrics: Mapping[str, Any], num_samples: int, num_classes: int) -> str | None:
    """Why a result's label histogram cannot be used, or None: one whole count >= 0 per class, adding up
    to its ``num_samples``; a coordinator rejects the result with this reason before weighing by it."""
    counts = counts_of(metrics)
    if counts is None or len(counts) != num_classes:
        return (f"the result must report its samples of each of the {num_classes} classes as metrics "
                f"{CLASS_COUNT}0, {CLASS_COUNT}1, ...")
    whole = bool((counts >= 0).all()) and bool((counts == counts.round()).all())
    if not whole or int(counts.sum()) != num_samples:
        return (f"the result's class counts must be whole numbers >= 0 that add up to its "
                f"{num_samples} samples, got {counts.tolist()}")
    return None


def label_histogram(metrics: Mapping[str, Any], client_id: str) -> torch.Tensor:
    """The class counts of a result :func:`histogram_problem` accepted."""
    counts = counts_of(metrics)
    if counts is None:
        raise ValueError(f"the result of {client_id} has no label histogram; check it with histogram_problem first")
    return counts
