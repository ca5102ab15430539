"""Fed2: the grouped structure keeps groups apart, paired averaging weights groups by class counts, runs end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from coordinator.config import ConfigError, load_config
from coordinator.strategy_setup import make_strategy
from coordinator.runtime.run import run_federated
from coordinator.strategies.base import ClientResult, RowWeightedSum, TaskPlan
from methods.fed2.strategy import Fed2
from methods.common import class_counts
from methods.fed2.model import DecoupledClassifier, row_groups
from edge_client.models import ModelSpecError, federated_names
from edge_client.registry import build_model, model_size
from export.cli import main as export_main
from storage.state import ServerState

DIGITS = {"num_classes": 10, "in_channels": 1, "image_size": 8}
FASHION = {"num_classes": 10, "in_channels": 1, "image_size": 28}


@pytest.mark.parametrize("spec", [
    {"name": "cnn", "fed2_groups": 10},
    {"name": "cnn", "fed2_groups": 4, "fed2_from": 3, "pan": "mul"},
    {"name": "vgg9", "width": 0.25, "norm": "gn", "fed2_groups": 10, "fed2_from": 4},
    {"name": "mlp", "hidden": [40, 30], "norm": "gn", "fed2_groups": 3, "fed2_from": 1,
     "fed2_allocation": [2, 2, 1, 0, 0, 1, 2, 0, 1, 2]},
])
def test_a_class_logit_reaches_only_its_groups_parameters(spec):
    model = build_model({**spec, **FASHION})
    owners = row_groups(model)
    allocation = torch.tensor(model.classifier.allocation)
    grouped_layers = {name.rsplit(".", 1)[0] for name in owners}
    assert "classifier" in grouped_layers and len(grouped_layers) >= 2
    x = torch.randn(3, 1, 28, 28)
    for c in range(10):
        model.zero_grad()
        model(x)[:, c].sum().backward()
        for name, param in model.named_parameters():
            if name not in owners:
                continue
            per_row = param.grad.reshape(param.shape[0], -1).abs().sum(1)
            assert per_row[owners[name] != allocation[c]].max() == 0, (name, c)   # no other group moves
            assert per_row[owners[name] == allocation[c]].max() > 0, (name, c)    # its own group does


def test_the_decoupled_classifier_ignores_values_outside_its_mask():
    model = build_model({"name": "cnn", "fed2_groups": 5, **FASHION}).eval()
    head = model.classifier
    assert isinstance(head, DecoupledClassifier)
    assert torch.count_nonzero(head.weight * (1 - head.mask)) == 0    # born zero outside the groups
    x = torch.randn(4, 1, 28, 28)
    with torch.no_grad():
        before = model(x)
        head.weight.add_(1e3 * (1 - head.mask))                        # what a forged update could put there
        torch.testing.assert_close(model(x), before)


def test_grouped_widths_are_rounded_to_the_groups_and_the_size_is_stated():
    model = build_model({"name": "cnn", "fed2_groups": 10, **FASHION})
    conv2, fc = model.features[4], model.features[9]
    assert (conv2.out_channels, conv2.groups) == (70, 1)        # groups start here: filters read all shared inputs
    assert (fc.in_features, fc.out_features, fc.groups) == (70 * 7 * 7, 130, 10)   # block-diagonal above
    size = model_size({"name": "cnn", "fed2_groups": 10, **FASHION})
    assert size["original"] == {"parameters": 421_834, "multiply_adds": 4_241_152}
    assert size["parameters"] == sum(p.numel() for p in model.parameters())
    assert size["parameters"] < size["original"]["parameters"] / 5    # the grouped fc holds a tenth of the weights
    assert "original" not in model_size({"name": "cnn", **FASHION})


@pytest.mark.parametrize("options, message", [
    ({"fed2_groups": 11}, "more than the 10 classes"),
    ({"fed2_groups": 0, "fed2_from": 2}, "fed2_groups must be a positive integer"),
    ({"fed2_groups": 10, "fed2_from": 5}, r"1 to 4 for this model.*fed2-depth"),
    ({"fed2_groups": 2, "fed2_allocation": [0, 1]}, "each of the 10 classes a group"),
    ({"fed2_groups": 3, "fed2_allocation": [0] * 5 + [1] * 5}, r"leaves groups \[2\] without a class"),
    ({"fed2_groups": 2, "head": "sphere"}, "both replace the last layer"),
])
def test_impossible_fed2_structures_are_refused_with_the_fix(options, message):
    with pytest.raises(ModelSpecError, match=message):
        build_model({"name": "cnn", **FASHION, **options})


def test_models_without_fed2_options_are_built_exactly_as_before():
    torch.manual_seed(0)
    plain = build_model({"name": "vgg9", "width": 0.25, **FASHION})
    assert not row_groups(plain) and type(plain.classifier) is torch.nn.Linear
    assert sum(p.numel() for p in plain.parameters()) == model_size({"name": "vgg9", "width": 0.25,
                                                                      **FASHION})["parameters"]


# --------------------------------------------------------------------------- paired averaging

# An mlp on 8x8 inputs with hidden widths [4, 4]: layer 1 shared, layer 2 and the classifier in 2 groups;
# classes 0, 2, 4, 6, 8 belong to group 0 and the odd ones to group 1.
SMALL = {"name": "mlp", "hidden": [4, 4], "fed2_groups": 2, "fed2_from": 2, **DIGITS}


def _result(client: str, value: float, counts: list[int]) -> ClientResult:
    model = build_model(SMALL)
    sent = _state().params   # what the task sent: the client trained every tensor to ``value``
    deltas = {k: torch.full_like(v, value) - sent[k] for k, v in model.state_dict().items()}
    metrics = {"train_loss": 1.0, **class_counts(torch.repeat_interleave(torch.arange(10), torch.tensor(counts)), 10)}
    return ClientResult(client, sum(counts), {}, metrics, deltas, sent)


def _state() -> ServerState:
    model = build_model(SMALL)
    return ServerState(round=0, params={k: torch.full_like(v, -7.0) for k, v in model.state_dict().items()},
                       spec=SMALL)


def test_paired_averaging_weights_each_group_by_the_clients_samples_of_its_classes():
    strategy = Fed2({"epochs": 1}, pairing="holders")
    state = _state()
    strategy.configure_train(1, state, ["a", "b"])
    # a: 3 samples of class 0 and 1 of class 1 (group 0: 3, group 1: 1); b: 2 of class 3 only (group 1: 2).
    a = _result("a", 1.0, [3, 1] + [0] * 8)
    b = _result("b", 4.0, [0, 0, 0, 2] + [0] * 6)
    new = strategy.aggregate_train(1, state, [a, b]).params
    owners = row_groups(build_model(SMALL))
    for name in federated_names(build_model(SMALL)):
        expected = torch.full_like(new[name], (4 * 1.0 + 2 * 4.0) / 6)              # shared: by samples, 2.0
        if name in owners:
            group = owners[name].view(-1, *([1] * (new[name].dim() - 1))).expand_as(new[name])
            expected = torch.where(group == 0, torch.tensor(1.0),                     # only a holds group 0's classes
                                   torch.tensor((1 * 1.0 + 2 * 4.0) / 3))             # group 1: 1 and 2 samples
        torch.testing.assert_close(new[name], expected, msg=name)
    assert "features.1.weight" not in owners and "features.3.weight" in owners and "classifier.weight" in owners


def test_a_group_no_client_trained_on_keeps_its_previous_value():
    strategy = Fed2({"epochs": 1}, pairing="holders")
    state = _state()
    strategy.configure_train(1, state, ["b"])
    new = strategy.aggregate_train(1, state, [_result("b", 4.0, [0, 5] + [0] * 8)]).params
    owners = row_groups(build_model(SMALL))
    rows = new["classifier.bias"]
    assert rows[owners["classifier.bias"] == 0].eq(-7.0).all() and rows[owners["classifier.bias"] == 1].eq(4.0).all()
    assert new["features.1.weight"].eq(4.0).all()


def test_row_weighted_sums_reduce_in_any_grouping():
    torch.manual_seed(0)
    parts = [RowWeightedSum.of({"w": torch.randn(3, 2)}, {"w": torch.tensor([1.0, 0.0, 2.0]) * (i + 1)})
             for i in range(4)]
    left = RowWeightedSum.reduce(parts).mean({"w": torch.zeros(3, 2)})
    right = (parts[3] + (parts[1] + parts[2]) + parts[0]).mean({"w": torch.zeros(3, 2)})
    torch.testing.assert_close(left, right, rtol=1e-12, atol=0)
    assert left["w"][1].eq(0).all()   # no weight: the previous value


@pytest.mark.parametrize("metrics, message", [
    ({}, "must report its samples of each of the 10 classes"),
    ({f"class_count/{c}": 1.0 for c in range(9)}, "each of the 10 classes"),
    ({**{f"class_count/{c}": 1.0 for c in range(10)}, "class_count/x": 1.0}, "each of the 10 classes"),
    ({**{f"class_count/{c}": 0.0 for c in range(9)}, "class_count/9": -10.0}, "whole numbers >= 0"),
    ({**{f"class_count/{c}": 0.5 for c in range(9)}, "class_count/9": 5.5}, "whole numbers >= 0"),
    ({f"class_count/{c}": 2.0 for c in range(10)}, "add up to its 10 samples"),
])
def test_results_without_a_sound_label_histogram_are_rejected(metrics, message):
    strategy = Fed2({"epochs": 1}, pairing="holders")
    spec = _state().spec   # the class count comes from the network the task ran, not from planning
    plan = TaskPlan("a", "fed2_train", {}, {}, [])
    assert message in strategy.check_result(plan, ClientResult("a", 10, {}, metrics), spec)
    good = {f"class_count/{c}": 1.0 for c in range(10)}
    assert strategy.check_result(plan, ClientResult("a", 10, {}, good), spec) is None
    assert strategy.check_result(TaskPlan("a", "evaluate", {}, {}, []), ClientResult("a", 10, {}, {}), spec) is None


# --------------------------------------------------------------------------- configuration


def _config(**sets):
    return load_config(None, [(*k.split("__", 1), v) for k, v in sets.items()])


def test_the_strategy_alone_brings_ten_groups_and_writes_the_allocation_into_the_spec():
    config = _config(run__strategy="fed2", model__name="cnn")
    assert config.model["fed2_groups"] == 10
    allocation = [c // 2 for c in range(10)]
    config = _config(run__strategy="fed2", model__fed2_groups=5, fed2__allocation=allocation)
    strategy = make_strategy(config)
    assert strategy.model_spec({"name": "cnn", **FASHION})["fed2_allocation"] == allocation
    model = build_model(strategy.model_spec({"name": "cnn", "fed2_groups": 5, **FASHION}))
    assert model.classifier.allocation == tuple(allocation)


@pytest.mark.parametrize("sets, message", [
    ({"model__head": "sphere"}, "model.head"),
    ({"model__fed2_groups": 0}, "model.fed2_groups >= 1"),
])
def test_combinations_that_cannot_work_are_refused(sets, message):
    with pytest.raises(ConfigError, match=message):
        make_strategy(_config(run__strategy="fed2", **sets))


# --------------------------------------------------------------------------- end to end


def test_fed2_over_mosquitto_with_client_processes_exports_float_and_int8(tmp_path, mosquitto, prefix):
    out = tmp_path / "run"
    config = _config(run__strategy="fed2", run__rounds=3, run__out=str(out), model__name="cnn",
                     data__eval="digits", data__partition="dirichlet:0.5", clients__expected=3,
                     clients__spawn=3, clients__round_timeout=60.0, clients__presence_timeout=60.0,
                     train__batch_size=32, transport__broker=mosquitto, transport__prefix=prefix,
                     codec__up="topk:0.5+int8+zstd", fed2__pairing="holders")
    said: list[str] = []
    result = run_federated(config, say=said.append)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    assert all((r["returned"], r["rejected"]) == (3, 0) for r in rows[1:])   # every label histogram accepted
    assert any(p.name.startswith("round") for p in (out / "checkpoints").iterdir())
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"] + 0.3
    assert any("multiply-adds per image (the original model:" in line for line in said)
    card = json.loads((out / "export" / "model.card.json").read_text())
    assert card["model"]["fed2_groups"] == 10 and card["size"]["original"]["parameters"] > card["size"]["parameters"]
    assert card["parity"]["max_abs_diff"] <= 1e-4
    assert result.summary["final_accuracy"] == rows[-1]["test_accuracy"]
    assert export_main([str(out), "--int8", "-o", str(tmp_path / "fed2.onnx")]) == 0
    int8 = json.loads(Path(tmp_path / "fed2.int8.card.json").read_text())
    assert int8["precision"] == "int8" and int8["quantization"]["accuracy_drop_points"] <= 1.0


def test_pairing_all_is_fedavg_over_the_fed2_structure_and_asks_for_no_histogram(tmp_path):
    """With the allocation fixed by the run every client's group g serves the same classes, so the
    paper's pairing averages each group over all clients: the same rows as FedAvg on the same network."""
    def run(strategy: str) -> list[dict]:
        out = tmp_path / strategy
        run_federated(_config(run__strategy=strategy, run__rounds=2, run__out=str(out), model__name="cnn",
                              model__fed2_groups=5, data__eval="digits", data__partition="shards:2",
                              clients__expected=4, clients__spawn=4, transport__kind="inproc",
                              export__enabled=False), say=lambda s: None)
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    fed2, fedavg = run("fed2"), run("fedavg")
    for a, b in zip(fed2, fedavg):
        assert (a["test_accuracy"], a["test_loss"]) == (b["test_accuracy"], b["test_loss"])
    strategy = make_strategy(_config(run__strategy="fed2"))
    state = ServerState(0, {}, {"name": "cnn", "fed2_groups": 10, **FASHION})
    assert {p.objective for p in strategy.configure_train(1, state, ["a"])} == {"train"}
    with pytest.raises(ConfigError, match="fed2.pairing is one of all, holders"):
        _config(run__strategy="fed2", fed2__pairing="some")
