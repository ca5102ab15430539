"""Fed2 on the device: ordinary training that also reports the label histogram it trained on.

That histogram is the one extra fact a Fed2 device reveals: the coordinator weights
each group of the feature-aligned model (:mod:`methods.fed2.model`) by
the device's samples of that group's classes (:mod:`methods.fed2.strategy`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from edge_client.objectives import LocalData, Objective, ObjectiveOutput, TaskContext, train
from methods.common import class_counts

__all__ = ["fed2_train", "OBJECTIVES"]


def fed2_train(model: nn.Module, data: LocalData, hyper: Mapping[str, Any], ctx: TaskContext) -> ObjectiveOutput:
    """Local training, reporting how many samples of each class it trained on (Fed2's group weights)."""
    out = train(model, data, hyper, ctx)
    num_classes = int(model.classifier.out_features)
    return ObjectiveOutput(out.num_samples, {**out.metrics, **class_counts(data.y, num_classes)}, out.tensors)


OBJECTIVES: dict[str, Objective] = {"fed2_train": fed2_train}
