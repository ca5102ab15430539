"""Tests for coordinator.strategies (FedAvg, FedProx, WeightedSum) and FedProx's client side."""

from __future__ import annotations

import dataclasses
import itertools
from functools import reduce

import pytest
import torch

from coordinator.config import ConfigError, RunConfig, load_config
from coordinator.strategy_setup import make_strategy
from edge_client.registry import METHODS
from coordinator.strategies.base import AggregationError, ClientResult, TaskPlan, WeightedSum
from coordinator.strategies.fedavg import FedAvg, FedProx
from edge_client.data import load_dataset
from edge_client.registry import build_model
from edge_client.objectives import LocalData, TaskContext, TrainHyper, train
from profiling.profiler import Profiler
from storage.state import ServerState

TRAIN = dataclasses.asdict(RunConfig().train)


def _state(**params) -> ServerState:
    return ServerState(round=0, params={k: torch.tensor(v, dtype=torch.float32) for k, v in params.items()})


def _result(client_id: str, n: int, sent: dict[str, torch.Tensor] | None = None, **trained) -> ClientResult:
    """A client's answer to a task that sent ``sent`` (zeros by default): its ``trained`` values as deltas."""
    values = {k: torch.tensor(v, dtype=torch.float32) for k, v in trained.items()}
    sent = sent if sent is not None else {k: torch.zeros_like(v) for k, v in values.items()}
    return ClientResult(client_id, n, {}, deltas={k: v - sent[k] for k, v in values.items()}, sent=sent)


# --------------------------------------------------------------------------- FedAvg aggregation


def test_fedavg_two_clients_exact_weighted_mean():
    state = _state(w=[[0.0, 0.0]], b=[0.0])
    results = [_result("a", 1, w=[[1.0, 2.0]], b=[8.0]), _result("b", 3, w=[[5.0, 6.0]], b=[0.0])]
    new = FedAvg(TRAIN).aggregate_train(1, state, results)
    # (1*1 + 3*5)/4 = 4, (1*2 + 3*6)/4 = 5, (1*8 + 3*0)/4 = 2
    assert torch.equal(new.params["w"], torch.tensor([[4.0, 5.0]]))
    assert torch.equal(new.params["b"], torch.tensor([2.0]))
    assert new.round == 1


def test_fedavg_three_clients_counts_1_3_6():
    state = _state(w=[0.0, 0.0], b=[[0.0]])
    results = [_result("a", 1, w=[0.0, 10.0], b=[[1.0]]),
               _result("b", 3, w=[10.0, 0.0], b=[[2.0]]),
               _result("c", 6, w=[20.0, 5.0], b=[[-3.0]])]
    new = FedAvg(TRAIN).aggregate_train(4, state, results)
    # x: (0 + 30 + 120)/10 = 15; y: (10 + 0 + 30)/10 = 4; b: (1 + 6 - 18)/10 = -1.1
    assert torch.equal(new.params["w"], torch.tensor([15.0, 4.0]))
    assert torch.allclose(new.params["b"], torch.tensor([[-1.1]]), rtol=0, atol=1e-7)
    assert all(v.dtype == torch.float32 for v in new.params.values())
    assert new.round == 4


def test_fedavg_result_order_does_not_change_the_mean_beyond_rounding():
    g = torch.Generator().manual_seed(1)
    results = [ClientResult(f"c{i}", n, {}, deltas={"w": torch.randn(5, 4, generator=g)}) for i, n in enumerate([1, 3, 6, 2])]
    state = ServerState(round=0, params={"w": torch.zeros(5, 4)})
    strategy = FedAvg(TRAIN)
    ref = strategy.aggregate_train(1, state, results).params["w"]
    expected = sum(r.deltas["w"].double() * r.num_samples for r in results) / 12
    assert torch.allclose(ref.double(), expected, rtol=0, atol=1e-6)
    for perm in itertools.permutations(results):
        assert torch.allclose(strategy.aggregate_train(1, state, list(perm)).params["w"], ref, rtol=0, atol=1e-6)


