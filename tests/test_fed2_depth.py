"""Fed2's depth tool: class preferences against closed forms, the variance's bounds, the rule, the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from coordinator.ui.cli import build_parser, main
from methods.fed2.diagnostics import (DEFAULT_THRESHOLD, Fed2DepthError, class_preferences, preference_variance,
                                    suggest_depth, weight_layers)
from edge_client.data import load_dataset
from edge_client.models import ImageClassifier
from edge_client.registry import build_model


@pytest.fixture(scope="module")
def digits_012() -> tuple[torch.Tensor, torch.Tensor]:
    """Real images of the digits 0, 1 and 2 (labels 0..2), as [N, 1, 8, 8]."""
    data = load_dataset("digits")
    keep = data.y_test < 3
    return torch.from_numpy(data.x_test[keep]), torch.from_numpy(data.y_test[keep])


def _dense(first: torch.Tensor, bias: torch.Tensor, head: torch.Tensor) -> ImageClassifier:
    """Flatten -> Linear(64, 3) -> ReLU, then a 3 x 3 classifier without bias, all weights fixed."""
    hidden = nn.Linear(64, 3)
    classifier = nn.Linear(3, 3, bias=False)
    with torch.no_grad():
        hidden.weight.copy_(first)
        hidden.bias.copy_(bias)
        classifier.weight.copy_(head)
    return ImageClassifier(nn.Sequential(nn.Flatten(), hidden, nn.ReLU()), classifier)


def _expected_dense(model: ImageClassifier, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Closed form: logit_c = sum_j V[c, j] h_j, so d logit_c / d h_j = V[c, j] and
    pref[j, c] = V[c, j] * sum over class-c samples of h_j."""
    with torch.no_grad():
        h = model.features(x).double()
        v = model.classifier.weight.double()
        sums = torch.stack([h[y == c].sum(0) for c in range(3)], 1)   # [j, c]
        return v.T * sums


def test_dense_preferences_match_the_closed_form_and_specialized_neurons_have_variance_one(digits_012):
    x, y = digits_012
    gen = torch.Generator().manual_seed(0)
    first = torch.rand(3, 64, generator=gen) * 0.1
    model = _dense(first, torch.ones(3), torch.diag(torch.tensor([1.5, 0.5, 2.0])))   # neuron j feeds logit j
    prefs = class_preferences(model, [1], x, y, 3, batch_size=17)[1]
    assert prefs.shape == (3, 3)
    assert torch.allclose(prefs, _expected_dense(model, x, y), atol=1e-6, rtol=0)
    assert (prefs.diagonal() > 0).all()
    assert preference_variance(prefs) == pytest.approx(1.0, abs=1e-12)

    mixed = _dense(first, torch.ones(3), torch.randn(3, 3, generator=gen))   # every neuron feeds every logit
    assert torch.allclose(class_preferences(mixed, [1], x, y, 3)[1], _expected_dense(mixed, x, y), atol=1e-6, rtol=0)


def test_identical_neurons_have_variance_zero(digits_012):
    x, y = digits_012
    row = torch.rand(1, 64, generator=torch.Generator().manual_seed(1)) * 0.1
    head = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5], [2.0, 2.0, 2.0]])   # same column for every neuron
    prefs = class_preferences(_dense(row.repeat(3, 1), torch.ones(3), head), [1], x, y, 3)[1]
    assert torch.allclose(prefs, prefs[:1].expand(3, 3))
    assert preference_variance(prefs) == pytest.approx(0.0, abs=1e-12)


def test_conv_preferences_sum_over_space_and_do_not_depend_on_the_batch(digits_012):
    x, y = digits_012
    torch.manual_seed(0)
    conv = nn.Conv2d(1, 2, 3, padding=1)
    model = ImageClassifier(nn.Sequential(conv, nn.GroupNorm(1, 2), nn.ReLU(), nn.Flatten()), nn.Linear(2 * 64, 3))
    model.eval()
    with torch.no_grad():   # logit_c = sum_{n,s} V[c, (n, s)] h[n, s] + b_c
        h = model.features(x).double().view(len(x), 2, 64)
        v = model.classifier.weight.double().view(3, 2, 64)
        expected = torch.stack([(h[y == c] * v[c]).sum((0, 2)) for c in range(3)], 1)
    whole = class_preferences(model, [1], x, y, 3, batch_size=1000)[1]
    assert torch.allclose(whole, expected, atol=1e-6, rtol=0)
    assert torch.allclose(class_preferences(model, [1], x, y, 3, batch_size=5)[1], whole, atol=1e-9)
    assert all(p.grad is None for p in model.parameters())


