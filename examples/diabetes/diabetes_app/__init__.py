"""A fedge app: disease progression one year on, regressed from ten clinical readings.

Written against fedge's app interface alone (``edge_client.app``). The data is scikit-learn's
diabetes set (442 patients): ``sklearn`` names the whole bundled set, any other location is a CSV
file of one device's patients, ten reading columns then the progression, as ``python -m
diabetes_app.split`` writes them. Targets are standardized (progression - 152) / 77 so that one
learning rate suits them; the metrics are in those units.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from edge_client.app import App, ExampleInput, Metric, Samples

__all__ = ["app", "load", "mae", "r2"]

MEAN, SCALE = 152.0, 77.0   # the progression's mean and spread over the bundled set


def model(options: Mapping[str, Any]) -> nn.Module:
    """A small MLP; ``[model] hidden`` sets its width."""
    hidden = int(options.get("hidden", 32))
    return nn.Sequential(nn.Linear(10, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def load(location: str) -> Samples:
    """``sklearn``: every patient of the bundled set; a path: a CSV of readings and progression."""
    if location == "sklearn":
        from sklearn.datasets import load_diabetes

        x, y = load_diabetes(return_X_y=True)
    else:
        table = np.loadtxt(location, delimiter=",", ndmin=2)
        if table.shape[1] != 11:
            raise ValueError(f"{location}: expected 11 columns (10 readings, the progression), found {table.shape[1]}")
        x, y = table[:, :10], table[:, 10]
    readings = torch.tensor(x, dtype=torch.float32) * 10   # the bundled readings are scaled to about +-0.1
    progression = (torch.tensor(y, dtype=torch.float32).unsqueeze(1) - MEAN) / SCALE
    return Samples(readings, progression)


def mae(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Mean absolute error, in standardized units (x 77 for the progression's own)."""
    return float((outputs - targets).abs().mean())


def r2(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """The share of the progression's variance the model explains."""
    return float(1 - ((outputs - targets) ** 2).sum() / ((targets - targets.mean()) ** 2).sum())


app = App(name="diabetes", version="1.0.0", model=model, example_input=ExampleInput((10,)), device_data=load,
          eval_data=load, loss=nn.functional.mse_loss, metrics={"mae": Metric(mae, higher_is_better=False),
                                                                 "r2": Metric(r2)},
          headline="r2", preprocessing={"readings": "x 10 (scikit-learn's scaled readings)",
                                        "output": "progression = 152 + 77 x output"})