def test_fedavg_single_client_returns_its_model():
    state = _state(w=[1.0, 2.0])
    new = FedAvg(TRAIN).aggregate_train(1, state, [_result("a", 7, state.params, w=[3.5, -1.25])])
    assert torch.equal(new.params["w"], torch.tensor([3.5, -1.25]))


def test_fedavg_partial_results_keep_the_other_params():
    state = ServerState(round=2, params={"w": torch.tensor([1.0, 1.0]), "frozen": torch.tensor([9.0, 8.0]),
                                         "bias": torch.tensor([0.5])}, extra={"note": "kept"})
    results = [_result("a", 1, state.params, w=[2.0, 4.0]), _result("b", 1, state.params, w=[4.0, 0.0])]
    new = FedAvg(TRAIN).aggregate_train(3, state, results)
    assert set(new.params) == {"w", "frozen", "bias"}
    assert torch.equal(new.params["w"], torch.tensor([3.0, 2.0]))
    assert torch.equal(new.params["frozen"], torch.tensor([9.0, 8.0]))
    assert torch.equal(new.params["bias"], torch.tensor([0.5]))
    assert new.extra == {"note": "kept"} and new.round == 3
    # the old state is not modified
    assert torch.equal(state.params["w"], torch.tensor([1.0, 1.0])) and state.round == 2


def test_fedavg_rejects_no_results_and_mismatched_results():
    state = _state(w=[0.0], b=[0.0])
    with pytest.raises(AggregationError, match="nothing to aggregate"):
        FedAvg(TRAIN).aggregate_train(1, state, [])
    with pytest.raises(AggregationError, match="different tensors"):
        FedAvg(TRAIN).aggregate_train(1, state, [_result("a", 1, w=[1.0]), _result("b", 1, b=[1.0])])
    with pytest.raises(AggregationError, match="positive weight"):
        FedAvg(TRAIN).aggregate_train(1, state, [_result("a", 0, w=[1.0])])


# --------------------------------------------------------------------------- FedProx


def test_fedprox_sends_mu_and_aggregates_like_fedavg():
    prox, avg = FedProx(TRAIN, 0.25), FedAvg(TRAIN)
    state = _state(w=[0.0, 0.0])
    plans = prox.configure_train(1, state, ["a", "b"])
    assert all(p.hyper == {**TRAIN, "mu": 0.25} for p in plans)
    assert "mu" not in avg.configure_train(1, state, ["a"])[0].hyper
    results = [_result("a", 1, w=[1.0, 3.0]), _result("b", 3, w=[5.0, -1.0])]
    got, ref = prox.aggregate_train(1, state, results), avg.aggregate_train(1, state, results)
    assert torch.equal(got.params["w"], ref.params["w"])
    assert torch.equal(got.params["w"], torch.tensor([4.0, 0.0]))


def test_fedprox_rejects_negative_mu():
    with pytest.raises(ValueError, match="fedprox.mu must be >= 0"):
        FedProx(TRAIN, -0.1)
    assert FedProx(TRAIN, 0.0).hyper()["mu"] == 0.0


@pytest.mark.parametrize("name", ["fedavg", "fedprox"])
def test_strategy_hyper_is_accepted_by_the_client_objective(name):
    strategy = make_strategy(load_config(None, [("run", "strategy", name)]))
    plan = strategy.configure_train(1, _state(w=[0.0]), ["a"])[0]
    TrainHyper.from_dict(plan.hyper)   # raises ObjectiveError on any unknown or invalid key


# --------------------------------------------------------------------------- WeightedSum


def _parts():
    g = torch.Generator().manual_seed(0)
    shapes = {"w": (3, 4), "b": (4,)}
    return [WeightedSum.of({k: torch.randn(*s, generator=g) for k, s in shapes.items()}, w) for w in (1, 3, 6, 0.5)]


def _close(x: WeightedSum, y: WeightedSum) -> bool:
    return (abs(x.weight - y.weight) <= 1e-12 and x.sums.keys() == y.sums.keys()
            and all(torch.allclose(x.sums[k], y.sums[k], rtol=0, atol=1e-12) for k in x.sums))


