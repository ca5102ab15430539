"""Federated fine-tuning: an app's frozen part comes from its weights file on every party and never travels;
only what ``trainable`` selects trains, is aggregated and counted."""

from __future__ import annotations

import importlib
import json
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from coordinator.config import load_config
from coordinator.runtime.run import run_federated
from edge_client.app import APP_KEY, AppError, app_identity, load_app
from edge_client.models import federated_names
from edge_client.registry import build_model
from storage.checkpoint import latest_checkpoint, load_checkpoint

APP = '''
"""A digits classifier whose first layer and its normalization come pretrained and stay frozen."""
import torch
from sklearn.datasets import load_digits
from torch import nn
from edge_client.app import App, ExampleInput, Metric, Samples, accuracy


def model(options):
    return nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))


def digits(location):
    x, y = load_digits(return_X_y=True)
    return Samples(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.int64))


app = App(name="ft", version="1.0", model=model, example_input=ExampleInput((64,)), device_data=digits,
          eval_data=digits, loss=nn.functional.cross_entropy, metrics={"accuracy": Metric(accuracy)},
          headline="accuracy", trainable=["3.*"], weights="pretrained.safetensors")
'''


def _pretrained() -> dict[str, torch.Tensor]:
    """The weights a user would save from a network trained elsewhere: here a seeded one with moved statistics."""
    torch.manual_seed(7)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                              torch.nn.Linear(32, 10))
    state = {k: v.clone() for k, v in net.state_dict().items() if v.is_floating_point()}
    state["1.running_mean"] += 0.5
    return state


@pytest.fixture
def ft_app(tmp_path, monkeypatch):
    package = tmp_path / "ft_app"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(APP))
    save_file(_pretrained(), str(package / "pretrained.safetensors"))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield package
    for name in [m for m in sys.modules if m == "ft_app" or m.startswith("ft_app.")]:
        del sys.modules[name]


def _spec(app) -> dict:
    return {APP_KEY: app_identity(app).to_spec()}


def test_only_the_trainable_part_is_exchanged_and_the_frozen_part_comes_from_the_file(ft_app):
    app = load_app("ft_app:app")
    model = build_model(_spec(app))
    assert federated_names(model) == ["3.weight", "3.bias"]
    pretrained = _pretrained()
    assert torch.equal(model.state_dict()["0.weight"], pretrained["0.weight"])
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["3.weight", "3.bias"]
    # a frozen normalization layer keeps its statistics in training too: they are not exchanged
    model.train()
    model(torch.randn(16, 64))
    assert torch.equal(model.state_dict()["1.running_mean"], pretrained["1.running_mean"])


def test_the_weights_file_is_part_of_the_apps_identity(ft_app):
    app = load_app("ft_app:app")
    before = app_identity(app)
    assert len(before.weights) == 64 and before.to_spec()["weights"] == before.weights
    state = _pretrained()
    state["0.bias"] += 1.0
    save_file(state, str(ft_app / "pretrained.safetensors"))
    after = app_identity(app)
    assert after.digest == before.digest and after.weights != before.weights
    assert "weights file has sha256" in before.mismatch(after)
    with pytest.raises(AppError, match="weights file has sha256"):
        build_model({APP_KEY: before.to_spec()})


@pytest.mark.parametrize("change, message", [
    (lambda s: s.pop("0.weight"), r"frozen tensors \(0.weight\) are not in its weights file"),
    (lambda s: s.update(extra=torch.zeros(2)), "has tensors the model does not"),
    (lambda s: s.update({"0.bias": torch.zeros(3)}), r"0.bias in pretrained.safetensors is \(3,\)"),
    (lambda s: s.update({"3.bias": torch.full((10,), float("nan"))}), "is not finite"),
])
def test_a_weights_file_that_does_not_fit_is_refused_naming_the_tensor(ft_app, change, message):
    state = _pretrained()
    change(state)
    save_file(state, str(ft_app / "pretrained.safetensors"))
    app = load_app("ft_app:app")
    with pytest.raises(AppError, match=message):
        build_model(_spec(app))


def test_a_missing_weights_file_is_refused_saying_where_it_was_looked_for(ft_app):
    (ft_app / "pretrained.safetensors").unlink()
    with pytest.raises(AppError, match=r"pretrained.safetensors does not exist"):
        app_identity(load_app("ft_app:app"))


def test_a_fine_tuning_run_trains_sends_and_checkpoints_only_the_trainable_part(tmp_path, ft_app):
    out = tmp_path / "run"
    config = load_config(None, [("run", "rounds", 3), ("run", "out", str(out)), ("app", "module", "ft_app:app"),
                                ("train", "lr", 0.5), ("train", "epochs", 3), ("data", "eval", "sklearn"), ("clients", "expected", 3),
                                ("clients", "spawn", 3), ("transport", "kind", "inproc")])
    run_federated(config, say=lambda s: None)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"] + 0.2
    # what went up each round is the head's 330 floats, never the frozen 2,144 (plus a message's framing)
    assert all(0 < r["bytes_up"] / r["returned"] < 330 * 4 + 2048 for r in rows[1:])
    state, _ = load_checkpoint(latest_checkpoint(out / "checkpoints"))
    assert sorted(state.params) == ["3.bias", "3.weight"]
