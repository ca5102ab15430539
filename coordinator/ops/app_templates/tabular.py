"""A fedge app for a regression on table rows: ten readings in, one value out; MSE, with MAE and R^2.

Its data: ``sklearn`` is scikit-learn's bundled diabetes set (442 rows); any other location is a CSV
file, ten reading columns then the target. Replace ``load`` with your own reader and ``model`` with
your own network; keep ``app`` declaring them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from edge_client.app import App, ExampleInput, Metric, Samples

NAME = "tabular"
FEATURES = 10


def model(options: Mapping[str, Any]) -> nn.Module:
    hidden = int(options.get("hidden", 32))
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def load(location: str) -> Samples:
    if location == "sklearn":
        from sklearn.datasets import load_diabetes

        x, y = load_diabetes(return_X_y=True)
        x, y = x * 10, (y - 152.0) / 77.0   # readings to about +-1, the target standardized
    else:
        table = np.loadtxt(location, delimiter=",", ndmin=2)
        x, y = table[:, :FEATURES], table[:, FEATURES]
    return Samples(torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32).unsqueeze(1))


def mae(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    return float((outputs - targets).abs().mean())


def r2(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    return float(1 - ((outputs - targets) ** 2).sum() / ((targets - targets.mean()) ** 2).sum())


app = App(name=NAME, version="0.1.0", model=model, example_input=ExampleInput((FEATURES,)), device_data=load,
          eval_data=load, loss=nn.functional.mse_loss,
          metrics={"mae": Metric(mae, higher_is_better=False), "r2": Metric(r2)}, headline="r2")