def test_layers_are_numbered_as_fed2_from_numbers_them():
    shape = {"num_classes": 10, "in_channels": 1, "image_size": 28}
    cnn = weight_layers(build_model({"name": "cnn", **shape}))
    assert [type(w).__name__ for w, _ in cnn.values()] == ["Conv2d", "Conv2d", "Linear"]
    assert list(cnn) == [1, 2, 3]
    vgg = weight_layers(build_model({"name": "vgg9", "width": 0.25, "norm": "gn", **shape}))
    assert list(vgg) == list(range(1, 9))
    assert [type(w).__name__ for w, _ in vgg.values()] == ["Conv2d"] * 6 + ["Linear"] * 2
    pans = build_model({"name": "cnn", "pan": "mul", **shape})   # the activation is a position-aware ReLU
    x = torch.randn(6, 1, 28, 28)
    prefs = class_preferences(pans, [1, 3], x, torch.arange(6) % 10, 10)
    assert prefs[1].shape == (32, 10) and prefs[3].shape == (128, 10)
    with pytest.raises(Fed2DepthError, match="valid: 1..3"):
        class_preferences(pans, [4], x, torch.zeros(6, dtype=torch.long), 10)


def test_variance_ignores_scale_and_dead_neurons():
    prefs = torch.tensor([[2.0, 0.0, 0.0], [0.0, 5.0, 0.0], [0.0, 0.0, 0.1], [0.0, 0.0, 0.0]])
    assert preference_variance(prefs) == pytest.approx(1.0)
    assert preference_variance(prefs * 7) == pytest.approx(1.0)
    assert preference_variance(torch.zeros(4, 3)) == 0.0
    assert 0.0 < preference_variance(torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])) < 1.0


def test_suggest_depth_takes_the_lowest_layer_from_which_all_are_above_the_threshold():
    assert suggest_depth({1: 0.1, 2: 0.5, 3: 0.2, 4: 0.6, 5: 0.7}, 0.3) == 4
    assert suggest_depth({1: 0.4, 2: 0.5, 3: 0.6}, 0.3) == 1
    assert suggest_depth({1: 0.4, 2: 0.5, 3: 0.2}, 0.3) == 4   # the last hidden layer is generic: classifier only
    assert suggest_depth({1: 0.1, 2: 0.3}, 0.3) == 3           # equal is not above
    with pytest.raises(Fed2DepthError):
        suggest_depth({}, 0.3)


def test_cli_on_digits_prints_the_suggestion_and_writes_the_plot_and_json(tmp_path, capsys):
    plot, out = tmp_path / "depth.png", tmp_path / "depth.json"
    assert main(["fed2-depth", "--model", "cnn", "--data", "digits", "--samples", "400", "--epochs", "1",
                 "--plot", str(plot), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert f"suggested: model.fed2_from = {result['suggested']}" in printed
    assert [layer["index"] for layer in result["layers"]] == [1, 2, 3] and result["classifier"] == 4
    assert all(0.0 <= layer["variance"] <= 10 / 9 for layer in result["layers"])
    assert result["threshold"] == DEFAULT_THRESHOLD
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, says", [(["--model", "nope"], "unknown model 'nope'"),
                                         (["--data", "bogus"], "unknown dataset spec 'bogus'")])
def test_cli_errors_are_one_line_and_exit_2(argv, says, capsys):
    assert main(["fed2-depth", *argv]) == 2
    out = capsys.readouterr().out.strip()
    assert says in out and "\n" not in out


def test_cli_help_states_the_default_threshold():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["fed2-depth"]
    assert f"default {DEFAULT_THRESHOLD:g}" in sub.format_help()
    assert "model.fed2_from=LAYER" in sub.format_help()