def test_weighted_sum_of_is_float64_times_weight():
    t = torch.tensor([1.5, -2.0])
    ws = WeightedSum.of({"t": t}, 3)
    assert ws.sums["t"].dtype == torch.float64
    assert torch.equal(ws.sums["t"], torch.tensor([4.5, -6.0], dtype=torch.float64))
    assert ws.weight == 3.0 and isinstance(ws.weight, float)
    assert torch.equal(ws.mean()["t"], t) and ws.mean()["t"].dtype == torch.float32


def test_weighted_sum_is_associative():
    a, b, c, d = _parts()
    left, right = (a + b) + c, a + (b + c)
    assert _close(left, right)
    assert _close(left, WeightedSum.reduce([a, b, c]))
    assert _close(left, WeightedSum.reduce([c, a, b]))
    every = [a, b, c, d]
    ref = WeightedSum.reduce(every)
    assert _close(ref, (a + b) + (c + d))
    assert _close(ref, a + (b + (c + d)))
    assert _close(ref, WeightedSum.reduce([WeightedSum.reduce([a, d]), WeightedSum.reduce([c, b])]))
    for perm in itertools.permutations(every):
        assert _close(ref, reduce(lambda x, y: x + y, perm))
        assert _close(ref, WeightedSum.reduce(iter(perm)))   # any iterable, e.g. a generator
    assert ref.weight == 10.5


def test_weighted_sum_mean_matches_hand_value():
    parts = [WeightedSum.of({"x": torch.tensor([v])}, w) for v, w in ((2.0, 1), (4.0, 3), (-1.0, 6))]
    assert torch.equal(WeightedSum.reduce(parts).mean()["x"], torch.tensor([0.8]))   # (2 + 12 - 6)/10


@pytest.mark.parametrize("weight", [0, 0.0, -1, -0.5, float("nan")])
def test_weighted_sum_rejects_non_positive_weight(weight):
    with pytest.raises(AggregationError, match="positive weight"):
        WeightedSum.of({"x": torch.ones(1)}, weight)


def test_weighted_sum_rejects_mismatched_keys():
    a = WeightedSum.of({"x": torch.ones(1)}, 1)
    b = WeightedSum.of({"y": torch.ones(1)}, 1)
    c = WeightedSum.of({"x": torch.ones(1), "y": torch.ones(1)}, 1)
    for left, right in ((a, b), (a, c), (c, a)):
        with pytest.raises(AggregationError, match="different tensors"):
            left + right
    with pytest.raises(AggregationError):
        WeightedSum.reduce([a, a, b])


def test_weighted_sum_reduce_empty_raises():
    with pytest.raises(AggregationError, match="nothing to aggregate"):
        WeightedSum.reduce([])
    with pytest.raises(AggregationError):
        WeightedSum.reduce(iter(()))


# --------------------------------------------------------------------------- planning


def test_configure_train_plans():
    params = {"z.bias": torch.zeros(2), "a.weight": torch.ones(2, 2), "m.weight": torch.full((3,), 2.0)}
    state = ServerState(round=0, params=params)
    strategy = FedAvg(TRAIN)
    plans = strategy.configure_train(5, state, ["dev2", "dev1", "dev3"])
    assert [p.client_id for p in plans] == ["dev2", "dev1", "dev3"]
    for plan in plans:
        assert isinstance(plan, TaskPlan)
        assert plan.objective == "train"
        assert plan.up == ["a.weight", "m.weight", "z.bias"]
        assert set(plan.down) == set(params)
        assert all(torch.equal(plan.down[k], params[k]) for k in params)
        assert plan.hyper == TRAIN
    plans[0].hyper["lr"] = 123.0   # each plan has its own hyper dict
    assert plans[1].hyper["lr"] == TRAIN["lr"] and strategy.hyper()["lr"] == TRAIN["lr"]
    assert strategy.configure_train(1, state, []) == []


def test_initialize_starts_at_round_zero():
    params, spec = {"w": torch.ones(2)}, {"name": "mlp"}
    state = FedAvg(TRAIN).initialize(spec, params)
    assert state.round == 0 and state.params is params and state.spec is spec and state.extra == {}


# --------------------------------------------------------------------------- registry


