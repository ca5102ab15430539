"""Fed2 on the device: ordinary training that also reports the label histogram it trained on.

That histogram is the one extra fact a Fed2 device reveals: the coordinator weights
each group of the feature-aligned model (:mod:`methods.fed2.model`) by
the device's samples of that group's classes (:mod:`coordinator.strategies.fed2`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from edge_client.objectives import LocalData, Objective, ObjectiveOutput, TaskContext, train

__all__ = ["fed2_train", "class_counts", "CLASS_COUNT", "OBJECTIVES"]

CLASS_COUNT = "class_count/"   # result metrics "class_count/C": samples of class C the device trained on


def class_counts(y: torch.Tensor, num_classes: int) -> dict[str, float]:
    """The label histogram as result metrics: ``class_count/C`` for every class."""
    counts = torch.bincount(y.to(torch.int64), minlength=num_classes)
    return {f"{CLASS_COUNT}{c}": float(n) for c, n in enumerate(counts[:num_classes].tolist())}


def fed2_train(model: nn.Module, data: LocalData, hyper: Mapping[str, Any], ctx: TaskContext) -> ObjectiveOutput:
    """Local training, reporting how many samples of each class it trained on (Fed2's group weights)."""
    out = train(model, data, hyper, ctx)
    num_classes = int(model.classifier.out_features)
    return ObjectiveOutput(out.num_samples, {**out.metrics, **class_counts(data.y, num_classes)}, out.tensors)


OBJECTIVES: dict[str, Objective] = {"fed2_train": fed2_train}
