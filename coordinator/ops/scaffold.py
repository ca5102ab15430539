"""``fedge-coordinator new``: a new app package from one of fedge's templates, ready to train at once.

A template is a module of :mod:`coordinator.ops.app_templates`: a working app written against the app
interface alone, whose data needs no download. The new package is that module as its ``__init__``, under
the new app's name, with a ``pyproject.toml`` that registers it for devices (the ``fedge.apps`` entry
point), a test, and a README saying how to train it.
"""

from __future__ import annotations

import importlib.resources
import re
from pathlib import Path

from storage.errors import FedgeError

__all__ = ["TEMPLATES", "DEVICE_DATA", "ScaffoldError", "write_app", "train_command"]

# template -> (what it is, the --data its generated or bundled set loads from, the training settings that
# suit it: measured with 3 devices in one process over 10 rounds)
TEMPLATES: dict[str, tuple[str, str, dict[str, float]]] = {
    "tabular": ("a regression on table rows: MSE, with MAE and R^2 (scikit-learn's diabetes set)", "sklearn",
                {"train.lr": 0.05}),
    "timeseries": ("a 1-D CNN classifying 3-axis accelerometer windows (a generated, separable set)", "synthetic",
                   {"train.lr": 0.05}),
    "vision": ("a small CNN classifying 3-channel 32x32 pictures of shapes (a generated set)", "synthetic",
               {"train.lr": 0.1, "train.epochs": 3}),
    "audio": ("a small CNN spotting four keywords in log-mel-like features (a generated set)", "synthetic",
              {"train.lr": 0.2, "train.epochs": 3}),
}
# template -> what a device of a real fleet gives as --data: each device its own samples
_OWN_DRAW = ("or `synthetic:N` with another N on each device (a generated set of its own, to try a fleet without "
             "data)")
DEVICE_DATA: dict[str, str] = {
    "tabular": "a CSV file of its own rows (the ten readings, then the target)",
    "timeseries": f"an npz file of its own windows (`x` [N, 3, 64], integer labels `y` [N]), {_OWN_DRAW}",
    "vision": f"an npz file of its own pictures (`x` [N, 3, 32, 32], integer labels `y` [N]), {_OWN_DRAW}",
    "audio": f"an npz file of its own feature maps (`x` [N, 1, 40, 32], integer labels `y` [N]), {_OWN_DRAW}",
}
_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")


class ScaffoldError(FedgeError, ValueError):
    """A name, template or destination ``new`` cannot use; the message says which."""


def write_app(name: str, template: str, parent: Path) -> Path:
    """Write the package ``parent/name`` from ``template``; its directory."""
    if not _NAME.fullmatch(name):
        raise ScaffoldError(f"app name {name!r}: use a lower-case letter, then letters, digits or '_' (at most 40)")
    if template not in TEMPLATES:
        raise ScaffoldError(f"unknown template {template!r}; choose one of {', '.join(TEMPLATES)}")
    root = parent / name
    if root.exists() and any(root.iterdir()):
        raise ScaffoldError(f"{root} exists and is not empty; choose another name or directory")
    source = importlib.resources.files("coordinator.ops.app_templates").joinpath(f"{template}.py").read_text()
    source, count = re.subn(rf'^NAME = "{template}"$', f'NAME = "{name}"', source, flags=re.M)
    assert count == 1, f"template {template} must declare NAME once"
    package = root / f"{name}_app"
    (root / "tests").mkdir(parents=True, exist_ok=True)
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text(source)
    (root / "pyproject.toml").write_text(_PYPROJECT.format(name=name, what=TEMPLATES[template][0]))
    (root / "tests" / f"test_{name}_app.py").write_text(_TEST.format(name=name, data=TEMPLATES[template][1]))
    (root / "README.md").write_text(_README.format(name=name, what=TEMPLATES[template][0], device=DEVICE_DATA[template],
                                                   train=train_command(name, template)))
    return root


def train_command(name: str, template: str) -> str:
    """The one command that trains the new app in a simulation, from the directory ``new`` ran in."""
    _, data, settings = TEMPLATES[template]
    sets = " ".join(f"--set {key}={value:g}" for key, value in settings.items())
    return (f"PYTHONPATH={name} fedge-coordinator run --transport inproc --spawn-clients 3 --clients 3 "
            f"--set app.module={name}_app:app --data {data} {sets} --rounds 10")


_PYPROJECT = """[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{name}-app"
version = "0.1.0"
description = "A fedge app: {what}"
requires-python = ">=3.10"
dependencies = ["fedge"]

[project.entry-points."fedge.apps"]
{name} = "{name}_app:app"

[tool.setuptools]
packages = ["{name}_app"]

# `python -m pytest {name}/tests` from the directory above finds the app before it is installed
[tool.pytest.ini_options]
pythonpath = ["."]
"""

_TEST = '''"""The app loads, its data is usable, and a few steps of its own loss improve its headline metric."""

import torch

from edge_client.app import check_app, check_samples, evaluate_metrics

from {name}_app import app


def test_the_app_trains_on_its_data():
    check_app(app)
    samples = check_samples(app.eval_data("{data}"), app, "eval_data")
    torch.manual_seed(0)
    model = app.model({{}})
    before = evaluate_metrics(app, model, samples)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(100):
        model.train()
        optimizer.zero_grad()
        app.loss(model(samples.x), samples.y).backward()
        optimizer.step()
    after = evaluate_metrics(app, model, samples)
    better = after[app.headline] > before[app.headline]
    assert better if app.metrics[app.headline].higher_is_better else not better
'''

_README = """# {name}: a fedge app

{what}. `{name}_app/__init__.py` declares the app (its model, its data loader, its loss and metrics);
replace what it loads and trains with your own, keeping the `app = App(...)` declaration. The interface:
fedge's docs/apps.md.

Train it in a simulation on this machine (three devices, in one process):

```
{train}
```

Test it: `python -m pytest {name}/tests`. Install it beside fedge on the coordinator and every device
(`pip install -e {name}`, or its wheel), then name it in a run with `--set app.module={name}` and on each
device with `fedge-client run --app {name} --data LOCATION ...`, each device's LOCATION {device}.
A device whose installed copy of the app differs from the coordinator's (another version, or edited files)
refuses the run's tasks; the run goes on without it while enough others are left (`clients.min_results`):
install the same copy everywhere.
"""
