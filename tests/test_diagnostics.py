"""Alignment diagnostics: function-preserving shuffles, the shuffle test, divergence, matching, preferences."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edge_client.data import load_dataset
from coordinator.diagnostics import (
    DiagnosticsError,
    class_preferences,
    divergence_metrics,
    hidden_activations,
    hidden_layers,
    neuron_matching,
    permute_hidden,
    random_permutations,
    shuffle_error,
    shuffle_permutation,
    unit_rows,
    weight_divergence,
)
from edge_client.registry import build_model


def spec(name: str, size: int = 16, channels: int = 1, **options) -> dict:
    extra = {"hidden": [48, 32]} if name == "mlp" else {}
    return {"name": name, "num_classes": 10, "in_channels": channels, "image_size": size, **extra, **options}


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # see conftest.py


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ds = load_dataset("digits")
    return torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train), torch.from_numpy(ds.x_test[:200])


def fit(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 60) -> nn.Module:
    """A short fixed SGD run, so the shuffle test sees a trained network, not an initialization."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, len(x), (32,), generator=gen)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


# --------------------------------------------------------------------------- permutations


def test_shuffle_generator():
    rng = np.random.default_rng(0)
    assert np.array_equal(shuffle_permutation(20, 0.0, rng), np.arange(20))
    full = shuffle_permutation(20, 1.0, rng)
    assert sorted(full) == list(range(20)) and not np.array_equal(full, np.arange(20))
    a, b = (shuffle_permutation(50, 0.5, np.random.default_rng(3)) for _ in range(2))
    assert np.array_equal(a, b)                                 # reproducible from the seed
    moved = [np.mean(shuffle_permutation(200, p, np.random.default_rng(1)) != np.arange(200)) for p in (0.05, 0.5)]
    assert 0 < moved[0] < moved[1] <= 1                         # P_sf controls how much moves


def test_hidden_layers_of_each_model():
    names = {n: [h.name for h in hidden_layers(build_model(spec(n)))] for n in ("mlp", "cnn", "vgg9")}
    assert names["mlp"] == ["features.1", "features.3"]
    assert names["cnn"] == ["features.0", "features.4", "features.9"]
    assert len(names["vgg9"]) == 8 and "classifier" not in " ".join(names["vgg9"])
    cnn = hidden_layers(build_model(spec("cnn")))
    assert [h.groups for h in cnn] == [8, 8, 1] and cnn[-1].consumer is not None


