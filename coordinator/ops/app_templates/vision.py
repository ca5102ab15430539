"""A fedge app for classifying camera images: 3-channel 32x32 pictures of three shapes, a small CNN.

Its data: ``synthetic`` draws 600 pictures of a filled square, a ring and diagonal stripes, each in a
random colour and place on a noisy background; ``synthetic:SEED`` another draw. Any other location is
an npz file with ``x`` [N, 3, 32, 32] (uint8 0..255 or float 0..1) and integer labels ``y`` [N]. Replace
``load`` with your own reader (a directory of JPEGs, say) and ``model`` with your own network (a
MobileNet from torchvision as this package's own dependency).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from edge_client.app import App, ExampleInput, Metric, Samples, accuracy

NAME = "vision"
SIZE, CLASSES = 32, 3


def model(options: Mapping[str, Any]) -> nn.Module:
    width = int(options.get("width", 16))
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(2 * width, CLASSES))


def generate(seed: int, per_class: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """Pictures of the three shapes, 10 to 14 pixels across, in a random colour and place, with noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE]
    images, labels = [], []
    for label in range(CLASSES):
        for _ in range(per_class):
            half = rng.integers(5, 8)
            cy, cx = rng.integers(half, SIZE - half, 2)
            if label == 0:
                mask = (abs(yy - cy) <= half) & (abs(xx - cx) <= half)
            elif label == 1:
                mask = abs(np.hypot(yy - cy, xx - cx) - half) <= 1.5
            else:
                mask = (((yy + xx) // 3) % 2 == 0) & (abs(yy - cy) <= half) & (abs(xx - cx) <= half)
            colour = rng.uniform(0.5, 1.0, (3, 1, 1))
            picture = rng.normal(0.2, 0.08, (3, SIZE, SIZE)) + mask[None] * colour
            images.append(np.clip(picture, 0, 1))
            labels.append(label)
    return np.stack(images).astype(np.float32), np.array(labels, dtype=np.int64)


def load(location: str) -> Samples:
    kind, _, seed = location.partition(":")
    if kind == "synthetic":
        x, y = generate(int(seed or 0))
    else:
        with np.load(location, allow_pickle=False) as arrays:
            x, y = arrays["x"], arrays["y"].astype(np.int64)
        x = x.astype(np.float32) / (255.0 if x.dtype == np.uint8 else 1.0)
    return Samples(torch.from_numpy(x), torch.from_numpy(y))


app = App(name=NAME, version="0.1.0", model=model, example_input=ExampleInput((3, SIZE, SIZE)), device_data=load,
          eval_data=load, loss=nn.functional.cross_entropy, metrics={"accuracy": Metric(accuracy)},
          headline="accuracy", preprocessing={"pixels": "RGB, scaled to 0..1"})
