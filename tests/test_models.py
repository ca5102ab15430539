"""Tests for edge_client.models (registry, architectures, init) and storage.checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save, save_file
from torch import nn

from edge_client.models import MODELS, ModelSpecError, federated_names, model_cost, state_shapes
from edge_client.pooling import MaxPool2d
from edge_client.registry import build_model
from storage.checkpoint import (
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from storage.state import ServerState

CNN28 = {"name": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 28}
SPEC0 = {"name": "mlp"}   # checkpoints hold a spec; these tests only read it back
MLP8 = {"name": "mlp", "num_classes": 10, "in_channels": 1, "image_size": 8, "hidden": [16]}


def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- registry and architectures


def test_registry_has_mlp_and_cnn():
    assert {"mlp", "cnn"} <= set(MODELS)


def test_cnn_parameter_count():
    assert _n_params(build_model(CNN28)) == 421_834
    assert all(p.requires_grad for p in build_model(CNN28).parameters())


def test_model_cost_counts_recurrent_layers_per_step_and_1d_convolutions():
    # an app's sequence model: each weight of a GRU or LSTM is used once per time step, in every layer and direction
    gru = nn.Sequential(nn.GRU(30, 32, batch_first=True))
    assert model_cost(gru, torch.zeros(1, 10, 30))["multiply_adds"] == 10 * (96 * 30 + 96 * 32)
    lstm = nn.LSTM(4, 8, num_layers=2, bidirectional=True)   # time first: [steps, batch, inputs]
    assert model_cost(lstm, torch.zeros(5, 1, 4))["multiply_adds"] == 5 * 2 * (32 * 4 + 32 * 8 + 32 * 16 + 32 * 8)
    conv = nn.Conv1d(3, 16, 5, padding=2)
    assert model_cost(conv, torch.zeros(1, 3, 64))["multiply_adds"] == 16 * 64 * 3 * 5


def test_cnn_layer_structure():
    model = build_model(CNN28)
    f = model.features
    expected_types = [nn.Conv2d, nn.GroupNorm, nn.ReLU, MaxPool2d, nn.Conv2d, nn.GroupNorm, nn.ReLU,
                      MaxPool2d, nn.Flatten, nn.Linear, nn.ReLU]
    assert [type(m) for m in f] == expected_types
    conv1, gn1, conv2, gn2, fc = f[0], f[1], f[4], f[5], f[9]
    assert (conv1.in_channels, conv1.out_channels, conv1.kernel_size, conv1.padding) == (1, 32, (3, 3), (1, 1))
    assert (conv2.in_channels, conv2.out_channels, conv2.kernel_size, conv2.padding) == (32, 64, (3, 3), (1, 1))
    assert conv1.bias is not None and conv2.bias is not None
    assert (gn1.num_groups, gn1.num_channels) == (8, 32)
    assert (gn2.num_groups, gn2.num_channels) == (8, 64)
    assert f[3].kernel_size == 2 and f[7].kernel_size == 2
    assert (fc.in_features, fc.out_features) == (3136, 128)
    assert type(model.classifier) is nn.Linear
    assert (model.classifier.in_features, model.classifier.out_features) == (128, 10)


def test_mlp_structure():
    model = build_model(MLP8)
    assert [type(m) for m in model.features] == [nn.Flatten, nn.Linear, nn.ReLU]
    assert (model.features[1].in_features, model.features[1].out_features) == (64, 16)
    assert (model.classifier.in_features, model.classifier.out_features) == (16, 10)
    default = build_model({k: v for k, v in MLP8.items() if k != "hidden"})
    assert [m.out_features for m in default.features if isinstance(m, nn.Linear)] == [1024, 1024, 1024]


@pytest.mark.parametrize("spec", [CNN28, MLP8])
def test_features_and_classifier(spec):
    model = build_model(spec)
    assert isinstance(model.features, nn.Module) and isinstance(model.classifier, nn.Linear)
    x = torch.randn(3, spec["in_channels"], spec["image_size"], spec["image_size"])
    with torch.no_grad():
        assert torch.allclose(model(x), model.classifier(model.features(x)))
        assert model.features(x).shape == (3, model.classifier.in_features)


@pytest.mark.parametrize("name", ["cnn", "mlp"])
@pytest.mark.parametrize("size,channels,classes", [(8, 1, 10), (28, 1, 10), (28, 3, 7), (8, 2, 3)])
def test_forward_shapes(name, size, channels, classes):
    model = build_model({"name": name, "num_classes": classes, "in_channels": channels, "image_size": size})
    with torch.no_grad():
        out = model(torch.randn(5, channels, size, size))
    assert out.shape == (5, classes) and out.dtype == torch.float32
    assert torch.isfinite(out).all()


# --------------------------------------------------------------------------- build_model errors


def test_unknown_model_lists_available():
    with pytest.raises(ModelSpecError, match="unknown model 'resnet'; model.name is one of cnn, mlp, vgg9$"):
        build_model({**CNN28, "name": "resnet"})


@pytest.mark.parametrize("spec", [None, [], "cnn", {"num_classes": 10}])
def test_spec_must_be_a_mapping_with_a_name(spec):
    with pytest.raises(ModelSpecError, match="a mapping with a 'name'"):
        build_model(spec)


@pytest.mark.parametrize("key", ["num_classes", "in_channels", "image_size"])
@pytest.mark.parametrize("value", ["missing", 0, -1, "10", 2.0, True, None])
def test_shape_keys_must_be_positive_ints(key, value):
    spec = {k: v for k, v in CNN28.items() if not (k == key and value == "missing")}
    if value != "missing":
        spec[key] = value
    with pytest.raises(ModelSpecError, match=f"positive integer '{key}'"):
        build_model(spec)


@pytest.mark.parametrize("spec,match", [
    ({**CNN28, "hidden": [16]}, "model 'cnn' rejects its options"),
    ({**CNN28, "dropout": 0.5}, "model 'cnn' rejects its options"),
    ({**MLP8, "depth": 3}, "model 'mlp' rejects its options"),
    ({**MLP8, "hidden": []}, "hidden widths must be positive integers"),
    ({**MLP8, "hidden": [16, 0]}, "hidden widths must be positive integers"),
    ({**MLP8, "hidden": [-4]}, "hidden widths must be positive integers"),
    ({**CNN28, "image_size": 30}, "divisible by 4"),
])
def test_bad_options(spec, match):
    with pytest.raises(ModelSpecError, match=match):
        build_model(spec)


def test_model_spec_error_is_a_value_error():
    assert issubclass(ModelSpecError, ValueError)


# --------------------------------------------------------------------------- federated state


class _WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.register_buffer("fixed", torch.arange(3.0), persistent=False)
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))


def test_federated_names_excludes_non_float_state():
    model = _WithBuffers()
    names = federated_names(model)
    assert names == ["conv.weight", "conv.bias", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"]
    assert "bn.num_batches_tracked" in model.state_dict() and "bn.num_batches_tracked" not in names
    assert "step" in model.state_dict() and "step" not in names
    assert "fixed" not in names
    assert state_shapes(model) == {"conv.weight": (4, 1, 3, 3), "conv.bias": (4,), "bn.weight": (4,),
                                   "bn.bias": (4,), "bn.running_mean": (4,), "bn.running_var": (4,)}
    assert state_shapes(model, ["bn.bias"]) == {"bn.bias": (4,)}


@pytest.mark.parametrize("spec", [CNN28, MLP8])
def test_federated_names_cover_all_parameters(spec):
    model = build_model(spec)
    assert federated_names(model) == [n for n, _ in model.named_parameters()]
    shapes = state_shapes(model)
    assert sum(torch.Size(s).numel() for s in shapes.values()) == _n_params(model)


def test_same_seed_same_init():
    torch.manual_seed(123)
    a = build_model(CNN28).state_dict()
    torch.manual_seed(123)
    b = build_model(CNN28).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    torch.manual_seed(124)
    c = build_model(CNN28).state_dict()
    assert not torch.equal(a["features.0.weight"], c["features.0.weight"])


# --------------------------------------------------------------------------- checkpoints


def _cnn_state(round: int, seed: int = 0) -> ServerState:
    torch.manual_seed(seed)
    model = build_model(CNN28)
    params = {k: v.detach().clone() for k, v in model.state_dict().items() if k in federated_names(model)}
    return ServerState(round=round, params=params, spec=CNN28, extra={"rng": [1, 2, 3], "note": "x"})


def test_checkpoint_round_trip_is_exact(tmp_path):
    state = _cnn_state(3)
    info = {"run_id": "run-1", "strategy": "fedavg"}
    path = save_checkpoint(tmp_path / "ckpt", state, info)
    assert path == checkpoint_path(tmp_path / "ckpt", 3) == tmp_path / "ckpt" / "round_0003.safetensors"
    assert sorted(p.name for p in path.parent.iterdir()) == ["round_0003.safetensors"]   # no temp file left
    loaded, loaded_info = load_checkpoint(path)
    assert loaded.round == 3
    assert loaded.extra == {"rng": [1, 2, 3], "note": "x"}
    assert loaded_info == info and loaded.spec == CNN28
    assert loaded.params.keys() == state.params.keys()
    for k, v in state.params.items():
        assert loaded.params[k].dtype == torch.float32
        assert torch.equal(loaded.params[k], v)
    model = build_model(CNN28)
    model.load_state_dict(loaded.params)   # the names match the model's


def test_checkpoint_of_non_contiguous_params(tmp_path):
    w = torch.arange(6.0).reshape(2, 3)
    path = save_checkpoint(tmp_path, ServerState(round=1, params={"w": w.t()}, spec=SPEC0), {})
    loaded, info = load_checkpoint(path)
    assert torch.equal(loaded.params["w"], w.t()) and info == {} and loaded.extra == {}


def test_latest_checkpoint_picks_the_highest_round(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "does-not-exist") is None
    small = ServerState(round=0, params={"w": torch.ones(2)}, spec=SPEC0)
    for r in (2, 10, 9, 9999, 10000, 1):
        save_checkpoint(tmp_path, ServerState(round=r, params=small.params, spec=SPEC0), {"r": r})
    (tmp_path / "round_99999.tmp").write_bytes(b"partial")
    (tmp_path / "round_123456.safetensors.bak").write_bytes(b"x")
    (tmp_path / "round_7.safetensors").write_bytes(b"x")        # not a name save_checkpoint writes
    (tmp_path / "notes.txt").write_text("hi")
    latest = latest_checkpoint(tmp_path)
    assert latest == tmp_path / "round_10000.safetensors"        # numeric, not lexicographic
    state, info = load_checkpoint(latest)
    assert state.round == 10000 and info == {"r": 10000}


def test_keep_all_false_removes_older_checkpoints(tmp_path):
    params = {"w": torch.ones(2)}
    for r in (1, 2):
        save_checkpoint(tmp_path, ServerState(round=r, params=params, spec=SPEC0), {})
    assert len(list(tmp_path.glob("round_*.safetensors"))) == 2
    path = save_checkpoint(tmp_path, ServerState(round=3, params={"w": torch.full((2,), 3.0)}, spec=SPEC0), {},
                           keep_all=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round_0003.safetensors"]
    assert latest_checkpoint(tmp_path) == path
    assert torch.equal(load_checkpoint(path)[0].params["w"], torch.full((2,), 3.0))


def test_keep_all_true_keeps_every_round(tmp_path):
    for r in (1, 2, 3):
        save_checkpoint(tmp_path, ServerState(round=r, params={"w": torch.full((1,), float(r))}, spec=SPEC0), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"round_000{r}.safetensors" for r in (1, 2, 3)]
    assert torch.equal(load_checkpoint(checkpoint_path(tmp_path, 2))[0].params["w"], torch.tensor([2.0]))


def _valid_bytes() -> bytes:
    return save({"w": torch.ones(4)}, metadata={"fedge": json.dumps({"round": 1, "spec": SPEC0, "extra": {}})})


@pytest.mark.parametrize("content", [
    b"",
    b"abc",
    b"this is not a safetensors file at all",
    b"\x00" * 64,
    "truncated",
    "no-metadata",
    "other-metadata",
    "metadata-not-json",
])
def test_corrupt_checkpoint_raises_checkpoint_error(tmp_path, content):
    path = tmp_path / "round_0001.safetensors"
    if content == "truncated":
        data = _valid_bytes()
        path.write_bytes(data[:len(data) - 7])
    elif content == "no-metadata":
        save_file({"w": torch.ones(4)}, str(path))
    elif content == "other-metadata":
        save_file({"w": torch.ones(4)}, str(path), metadata={"other": "1"})
    elif content == "metadata-not-json":
        save_file({"w": torch.ones(4)}, str(path), metadata={"fedge": "{round: 1"})
    else:
        path.write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)
    assert "unreadable" in str(info.value)


def test_valid_hand_written_checkpoint_loads(tmp_path):
    # Guard for the corrupt-file cases above: the untouched buffer is readable.
    path = tmp_path / "round_0001.safetensors"
    path.write_bytes(_valid_bytes())
    state, info = load_checkpoint(path)
    assert state.round == 1 and torch.equal(state.params["w"], torch.ones(4)) and info == {}
    assert state.spec == SPEC0


def test_missing_checkpoint_raises_checkpoint_error(tmp_path):
    path = tmp_path / "round_0004.safetensors"
    with pytest.raises(CheckpointError, match="does not exist") as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path)   # a directory is not a checkpoint


@pytest.mark.parametrize("meta", ['{"rounl": 1, "extra": {}}', "[1, 2]", '"text"', '{"round": "one"}'])
def test_checkpoint_with_bad_fedge_metadata_raises_checkpoint_error(tmp_path, meta):
    path = tmp_path / "round_0001.safetensors"
    save_file({"w": torch.ones(4)}, str(path), metadata={"fedge": meta})
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)


def test_explicit_widths_rebuild_a_grown_network_layer_by_layer():
    shape = {"num_classes": 10, "in_channels": 1, "image_size": 28}
    model = build_model({"name": "vgg9", "widths": [5, 6, 7, 8, 9, 10, 11, 12], **shape})
    weights = [tuple(p.shape) for n, p in model.named_parameters() if n.endswith("weight")]
    assert weights == [(5, 1, 3, 3), (6, 5, 3, 3), (7, 6, 3, 3), (8, 7, 3, 3), (9, 8, 3, 3), (10, 9, 3, 3),
                       (11, 10 * 3 * 3), (12, 11), (10, 12)]
    cnn = build_model({"name": "cnn", "widths": [5, 6, 7], "norm": "none", **shape})
    assert [tuple(p.shape) for n, p in cnn.named_parameters() if n.endswith("weight")] == \
        [(5, 1, 3, 3), (6, 5, 3, 3), (7, 6 * 7 * 7), (10, 7)]
    for bad in ([5, 6], [5, 0, 7], [5, 6.5, 7], "5,6,7"):
        with pytest.raises(ModelSpecError, match="widths lists the size of each of its 3 hidden weight layers"):
            build_model({"name": "cnn", "widths": bad, **shape})


@pytest.mark.parametrize("shape, window", [((4, 8, 28, 28), (2,)), ((3, 5, 7, 9), (3, 2, 1)), ((1, 2, 6, 6), (2,))])
def test_fedge_max_pooling_gives_torchs_outputs_and_gradients_bit_for_bit(shape, window):
    """The faster pooling is only faster: the same values, the same argmax on ties (the first in the window),
    the same gradients, and in evaluation the same outputs."""
    torch.manual_seed(0)
    x = torch.relu(torch.randn(shape)).clamp(max=0.5)   # many ties: zeros and the clamped maximum
    upstream = torch.randn_like(nn.MaxPool2d(*window)(x))
    grads, outs = [], []
    for pool in (nn.MaxPool2d(*window), MaxPool2d(*window)):
        leaf = x.clone().requires_grad_()
        out = pool(leaf)
        out.backward(upstream)
        outs.append(out)
        grads.append(leaf.grad)
        with torch.no_grad():
            outs.append(pool(x))
    assert all(torch.equal(outs[0], o) for o in outs[1:]) and outs[1].is_contiguous()
    assert torch.equal(grads[0], grads[1])


def test_a_model_with_fedge_pooling_trains_to_the_same_bits_and_exports_a_plain_maxpool():
    import copy

    torch.manual_seed(0)
    fast = build_model(CNN28)
    slow = copy.deepcopy(fast)
    for module in slow.modules():
        if isinstance(module, MaxPool2d):
            module.__class__ = nn.MaxPool2d
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    for model in (fast, slow):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for _ in range(3):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(fast.state_dict().values(), slow.state_dict().values()))
    traced = torch.jit.trace(fast.eval(), x[:1])
    assert "max_pool2d" in str(traced.inlined_graph) and "contiguous" not in str(traced.inlined_graph)
