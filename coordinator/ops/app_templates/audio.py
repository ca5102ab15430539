"""A fedge app for spotting keywords: 40 x 32 log-mel-like features of one second of audio, a small CNN.

Its data: ``synthetic`` draws 600 feature maps of four "keywords", each a pitch contour through time
(rising, falling, steady high, two alternating tones) with its harmonics, a random speaker shift and
noise; ``synthetic:SEED`` another draw. Any other location is an npz file with ``x`` [N, 1, 40, 32]
features and integer labels ``y`` [N]. Replace ``load`` with your own feature extraction (torchaudio as
this package's own dependency) and ``model`` with your own network.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from edge_client.app import App, ExampleInput, Metric, Samples, accuracy

NAME = "audio"
BANDS, FRAMES, CLASSES = 40, 32, 4


def model(options: Mapping[str, Any]) -> nn.Module:
    width = int(options.get("width", 16))
    return nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(width, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(width, CLASSES))


def _contour(label: int, t: np.ndarray) -> np.ndarray:
    """The keyword's pitch (as a mel band) at each frame."""
    if label == 0:
        return 6 + 12 * t                       # rising
    if label == 1:
        return 18 - 12 * t                      # falling
    if label == 2:
        return np.full_like(t, 16.0)            # steady high
    return np.where((t * 4).astype(int) % 2 == 0, 6.0, 14.0)   # two alternating tones


def generate(seed: int, per_class: int = 150) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    t = np.linspace(0, 1, FRAMES)
    bands = np.arange(BANDS)[:, None]
    maps, labels = [], []
    for label in range(CLASSES):
        for _ in range(per_class):
            pitch = _contour(label, t)[None, :] + rng.normal(0, 1.5)   # the speaker's own pitch
            energy = sum(np.exp(-((bands - k * pitch) ** 2) / 4.0) / k for k in (1, 2))
            maps.append(np.log1p(3 * energy + rng.gamma(1.0, 0.1, (BANDS, FRAMES)))[None])
            labels.append(label)
    return np.stack(maps).astype(np.float32), np.array(labels, dtype=np.int64)


def load(location: str) -> Samples:
    kind, _, seed = location.partition(":")
    if kind == "synthetic":
        x, y = generate(int(seed or 0))
    else:
        with np.load(location, allow_pickle=False) as arrays:
            x, y = arrays["x"].astype(np.float32), arrays["y"].astype(np.int64)
    return Samples(torch.from_numpy(x), torch.from_numpy(y))


app = App(name=NAME, version="0.1.0", model=model, example_input=ExampleInput((1, BANDS, FRAMES)), device_data=load,
          eval_data=load, loss=nn.functional.cross_entropy, metrics={"accuracy": Metric(accuracy)},
          headline="accuracy", preprocessing={"features": "log(1 + mel energy), 40 bands x 32 frames a second"})
