"""Server optimizers (FedAdam, FedYogi, FedAdagrad, FedAvgM) against hand computations, their moments
through a checkpoint, and a short federated run of each."""

from __future__ import annotations

import math

import pytest
import torch

from coordinator.config import ConfigError, load_config
from coordinator.runtime.run import run_federated
from coordinator.strategies.base import ClientResult
from coordinator.strategies.fedavg import FedAvg
from coordinator.strategy_setup import make_strategy
from methods.fedadagrad.strategy import FedAdagrad, FedAdagradSection
from methods.fedadam.strategy import FedAdam, FedAdamSection
from methods.fedavgm.strategy import FedAvgM, FedAvgMSection
from methods.fedyogi.strategy import FedYogi, FedYogiSection
from storage.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from storage.state import ServerState

START = [1.0, -2.0]
ROUNDS = [[0.5, -0.1], [0.3, 0.2]]   # the clients' mean update in rounds 1 and 2


def _answers(update: list[float], sent: dict[str, torch.Tensor]) -> list[ClientResult]:
    """Two clients (1 and 3 samples) whose weighted mean update is ``update``."""
    d = torch.tensor(update, dtype=torch.float64)
    a, b = d + torch.tensor([0.4, -0.8], dtype=torch.float64), d - torch.tensor([0.4, -0.8], dtype=torch.float64) / 3
    return [ClientResult("a", 1, {}, deltas={"w": a.float()}, sent=sent),
            ClientResult("b", 3, {}, deltas={"w": b.float()}, sent=sent)]


def _run(strategy: FedAvg) -> ServerState:
    state = ServerState(round=0, params={"w": torch.tensor(START)})
    for round, update in enumerate(ROUNDS, 1):
        state = strategy.aggregate_train(round, state, _answers(update, state.params))
    return state


def _adaptive_by_hand(second_moment, lr: float, beta1: float, beta2: float, tau: float) -> list[float]:
    """Reddi et al.'s Algorithm 2, one coordinate at a time in plain floats."""
    out = []
    for i, x in enumerate(START):
        m, v = 0.0, tau ** 2
        for update in ROUNDS:
            d = update[i]
            m = beta1 * m + (1 - beta1) * d
            v = second_moment(v, d * d, beta2)
            x = x + lr * m / (math.sqrt(v) + tau)
        out.append(x)
    return out


def _sign(x: float) -> float:
    return (x > 0) - (x < 0)


@pytest.mark.parametrize("cls, section, rule", [
    (FedAdam, FedAdamSection(lr=0.1), lambda v, d2, b2: b2 * v + (1 - b2) * d2),
    (FedYogi, FedYogiSection(lr=0.1), lambda v, d2, b2: v - (1 - b2) * d2 * _sign(v - d2)),
    (FedAdagrad, FedAdagradSection(lr=0.1), lambda v, d2, b2: v + d2),
])
def test_adaptive_steps_match_the_hand_computation(cls, section, rule):
    got = _run(cls({}, section))
    expected = _adaptive_by_hand(rule, section.lr, section.beta1, section.beta2, section.tau)
    torch.testing.assert_close(got.params["w"], torch.tensor(expected), rtol=0, atol=1e-6)
    assert set(got.buffers) == {"m/w", "v/w"} and got.round == 2


def test_fedadam_and_fedyogi_differ_where_the_update_shrinks():
    adam, yogi = _run(FedAdam({}, FedAdamSection(lr=0.1))), _run(FedYogi({}, FedYogiSection(lr=0.1)))
    assert not torch.allclose(adam.buffers["v/w"], yogi.buffers["v/w"])


def test_fedavgm_matches_the_hand_computation_and_is_fedavg_without_momentum():
    got = _run(FedAvgM({}, FedAvgMSection(lr=0.5, momentum=0.9)))
    expected = []
    for i, x in enumerate(START):
        v = 0.0
        for update in ROUNDS:
            v = 0.9 * v + update[i]
            x = x + 0.5 * v
        expected.append(x)
    torch.testing.assert_close(got.params["w"], torch.tensor(expected), rtol=0, atol=1e-6)
    plain = _run(FedAvgM({}, FedAvgMSection(lr=1.0, momentum=0.0)))
    torch.testing.assert_close(plain.params["w"], _run(FedAvg({})).params["w"], rtol=0, atol=1e-7)