def test_make_strategy_fedavg_and_fedprox():
    assert set(METHODS) >= {"fedavg", "fedprox", "spherefed", "dfl"}
    avg = make_strategy(load_config(None, [("run", "strategy", "fedavg"), ("train", "lr", 0.01)]))
    assert type(avg) is FedAvg and avg.name == "fedavg"
    assert avg.hyper() == {**TRAIN, "lr": 0.01}
    prox = make_strategy(load_config(None, [("run", "strategy", "fedprox"), ("fedprox", "mu", 0.5)]))
    assert type(prox) is FedProx and prox.name == "fedprox"
    assert prox.mu == 0.5 and prox.hyper() == {**TRAIN, "mu": 0.5}


def test_an_unknown_strategy_is_refused_when_the_config_is_read():
    with pytest.raises(ConfigError, match=r"unknown strategy 'scaffold'; available: fedavg, fedprox, spherefed, fedavg_ffc, dfl"):
        load_config(None, [("run", "strategy", "scaffold")])
    config = load_config(None, [])
    with pytest.raises(ConfigError, match="unknown strategy 'scaffold'"):
        make_strategy(dataclasses.replace(config, run=dataclasses.replace(config.run, strategy="scaffold")))


def test_negative_fedprox_mu_is_a_config_error():
    with pytest.raises(ConfigError, match="fedprox.mu"):
        make_strategy(load_config(None, [("run", "strategy", "fedprox"), ("fedprox", "mu", -0.5)]))


# --------------------------------------------------------------------------- FedProx client side

SPEC = {"name": "mlp", "num_classes": 10, "in_channels": 1, "image_size": 8, "hidden": [16]}


@pytest.fixture(scope="module")
def local_data() -> LocalData:
    ds = load_dataset("digits")
    return LocalData(torch.from_numpy(ds.x_train[:192]).clone(), torch.from_numpy(ds.y_train[:192]).clone())


def _trained(data: LocalData, hyper: dict, seed: int = 0, init_seed: int = 0):
    torch.manual_seed(init_seed)
    model = build_model(SPEC)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    out = train(model, data, hyper, TaskContext(seed, 1, "c", None, Profiler()))
    end = {k: v.clone() for k, v in model.state_dict().items()}
    return start, end, out


def _distance(a: dict, b: dict) -> float:
    return float(sum(((a[k] - b[k]) ** 2).sum() for k in a).sqrt())


@pytest.mark.parametrize("lr,momentum,mu", [
    (1e-4, 0.0, 1e4),    # huge mu; lr * mu = 1 keeps the explicit SGD step on the proximal term stable
    (0.05, 0.9, 20.0),   # the default optimizer with a strong proximal term
])
def test_fedprox_term_keeps_weights_near_the_start(local_data, lr, momentum, mu):
    base = {"epochs": 3, "batch_size": 32, "lr": lr, "momentum": momentum}
    start0, end0, out0 = _trained(local_data, {**base, "mu": 0.0})
    start1, end1, out1 = _trained(local_data, {**base, "mu": mu})
    assert all(torch.equal(start0[k], start1[k]) for k in start0)   # same initial weights
    free, held = _distance(start0, end0), _distance(start1, end1)
    assert free > 0 and held > 0
    assert held < free / 10, (held, free)
    assert out0.num_samples == out1.num_samples == len(local_data)


def test_train_is_deterministic_given_the_seed(local_data):
    hyper = {"epochs": 1, "batch_size": 16, "lr": 0.05, "mu": 0.01}
    _, a, out_a = _trained(local_data, hyper, seed=7)
    _, b, out_b = _trained(local_data, hyper, seed=7)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert out_a.metrics == out_b.metrics
    _, c, _ = _trained(local_data, hyper, seed=8)   # another shuffling seed: another result
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_train_reports_samples_and_loss(local_data):
    profiler = Profiler()
    torch.manual_seed(0)
    model = build_model(SPEC)
    out = train(model, local_data, {"epochs": 1, "batch_size": 64, "lr": 0.05}, TaskContext(0, 1, "c", None, profiler))
    assert out.num_samples == len(local_data) == 192
    assert 0 < out.metrics["train_loss"] < 10
    assert len(profiler.steps) == 3 and profiler.samples == 192
