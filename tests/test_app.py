"""The app interface: an app loads by name or import path, is checked before use, and is identified by its files."""

from __future__ import annotations

import importlib
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from edge_client.app import (App, AppError, ExampleInput, Metric, Samples, app_identity, check_app, check_samples,
                             evaluate_metrics, example_input, load_app, trainable_names)
from edge_client.objectives import evaluate
from edge_client.registry import build_model

SPEC = {"name": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 8}

TABULAR = '''
"""A regression app, as a user writes it: MSE loss, MAE and R^2, no accuracy anywhere."""
import torch
from torch import nn
from edge_client.app import App, ExampleInput, Metric, Samples


def model(options):
    return nn.Sequential(nn.Linear(4, int(options.get("hidden", 8))), nn.ReLU(), nn.Linear(8, 1))


def rows(location):
    g = torch.Generator().manual_seed(len(location))
    x = torch.randn(64, 4, generator=g)
    return Samples(x, x.sum(1, keepdim=True))


def mae(outputs, targets):
    return float((outputs - targets).abs().mean())


def r2(outputs, targets):
    return float(1 - ((outputs - targets) ** 2).sum() / ((targets - targets.mean()) ** 2).sum())


app = App(name="tab", version="1.0", model=model, example_input=ExampleInput((4,)), device_data=rows,
          eval_data=rows, loss=nn.functional.mse_loss, metrics={"mae": Metric(mae, False), "r2": Metric(r2)},
          headline="r2", trainable=["2.*"])
'''


@pytest.fixture
def tabular_app(tmp_path, monkeypatch):
    package = tmp_path / "tab_app"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(TABULAR))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield package
    for name in [m for m in sys.modules if m == "tab_app" or m.startswith("tab_app.")]:
        del sys.modules[name]


def test_the_built_in_vision_app_loads_by_name_and_judges_a_model_as_the_runtime_does():
    app = load_app("vision")
    assert app is load_app("edge_client.apps.vision:APP") and app.headline == "accuracy"
    samples = app.eval_data("digits")
    torch.manual_seed(0)
    model = app.model(SPEC)
    figures = evaluate_metrics(app, model, samples)
    loss, accuracy = evaluate(model, samples.x, samples.y)
    assert figures == {"loss": loss, "accuracy": accuracy}   # to the bit: the runtime's own evaluation
    torch.manual_seed(0)
    assert all(torch.equal(a, b) for a, b in zip(build_model(SPEC).state_dict().values(),
                                                  model.state_dict().values()))   # the registry's network
    assert example_input(app, SPEC) == ExampleInput((1, 8, 8))
    assert model(example_input(app, SPEC).tensor(2)).shape == (2, 10)
    assert app.require_hook("features", "SphereFed") == "features"
    assert isinstance(dict(build_model(SPEC).named_children())[app.hooks["head"]], torch.nn.Module)


def test_a_users_regression_app_loads_from_its_import_path_and_reports_its_own_metrics(tabular_app):
    app = load_app("tab_app:app")
    samples = check_samples(app.device_data("site-1"), app, "device_data")
    figures = evaluate_metrics(app, app.model({}), samples)
    assert set(figures) == {"loss", "mae", "r2"} and figures["mae"] > 0
    names = [n for n, _ in app.model({}).named_parameters()]
    assert trainable_names(app, names) == ["2.weight", "2.bias"]   # fine-tuning: only the last layer travels
    with pytest.raises(AppError, match="SphereFed needs the app to name its 'features' submodule"):
        app.require_hook("features", "SphereFed")


def test_an_apps_identity_follows_its_installed_files_and_a_mismatch_names_both(tabular_app):
    app = load_app("tab_app:app")
    before = app_identity(app)
    assert before.name == "tab" and before.version == "1.0" and len(before.digest) == 64
    (tabular_app / "extra.py").write_text("CHANGED = True\n")
    from edge_client.app import _package_digest
    _package_digest.cache_clear()
    after = app_identity(app)
    assert after.digest != before.digest and before.mismatch(before) is None
    said = before.mismatch(after)
    assert "tab 1.0" in said and before.digest[:12] in said and after.digest[:12] in said
    # a task made with the earlier files is refused as a mismatch, the kind a device reports (refusal "app")
    from edge_client.app import APP_KEY, AppMismatch, spec_app
    with pytest.raises(AppMismatch, match="the task was made with app tab 1.0"):
        spec_app({APP_KEY: before.to_spec()})
    with pytest.raises(AppMismatch, match="neither installed here"):
        spec_app({APP_KEY: {"name": "elsewhere", "version": "1", "digest": "0" * 64}})