def test_moments_survive_a_checkpoint(tmp_path):
    """Resuming from a checkpoint takes the same step as the unbroken run: the moments are in it."""
    strategy = FedAdam({}, FedAdamSection(lr=0.1))
    state = ServerState(round=0, params={"w": torch.tensor(START)}, spec={"name": "test"})
    state = strategy.aggregate_train(1, state, _answers(ROUNDS[0], state.params))
    save_checkpoint(tmp_path, state, {"run_id": "r"})
    loaded, _ = load_checkpoint(latest_checkpoint(tmp_path))
    assert set(loaded.params) == {"w"} and set(loaded.buffers) == {"m/w", "v/w"}
    for key, value in state.buffers.items():
        assert torch.equal(loaded.buffers[key], value), key
    unbroken = strategy.aggregate_train(2, state, _answers(ROUNDS[1], state.params))
    resumed = strategy.aggregate_train(2, loaded, _answers(ROUNDS[1], loaded.params))
    assert torch.equal(unbroken.params["w"], resumed.params["w"])


def test_the_tasks_never_carry_the_moments():
    strategy = FedAdam({}, FedAdamSection())
    state = _run(strategy)
    plan = strategy.configure_train(3, state, ["a"])[0]
    assert set(plan.down) == set(plan.up) == {"w"}


@pytest.mark.parametrize("setting, message", [
    (("fedadam", "lr", 0.0), "fedadam.lr (the server learning rate) must be > 0"),
    (("fedyogi", "beta2", 1.0), "fedyogi.beta2 must be in (0, 1)"),
    (("fedadagrad", "tau", 0.0), "fedadagrad.tau must be > 0"),
    (("fedavgm", "momentum", 1.0), "fedavgm.momentum must be in [0, 1)"),
])
def test_bad_settings_are_refused_with_what_to_change(setting, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_config(None, [setting])


@pytest.mark.parametrize("name", ["fedadam", "fedyogi", "fedadagrad", "fedavgm"])
def test_each_optimizer_runs_a_federation(tmp_path, name):
    sets = {"run.strategy": name, "run.rounds": 2, "run.out": str(tmp_path), "model.name": "mlp",
            "data.eval": "digits", "data.partition": "dirichlet:0.5", "clients.expected": 4, "clients.spawn": 4,
            "clients.per_round": 2, "transport.kind": "inproc", "export.enabled": False}
    config = load_config(None, [(*k.split(".", 1), v) for k, v in sets.items()])
    assert type(make_strategy(config)).name == name
    result = run_federated(config, say=lambda s: None)
    state, _ = load_checkpoint(latest_checkpoint(result.out_dir / "checkpoints"))
    assert state.round == 2 and state.buffers and set(state.buffers) <= {f"{kind}/{k}" for k in state.params
                                                                          for kind in ("m", "v", "momentum")}


def _config(**sets):
    return load_config(None, [(*k.split("__", 1), v) for k, v in sets.items()])


@pytest.mark.parametrize("strategy", ["fedprox", "spherefed", "fedavg_ffc", "fed2", "dfl"])
def test_any_strategy_that_combines_deltas_takes_any_server_optimizer(strategy):
    built = make_strategy(_config(run__strategy=strategy, server__optimizer="fedyogi", fedyogi__lr=0.1))
    assert type(built.optimizer).name == "fedyogi" and type(built).name == strategy
    alone = make_strategy(_config(run__strategy=strategy))
    assert type(alone.optimizer).name == "fedavg"   # its own step when none is named


def test_fedprox_with_fedyogi_steps_as_fedyogi_does_and_trains_as_fedprox_does():
    both = make_strategy(_config(run__strategy="fedprox", fedprox__mu=0.1, server__optimizer="fedyogi",
                                 fedyogi__lr=0.1))
    assert both.hyper()["mu"] == 0.1
    assert torch.equal(_run(both).params["w"], _run(FedYogi({}, FedYogiSection(lr=0.1))).params["w"])


def test_a_named_optimizer_is_its_shorthand_strategy_to_the_bit():
    for name, shorthand in [("fedadam", FedAdam), ("fedavgm", FedAvgM)]:
        section = {"fedadam": FedAdamSection(lr=0.1), "fedavgm": FedAvgMSection(lr=0.5)}[name]
        staged = make_strategy(_config(server__optimizer=name, **{f"{name}__lr": section.lr}))
        assert torch.equal(_run(staged).params["w"], _run(shorthand({}, section)).params["w"])


@pytest.mark.parametrize("sets, message", [
    ({"run__strategy": "fedma", "run__rounds": 8, "server__optimizer": "fedyogi"},
     r"server.optimizer = 'fedyogi' cannot step run.strategy = 'fedma': .* \(fedavg, fedprox, spherefed"),
    ({"run__strategy": "fedadam", "server__optimizer": "fedyogi"}, "is FedAvg with its own server optimizer"),
    ({"server__optimizer": "adamw"}, "server.optimizer must be one of fedavg, fedadam, fedyogi"),
])
def test_an_optimizer_a_strategy_cannot_take_is_refused_naming_those_that_can(sets, message):
    with pytest.raises(ConfigError, match=message):
        make_strategy(_config(**sets))
