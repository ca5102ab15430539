"""A fedge app: five hand gestures told apart from 2 s of 3-axis accelerometer readings by a small GRU.

Written against fedge's app interface alone (``edge_client.app``). A sample is a window of 100 readings
(50 Hz, 2 s) of the x, y and z axes in g, batch first: ``[N, 100, 3]`` float32; its label is one of
:data:`GESTURES`. The data is generated (:mod:`gestures_app.data`, the README says how): ``synthetic``
names the generated evaluation set (fixed seed) for ``eval_data`` and a generated training pool (other
seeds, other devices) for ``device_data``; any other location is an npz file with ``x`` [N, 100, 3] and
``y`` [N], as ``python -m gestures_app.make_data`` writes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from edge_client.app import App, ExampleInput, Metric, Samples, accuracy
from gestures_app.data import AXES, GESTURES, SAMPLE_RATE_HZ, STEPS, eval_set, training_pool

__all__ = ["app", "GestureGRU", "macro_f1", "read_npz", "GESTURES"]

SYNTHETIC = "synthetic"


class GestureGRU(nn.Module):
    """A GRU stepping through the window frame by frame, then a linear head on its last hidden state.

    The window is first centred (each axis less its mean over the window: gravity, however the device is
    held, and the sensor's offsets go), then cut into frames of ``frame`` readings (10: 200 ms, 30 inputs
    a step, 10 steps); ``frame=1`` steps through every reading, at 5 to 8 times the cost a round and with
    more rounds to learn (README)."""

    def __init__(self, hidden: int = 32, layers: int = 1, frame: int = 10) -> None:
        super().__init__()
        if frame < 1 or STEPS % frame:
            raise ValueError(f"[model] frame must divide the window's {STEPS} readings, got {frame}")
        self.frame = frame
        self.gru = nn.GRU(AXES * frame, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, len(GESTURES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [batch, STEPS, AXES] -> [batch, classes]
        x = x - x.mean(dim=1, keepdim=True)
        steps, _ = self.gru(x.reshape(-1, STEPS // self.frame, AXES * self.frame))
        return self.head(steps[:, -1])


def model(options: Mapping[str, Any]) -> nn.Module:
    """``[model] hidden`` (default 32), ``layers`` (1) and ``frame`` (10 readings a GRU step) set its size."""
    return GestureGRU(int(options.get("hidden", 32)), int(options.get("layers", 1)), int(options.get("frame", 10)))


def read_npz(location: str) -> Samples:
    """An npz file's ``x`` [N, 100, 3] float32 windows and ``y`` [N] gesture indices; ValueError naming the fix."""
    with np.load(location, allow_pickle=False) as arrays:
        missing = {"x", "y"} - set(arrays.files)
        if missing:
            raise ValueError(f"{location}: no array {sorted(missing)}; write it with python -m gestures_app.make_data")
        x, y = arrays["x"], arrays["y"]
    if x.ndim != 3 or x.shape[1:] != (STEPS, AXES) or y.shape != (len(x),):
        raise ValueError(f"{location}: x must be [N, {STEPS}, {AXES}] and y [N], got {x.shape} and {y.shape}")
    if y.size and (y.min() < 0 or y.max() >= len(GESTURES)):
        raise ValueError(f"{location}: labels must be 0..{len(GESTURES) - 1} ({', '.join(GESTURES)})")
    return Samples(torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.int64)))


def device_data(location: str) -> Samples:
    """A device's windows: an npz file, or ``synthetic`` (the generated training pool, for simulations)."""
    if location == SYNTHETIC:
        x, y = training_pool()
        return Samples(torch.from_numpy(x), torch.from_numpy(y))
    return read_npz(location)


def eval_data(location: str) -> Samples:
    """The coordinator's windows: an npz file, or ``synthetic`` (the generated evaluation set, fixed seed)."""
    if location == SYNTHETIC:
        x, y = eval_set()
        return Samples(torch.from_numpy(x), torch.from_numpy(y))
    return read_npz(location)


def macro_f1(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """The mean over gestures of each one's F1 (2 TP / (2 TP + FP + FN)), counting the gestures that are among
    the targets or the predictions: a gesture the model never gets right weighs as much as a common one."""
    classes = outputs.shape[1]
    predicted = outputs.argmax(1)
    hits = torch.bincount(targets[predicted == targets], minlength=classes).double()
    seen = torch.bincount(predicted, minlength=classes).double() + torch.bincount(targets, minlength=classes).double()
    present = seen > 0
    return float((2 * hits[present] / seen[present]).mean()) if bool(present.any()) else 0.0


app = App(
    name="gestures", version="1.0.0", model=model, example_input=ExampleInput((STEPS, AXES)),
    device_data=device_data, eval_data=eval_data, loss=nn.functional.cross_entropy,
    metrics={"accuracy": Metric(accuracy), "macro_f1": Metric(macro_f1)}, headline="macro_f1",
    preprocessing={"sample_rate_hz": SAMPLE_RATE_HZ, "window_steps": STEPS, "window_seconds": STEPS / SAMPLE_RATE_HZ,
                   "layout": "[batch, time, axis], float32", "axes": ["x", "y", "z"],
                   "units": "g (9.81 m/s^2), gravity included, no filtering or scaling",
                   "classes": list(GESTURES)},
)