def _app(**changes) -> App:
    fields = dict(name="x", version="1", model=lambda o: torch.nn.Linear(2, 1), example_input=ExampleInput((2,)),
                  device_data=lambda s: Samples(torch.zeros(1, 2), torch.zeros(1)),
                  eval_data=lambda s: Samples(torch.zeros(1, 2), torch.zeros(1)), loss=F.mse_loss,
                  metrics={"mse": Metric(lambda o, t: 0.0, False)}, headline="mse")
    return App(**{**fields, **changes})


@pytest.mark.parametrize("changes, said", [
    ({"headline": "accuracy"}, "headline 'accuracy' is not one of its metrics"),
    ({"metrics": {}}, "metrics is empty"),
    ({"metrics": {"mse": lambda o, t: 0.0}}, r"metrics \['mse'\] must be Metric"),
    ({"name": "my app"}, "name 'my app' must be"),
    ({"version": ""}, "version must be a non-empty string"),
    ({"loss": "mse"}, "loss must be a function"),
    ({"trainable": "head.*"}, "trainable must be a list of patterns"),
])
def test_an_app_declared_wrong_is_refused_naming_the_field(changes, said):
    with pytest.raises(AppError, match=said):
        check_app(_app(**changes))


def test_data_and_patterns_that_do_not_fit_are_refused_with_what_to_fix():
    app = check_app(_app())
    with pytest.raises(AppError, match="as many of each"):
        check_samples(Samples(torch.zeros(3, 2), torch.zeros(2)), app, "device_data")
    with pytest.raises(AppError, match="not all finite"):
        check_samples(Samples(torch.full((2, 2), float("nan")), torch.zeros(2)), app, "device_data")
    with pytest.raises(AppError, match=r"must return Samples\(x, y\)"):
        check_samples((torch.zeros(2, 2), torch.zeros(2)), app, "device_data")
    with pytest.raises(AppError, match=r"patterns \['head\.\*'\] match no parameter"):
        trainable_names(_app(trainable=["head.*"]), ["weight", "bias"])
    with pytest.raises(AppError, match="neither an installed app"):
        load_app("no_such_app")
    with pytest.raises(AppError, match="does not import"):
        load_app("no_such_package_anywhere:app")
    with pytest.raises(AppError, match="not an edge_client.app.App"):
        load_app("edge_client.apps.vision:accuracy")


def test_the_built_in_app_named_is_fedge_own_path_and_methods_that_need_structure_refuse_other_apps():
    from coordinator.config import ConfigError, load_config
    from edge_client.app import run_app

    assert run_app("") is None and run_app("vision") is None and run_app("edge_client.apps.vision:APP") is None
    load_config(None, [("app", "module", "vision"), ("run", "strategy", "spherefed")])   # the built-in app: all
    with pytest.raises(ConfigError, match="run.strategy = 'spherefed' does not train apps yet .* use one of fedavg"):
        load_config(None, [("app", "module", "tab_app:app"), ("run", "strategy", "spherefed")])
    with pytest.raises(ConfigError, match=r"model options \['pan'\] change fedge's own networks"):
        load_config(None, [("app", "module", "tab_app:app"), ("model", "pan", "add")])
    with pytest.raises(ConfigError, match="changes fedge's own images; an app's data takes 'iid'"):
        load_config(None, [("app", "module", "tab_app:app"), ("data", "partition", "attribute:rotate:4")])
    load_config(None, [("app", "module", "tab_app:app"), ("data", "partition", "dirichlet:0.5")])   # split on devices


def test_a_simulation_splits_an_apps_classes_by_label_and_refuses_a_label_split_of_real_targets():
    from edge_client.inputs import app_partition
    from storage.pixels import DataError

    classes = np.repeat(np.arange(4), 50)
    parts = [app_partition(classes, "shards:1", i, 4, seed=0) for i in range(4)]
    assert sorted(len(set(classes[p])) for p in parts) == [1, 1, 1, 1]   # one class each
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(200))
    iid = [app_partition(np.zeros((200, 1), np.float32), "iid", i, 4, seed=0) for i in range(4)]
    assert np.array_equal(np.sort(np.concatenate(iid)), np.arange(200))   # any targets split iid
    with pytest.raises(DataError, match=r"splits by class label, but the app's targets are float32 \(200, 1\)"):
        app_partition(np.zeros((200, 1), np.float32), "dirichlet:0.5", 0, 4, seed=0)