def test_groupnorm_shuffles_keep_groups_together():
    model = build_model(spec("cnn", norm="gn"))
    perm = random_permutations(model, 1.0, seed=4)["features.0"].view(8, 4)   # 32 channels in 8 groups
    assert all(len({int(c) // 4 for c in block}) == 1 for block in perm)
    assert not torch.equal(perm.flatten(), torch.arange(32))


@pytest.mark.parametrize("name", ["mlp", "cnn", "vgg9"])
@pytest.mark.parametrize("norm", ["none", "bn", "gn"])
def test_shuffling_preserves_the_function_without_pans(name, norm):
    torch.manual_seed(0)
    model = build_model(spec(name, norm=norm))
    model.train()
    model(torch.randn(64, 1, 16, 16))             # BatchNorm running statistics away from their start
    x = torch.randn(16, 1, 16, 16)
    assert shuffle_error(model, x, p_sf=1.0, seed=1) < 1e-5
    shuffled = permute_hidden(copy.deepcopy(model), random_permutations(model, 1.0, seed=1))
    first = hidden_layers(model)[0].name + ".weight"
    assert not torch.equal(shuffled.state_dict()[first], model.state_dict()[first])   # it did move neurons
    assert model.training                         # the diagnostics leave the model's mode alone


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_shuffle_test_with_pans(name, digits):
    x, y, x_test = digits
    errors = {}
    for pan in ("none", "add", "mul"):
        torch.manual_seed(0)
        model = fit(build_model(spec(name, size=8, pan=pan)), x, y)
        errors[pan] = np.mean([shuffle_error(model, x_test, p_sf=1.0, seed=s) for s in range(3)])
    assert errors["none"] < 1e-5                  # permutation invariance
    assert errors["add"] > 1e-3                   # PANs tie neurons to their positions
    assert errors["mul"] > 1.5 * errors["add"]    # and multiplicative ones more than additive ones


def test_permute_rejects_a_non_permutation():
    model = build_model(spec("mlp"))
    with pytest.raises(DiagnosticsError, match="not a permutation"):
        permute_hidden(model, {"features.1": torch.zeros(48, dtype=torch.int64)})


# --------------------------------------------------------------------------- divergence


def test_weight_divergence_by_hand():
    a = {"fc.weight": torch.ones(2, 2), "fc.bias": torch.zeros(2)}
    b = {"fc.weight": 3 * torch.ones(2, 2), "fc.bias": torch.ones(2)}
    # uniform: W_avg = 2; ||W_k - W_avg|| = 2 for both, ||W_avg|| = 4
    assert weight_divergence([a, b]) == {"fc.weight": pytest.approx(0.5)}
    # weighted 3:1: W_avg = 1.5; distances 1 and 3, mean 2, ||W_avg|| = 3
    assert weight_divergence([a, b], [3, 1])["fc.weight"] == pytest.approx(2 / 3)
    assert weight_divergence([a, b], names=["fc.bias"]) == {"fc.bias": pytest.approx(1.0)}
    assert divergence_metrics([a, a, a]) == {"weight_divergence": {"fc.weight": 0.0}, "weight_divergence_mean": 0.0}
    with pytest.raises(DiagnosticsError, match="positive weight"):
        weight_divergence([a, b], [1, 0])


def test_divergence_names_every_layer_but_no_norms():
    model = build_model(spec("cnn", norm="gn"))
    per_layer = weight_divergence([model.state_dict(), model.state_dict()])
    assert sorted(per_layer) == ["classifier.weight", "features.0.weight", "features.4.weight", "features.9.weight"]


# --------------------------------------------------------------------------- matching and preferences


def test_unit_rows_are_pearson_rows_and_mark_silent_neurons():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(4, 50, generator=g)
    t[1] = 0.0       # a dead neuron
    t[3] = 2.5       # a constant one: no variance either
    rows, live = unit_rows(t)
    assert rows.dtype == torch.float64 and live.tolist() == [True, False, True, False]
    assert float(rows[0] @ rows[2]) == pytest.approx(float(np.corrcoef(t[0].numpy(), t[2].numpy())[0, 1]), abs=1e-6)
    assert torch.equal(rows[1], torch.zeros(50, dtype=torch.float64)) and torch.equal(rows[3], rows[1])
    assert torch.allclose(rows[live].norm(dim=1), torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_neuron_matching_finds_a_shuffle(name, digits):
    x, y, x_test = digits
    torch.manual_seed(0)
    model = fit(build_model(spec(name, size=8)), x, y, steps=30)
    assert set(neuron_matching(model, model, x_test).values()) == {1.0}
    perms = random_permutations(model, 0.5, seed=2)
    shuffled = permute_hidden(copy.deepcopy(model), perms)
    ratios = neuron_matching(shuffled, model, x_test)
    acts = hidden_activations(model, x_test)
    for layer, perm in perms.items():   # the assignment recovers the permutation: only fixed points match
        fixed = float((perm == torch.arange(len(perm))).float().mean())
        dead = int((acts[layer].abs().sum(dim=1) == 0).sum())   # silent neurons match anywhere
        assert ratios[layer] == pytest.approx(fixed, abs=(dead + 1) / len(perm)), layer
    assert min(ratios.values()) < 0.9


def test_class_preferences_of_the_last_hidden_layer_in_closed_form(digits):
    x, y, _ = digits
    torch.manual_seed(0)
    model = fit(build_model(spec("mlp", size=8)), x, y, steps=30)
    xb, yb = x[:100], y[:100]
    prefs = class_preferences(model, xb, yb, 10)
    assert {k: tuple(v.shape) for k, v in prefs.items()} == {"features.1": (48, 10), "features.3": (32, 10)}
    # the classifier is linear: d score_c / d a = W_c, so entry (j, c) = sum over class-c samples of a_j W_cj
    with torch.no_grad():
        a = model.features(xb)
    w = model.classifier.weight
    expected = torch.stack([(a[yb == c] * w[c]).sum(0) for c in range(10)], dim=1)
    assert torch.allclose(prefs["features.3"], expected, atol=1e-5)
    assert model.training


def test_class_preferences_match_one_backward_per_class(digits):
    x, y, _ = digits
    torch.manual_seed(1)
    model = build_model(spec("cnn", size=8)).eval()
    xb, yb = x[:40], y[:40]
    prefs = class_preferences(model, xb, yb, 10)["features.0"]
    acts = {}
    handle = model.features[2].register_forward_hook(lambda m, i, o: acts.__setitem__("a", o))
    for c in (int(yb[0]), int(yb[1])):
        scores = model(xb)
        (g,) = torch.autograd.grad(scores[yb == c, c].sum(), acts["a"])
        direct = (acts["a"] * g)[yb == c].sum(dim=(0, 2, 3))
        assert torch.allclose(prefs[:, c], direct.detach(), atol=1e-5)
    handle.remove()
    with pytest.raises(DiagnosticsError, match="labels"):
        class_preferences(model, xb, yb + 10, 10)
