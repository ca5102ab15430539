"""A fedge app for classifying sensor windows: 3-axis accelerometer windows of 64 readings, a 1-D CNN.

Its data: ``synthetic`` generates 600 windows of three activities (still: noise around gravity;
walking: a 2 Hz swing; running: a 4 Hz swing twice as large), separable by frequency and amplitude;
``synthetic:SEED`` another draw. Any other location is an npz file with ``x`` [N, 3, 64] and integer
labels ``y`` [N]. Replace ``load`` with your own reader and ``model`` with your own network.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from edge_client.app import App, ExampleInput, Metric, Samples, accuracy

NAME = "timeseries"
AXES, STEPS, CLASSES = 3, 64, 3


def model(options: Mapping[str, Any]) -> nn.Module:
    width = int(options.get("width", 16))
    return nn.Sequential(nn.Conv1d(AXES, width, 5, padding=2), nn.ReLU(), nn.MaxPool1d(4),
                         nn.Conv1d(width, width, 5, padding=2), nn.ReLU(), nn.AdaptiveAvgPool1d(1),
                         nn.Flatten(), nn.Linear(width, CLASSES))


def generate(seed: int, per_class: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """Windows of the three activities at 32 readings a second, with a random phase, axis mix and noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(STEPS) / 32.0
    xs, ys = [], []
    for label, (hz, swing) in enumerate(((0.0, 0.0), (2.0, 0.5), (4.0, 1.0))):
        phase = rng.uniform(0, 2 * math.pi, (per_class, 1, 1))
        mix = rng.normal(1.0, 0.2, (per_class, AXES, 1))
        wave = swing * mix * np.sin(2 * math.pi * hz * t + phase)
        xs.append(wave + np.array([0.0, 0.0, 1.0])[None, :, None] + rng.normal(0, 0.15, (per_class, AXES, STEPS)))
        ys.append(np.full(per_class, label))
    return np.concatenate(xs).astype(np.float32), np.concatenate(ys).astype(np.int64)


def load(location: str) -> Samples:
    kind, _, seed = location.partition(":")
    if kind == "synthetic":
        x, y = generate(int(seed or 0))
    else:
        with np.load(location, allow_pickle=False) as arrays:
            x, y = arrays["x"].astype(np.float32), arrays["y"].astype(np.int64)
    return Samples(torch.from_numpy(x), torch.from_numpy(y))


app = App(name=NAME, version="0.1.0", model=model, example_input=ExampleInput((AXES, STEPS)), device_data=load,
          eval_data=load, loss=nn.functional.cross_entropy, metrics={"accuracy": Metric(accuracy)},
          headline="accuracy")
