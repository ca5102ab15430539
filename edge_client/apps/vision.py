"""``vision``, fedge's own app: the ``mlp``, ``cnn`` and ``vgg9`` networks on square images with integer labels
(scikit-learn's ``digits``, Fashion-MNIST, or an npz of images), cross-entropy and accuracy.

It is declared like any user's app, with nothing the interface does not offer, so what works for it
works for theirs. Its model options are the model spec the coordinator builds (the network's name,
classes, channels, image size and normalization, and the methods' options).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from edge_client.app import App, ExampleInput, Metric, Samples, accuracy

__all__ = ["APP", "accuracy"]


def _fedge_version() -> str:
    """fedge's own version: the built-in app is versioned with the runtime that ships it."""
    try:
        return importlib.metadata.version("fedge")
    except importlib.metadata.PackageNotFoundError:   # a checkout on the path, not installed
        return "0+checkout"


def _model(options: Mapping[str, Any]) -> nn.Module:
    """fedge's own network, with every registered method's model hook, drawn from torch's global generator as
    every party's build is (the registry's path for a spec that names no other app)."""
    from edge_client.registry import build_builtin

    return build_builtin(options)


def _example_input(options: Mapping[str, Any]) -> ExampleInput:
    size = int(options["image_size"])
    return ExampleInput((int(options["in_channels"]), size, size))


def _device_data(location: str) -> Samples:
    """All of a device's own images (every row of its npz; the train split of a built-in data set), normalized
    as its data set says. The device's runtime path (edge_client/inputs.py) also keeps the pixels, to make
    the inputs again under a task's normalization, and applies simulation partitions; it stays the built-in
    app's path until device data is loaded through apps."""
    from edge_client.datasets import load_own_pixels

    pixels, labels, normalization = load_own_pixels(location)
    return Samples(torch.from_numpy(pixels.normalized(normalization)), torch.from_numpy(labels))


def _eval_data(location: str) -> Samples:
    from edge_client.datasets import load_dataset

    data = load_dataset(location, train=False)
    return Samples(torch.from_numpy(data.x_test), torch.from_numpy(data.y_test))


APP = App(
    name="vision",
    version=_fedge_version(),
    model=_model,
    example_input=_example_input,
    device_data=_device_data,
    eval_data=_eval_data,
    loss=F.cross_entropy,
    metrics={"accuracy": Metric(accuracy)},
    headline="accuracy",
    hooks={"features": "features", "head": "classifier"},
)
