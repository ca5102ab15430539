"""Model zoo options (norm, PANs) and the Position-Aware Neurons' encodings."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from edge_client.models import ModelSpecError, federated_names
from edge_client.registry import build_model
from methods.pans.model import PanSettings, PositionAwareReLU, pan_encoding

CNN28 = {"name": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 28}
VGG28 = {"name": "vgg9", "num_classes": 10, "in_channels": 1, "image_size": 28}
VGG32 = {"name": "vgg9", "num_classes": 10, "in_channels": 3, "image_size": 32}
MLP28 = {"name": "mlp", "num_classes": 10, "in_channels": 1, "image_size": 28}


def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _encodings(model: nn.Module) -> list[PositionAwareReLU]:
    return [m for m in model.modules() if isinstance(m, PositionAwareReLU)]


def test_encoding_formulas():
    j = torch.arange(8, dtype=torch.float64)
    add = pan_encoding("add", 1.0, 0.05, 8)
    mul = pan_encoding("mul", 2.0, 0.1, 8)
    assert add.dtype == mul.dtype == torch.float32
    assert torch.allclose(add.double(), 0.05 * torch.sin(2 * math.pi * j / 8), atol=1e-7)
    assert torch.allclose(mul.double(), 1 + 0.1 * torch.sin(2 * math.pi * 2 * j / 8), atol=1e-7)
    assert add[0] == 0 and mul[0] == 1 and add[2] == pytest.approx(0.05)   # sin(pi/2) at j = J/4


def test_vgg9_layout_and_flatten_size():
    model = build_model(VGG28)
    convs = [m for m in model.features if isinstance(m, nn.Conv2d)]
    linears = [m for m in model.features if isinstance(m, nn.Linear)]
    assert [c.out_channels for c in convs] == [32, 64, 128, 128, 256, 256]
    assert sum(isinstance(m, nn.MaxPool2d) for m in model.features) == 3
    assert [(m.in_features, m.out_features) for m in linears] == [(256 * 3 * 3, 512), (512, 512)]
    assert (model.classifier.in_features, model.classifier.out_features) == (512, 10)
    colour = build_model(VGG32)
    assert [m for m in colour.features if isinstance(m, nn.Linear)][0].in_features == 256 * 4 * 4
    assert colour(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ModelSpecError, match="at least 8"):
        build_model({**VGG28, "image_size": 4})


def test_mlp_default_is_the_papers_three_by_1024():
    model = build_model(MLP28)
    assert [m.out_features for m in model.features if isinstance(m, nn.Linear)] == [1024, 1024, 1024]


@pytest.mark.parametrize("spec", [MLP28, CNN28, VGG28])
@pytest.mark.parametrize("norm", ["none", "bn", "gn"])
def test_norm_option(spec, norm):
    model = build_model({**spec, "norm": norm})
    kinds = {nn.BatchNorm1d, nn.BatchNorm2d, nn.GroupNorm}
    found = {type(m) for m in model.modules()} & kinds
    assert bool(found) == (norm != "none")
    assert found <= ({nn.GroupNorm} if norm == "gn" else {nn.BatchNorm1d, nn.BatchNorm2d} if norm == "bn" else set())
    assert isinstance(model.features, nn.Sequential) and isinstance(model.classifier, nn.Linear)
    x = torch.randn(4, 1, 28, 28)
    assert torch.allclose(model(x), model.classifier(model.features(x)))


def test_cnn_keeps_groupnorm_by_default_and_its_size():
    assert _n_params(build_model(CNN28)) == 421_834
    assert _n_params(build_model({**CNN28, "pan": "mul"})) == 421_834
    assert not any(isinstance(m, nn.GroupNorm) for m in build_model({**CNN28, "norm": "none"}).modules())


def test_position_aware_relu_encodes_the_pre_activation():
    z = torch.randn(3, 4, 5, 5)
    for mode, amp in (("add", 0.2), ("mul", 0.3)):
        act = PositionAwareReLU(PanSettings(mode, 1.0, amp), 4)
        e = pan_encoding(mode, 1.0, amp, 4).view(1, 4, 1, 1)   # one value per channel, over all positions
        assert torch.equal(act(z), torch.relu(z + e if mode == "add" else z * e))
        assert torch.equal(act(z[:, :, 0, 0]), torch.relu(z[:, :, 0, 0] + e[:, :, 0, 0] if mode == "add"
                                                          else z[:, :, 0, 0] * e[:, :, 0, 0]))


@pytest.mark.parametrize("spec", [MLP28, CNN28, VGG28])
@pytest.mark.parametrize("pan", ["add", "mul"])
def test_pan_sits_on_hidden_layers_after_norm_before_relu(spec, pan):
    model = build_model({**spec, "pan": pan, "norm": "gn"})
    plain = build_model({**spec, "norm": "gn"})
    layers = list(model.features)
    hidden = [m for m in layers if isinstance(m, (nn.Linear, nn.Conv2d))]
    encs = _encodings(model)
    assert len(encs) == len(hidden)      # every hidden layer, and not the classifier
    for enc in encs:
        i = layers.index(enc)
        before = layers[i - 1]
        producer = before if isinstance(before, (nn.Linear, nn.Conv2d)) else layers[i - 2]
        assert isinstance(producer, (nn.Linear, nn.Conv2d))
        assert before is producer or isinstance(before, nn.GroupNorm)   # after the norm, if there is one
        width = producer.out_features if isinstance(producer, nn.Linear) else producer.out_channels
        assert enc.encoding.shape == (width,)
        assert torch.equal(enc.encoding, pan_encoding(pan, 1.0, 0.05 if pan == "add" else 0.1, width))
    assert not _encodings(plain) and sum(isinstance(m, nn.ReLU) for m in plain.features) == len(hidden)
    # the same parameter names and shapes with PANs off and on: checkpoints move between them
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}


@pytest.mark.parametrize("spec", [MLP28, CNN28, VGG28])
def test_encodings_are_never_state(spec):
    model = build_model({**spec, "pan": "mul", "pan_period": 2, "pan_amplitude": 0.3})
    state = model.state_dict()
    assert not any("encoding" in k for k in state)
    assert federated_names(model) == [n for n, _ in model.named_parameters()]
    assert all(not e.encoding.requires_grad for e in _encodings(model))
    assert not any(p is e.encoding for e in _encodings(model) for p in model.parameters())
    twin = build_model({**spec, "pan": "mul", "pan_period": 2, "pan_amplitude": 0.3})
    twin.load_state_dict(state)          # every party rebuilds the same encodings
    x = torch.randn(2, 1, 28, 28)
    assert torch.equal(model(x), twin(x))


def test_pan_changes_the_function_and_amplitude_zero_does_not():
    torch.manual_seed(0)
    plain = build_model(CNN28)
    x = torch.randn(4, 1, 28, 28)
    for pan, amp, same in (("add", 0.0, True), ("mul", 0.0, True), ("add", 0.05, False), ("mul", 0.1, False)):
        other = build_model({**CNN28, "pan": pan, "pan_amplitude": amp})
        other.load_state_dict(plain.state_dict())
        assert torch.allclose(other(x), plain(x), atol=1e-6) == same, (pan, amp)


@pytest.mark.parametrize("options,match", [
    ({"pan": "sin"}, "pan must be one of none, add, mul"),
    ({"pan": "mul", "pan_amplitude": -0.1}, "pan_amplitude must be a finite number >= 0"),
    ({"pan": "add", "pan_period": float("nan")}, "pan_period must be a finite number"),
    ({"pan": "add", "pan_period": "1"}, "pan_period must be a finite number"),
    ({"norm": "ln"}, "norm must be one of none, bn, gn"),
    ({"pan_phase": 1}, "rejects its options"),
])
def test_bad_pan_and_norm_options(options, match):
    for spec in (CNN28, VGG28):
        with pytest.raises(ModelSpecError, match=match):
            build_model({**spec, **options})
