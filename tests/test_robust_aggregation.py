"""Robust aggregation: the rules against hand-computed values, and 2 hostile clients of 10 on real digits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from coordinator.aggregation import Aggregator, norm_bound_keep, tolerance, trimmed_count, update_norms
from coordinator.config import ConfigError, load_config
from coordinator.strategies.base import ClientResult
from coordinator.strategies.fedavg import FedAvg
from coordinator.strategy_setup import make_strategy
from storage.state import ServerState

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from poisoning import HOSTILE, run  # noqa: E402

def _results(*rows: list[float], weights: list[float] | None = None):
    return [({"w": torch.tensor(r)}, w) for r, w in zip(rows, weights or [1.0] * len(rows))]


def test_each_rule_against_hand_computed_values():
    results = _results([1.0, -1.0], [2.0, 0.0], [3.0, 1.0], [100.0, -50.0], weights=[1, 1, 2, 1])
    mean = Aggregator("mean").combine(results)["w"]
    torch.testing.assert_close(mean, torch.tensor([(1 + 2 + 6 + 100) / 5, (-1 + 0 + 2 - 50) / 5], dtype=torch.float64))
    median = Aggregator("median").combine(results)["w"]
    torch.testing.assert_close(median, torch.tensor([2.5, -0.5]), check_dtype=False)          # middle two of four, averaged
    trimmed = Aggregator("trimmed_mean", trim=0.25).combine(results)["w"]
    torch.testing.assert_close(trimmed, torch.tensor([2.5, -0.5]), check_dtype=False)         # one dropped at each end
    # clipped: norms 1.414, 2, 3.162, 111.8; the median (torch: the lower middle) is 2.0
    clipped = Aggregator("clipped_mean").combine(results)["w"]
    big = torch.tensor([100.0, -50.0]) * 2.0 / torch.tensor([100.0, -50.0]).norm()
    third = torch.tensor([3.0, 1.0]) * 2.0 / torch.tensor([3.0, 1.0]).norm()
    expected = (torch.tensor([1.0, -1.0]) + torch.tensor([2.0, 0.0]) + 2 * third + big) / 5
    torch.testing.assert_close(clipped, expected, check_dtype=False)


def test_trimmed_mean_drops_the_fraction_as_written():
    """0.29 of 100 is 29 per side, though 0.29 * 100 is 28.999... in floats: 29 hostile clients at each
    end are all dropped."""
    assert trimmed_count(0.29, 100) == 29 and trimmed_count(0.2, 10) == 2 and trimmed_count(0.2, 4) == 0
    assert trimmed_count(0.49, 2) == 0                       # never the whole round
    results = _results(*[[1e6, 1.0]] * 29, *[[-1e6, 1.0]] * 29, *[[1.0, 1.0]] * 42)
    torch.testing.assert_close(Aggregator("trimmed_mean", trim=0.29).combine(results)["w"],
                               torch.tensor([1.0, 1.0]), check_dtype=False)
    results = _results(*[[1e6]] * 29, *[[0.0]] * 29, *[[1.0]] * 42)
    torch.testing.assert_close(Aggregator("trimmed_mean", trim=0.29).combine(results)["w"],
                               torch.tensor([1.0]), check_dtype=False)


def test_the_shipped_trim_outvotes_two_hostile_clients_of_ten():
    assert load_config(None).aggregate.trim == Aggregator().trim == 0.2
    said = tolerance("trimmed_mean", per_round=10)
    assert said.tolerated == 2 and not said.warning
    assert said.message == "aggregation: trimmed_mean (trim 0.2) tolerates up to 2 hostile clients of the 10 a round"


@pytest.mark.parametrize("rule, trim, norm_bound, per_round, min_results, tolerated, warned", [
    ("mean", 0.2, 0.0, 10, 0, 0, False),              # no defence asked for: said, not warned
    ("median", 0.2, 0.0, 10, 0, 4, False),            # fewer than half
    ("median", 0.2, 0.0, 9, 0, 4, False),
    ("median", 0.2, 0.0, 2, 0, 0, True),              # the median of two is their mean
    ("trimmed_mean", 0.1, 0.0, 10, 0, 1, False),      # one per side: not the 2 of 10 the docs measure
    ("trimmed_mean", 0.2, 0.0, 4, 0, 0, True),        # floor(0.8) drops nothing
    ("trimmed_mean", 0.25, 0.0, 4, 0, 1, False),
    ("trimmed_mean", 0.2, 0.0, 10, 4, 2, True),       # a round may close with 4 results, where it drops none
    ("clipped_mean", 0.2, 0.0, 10, 0, 4, False),      # bounded while the median norm is honest
    ("mean", 0.2, 3.0, 10, 0, 4, False),              # the norm bound's median too
    ("trimmed_mean", 0.2, 3.0, 10, 0, 4, False),
])
def test_tolerance_at_the_round_size(rule, trim, norm_bound, per_round, min_results, tolerated, warned):
    said = tolerance(rule, trim=trim, norm_bound=norm_bound, per_round=per_round, min_results=min_results)
    assert said.tolerated == tolerated and bool(said.warning) is warned, said
    assert said.message.startswith(f"aggregation: {rule}") and "\n" not in said.message
    if said.warning and rule == "trimmed_mean" and per_round > 2:
        assert "raise aggregate.trim to 0.25 or more" in said.warning


def test_tolerance_names_the_smaller_rounds_of_min_results():
    said = tolerance("trimmed_mean", per_round=10, min_results=6)
    assert said.message.endswith("; 1 when a round closes with the 6 results of clients.min_results")
    bounded = tolerance("clipped_mean", per_round=10)
    assert "(bounded, not removed)" in bounded.message


def test_rules_work_on_updates_not_on_where_the_model_is():
    state = ServerState(round=0, params={"w": torch.tensor([10.0, 10.0])})
    deltas = (torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 0.0]), torch.tensor([0.0, 30.0]))
    results = [ClientResult(f"c{i}", 1, {}, deltas={"w": d}, sent=state.params) for i, d in enumerate(deltas)]
    strategy = FedAvg({})
    strategy.aggregator = Aggregator("median")
    torch.testing.assert_close(strategy.aggregate_train(1, state, results).params["w"], torch.tensor([10.0, 10.0]))
    norms = update_norms([r.deltas for r in results])
    assert norms == pytest.approx([1.0, 1.0, 30.0])
    assert norm_bound_keep(norms, 3.0) == [True, True, False]
    assert norm_bound_keep(norms + [float("nan")], 3.0)[-1] is False
    assert norm_bound_keep(norms, 0.0) == [True, True, True]


def test_rules_that_do_not_apply_are_refused():
    with pytest.raises(ConfigError, match="aggregate.rule is one of"):
        load_config(None, [("aggregate", "rule", "mode")])
    with pytest.raises(ConfigError, match="combines results its own way"):
        make_strategy(load_config(None, [("run", "strategy", "dfl"), ("aggregate", "rule", "median")]))
    with pytest.raises(ConfigError, match="combines results its own way"):
        make_strategy(load_config(None, [("run", "strategy", "fed2"), ("fed2", "pairing", "holders"),
                                         ("aggregate", "norm_bound", 3.0)]))
    assert make_strategy(load_config(None, [("run", "strategy", "fedprox"),
                                            ("aggregate", "rule", "trimmed_mean")])).aggregator.rule == "trimmed_mean"


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> float:
    return run(tmp_path_factory.mktemp("clean"), factor=1.0, defence={}, rounds=6, seed=0)["accuracy"]


@pytest.mark.parametrize("factor", [20.0, 1000.0, -4.0], ids=["scaled", "scaled-1000", "sign-flipped"])
def test_two_hostile_clients_wreck_the_mean_and_not_the_robust_rules(factor, clean, tmp_path):
    """Real training on digits, 10 clients, 2 of them sending ``factor`` x their update, every rule
    with its shipped defaults (``python bench/poisoning.py`` measures every rule, 3 seeds, against
    the 2-point goal)."""
    assert clean > 0.9
    if factor != 1000.0:   # x1000 makes the mean's model non-finite and the run stops after a round timeout
        assert run(tmp_path / "mean", factor=factor, defence={}, rounds=6, seed=0)["accuracy"] < 0.3
    for name, defence in (("median", {"rule": "median"}), ("trimmed", {"rule": "trimmed_mean"}),
                          ("clipped", {"rule": "clipped_mean"})):
        assert run(tmp_path / name, factor=factor, defence=defence, rounds=6, seed=0)["accuracy"] > 0.8, name
    bounded = run(tmp_path / "bound", factor=factor, defence={"norm_bound": 3.0}, rounds=6, seed=0)
    assert bounded["norm_rejected"] == 6 * len(HOSTILE) and bounded["accuracy"] > 0.8


def test_a_run_says_what_its_aggregation_tolerates_and_warns_when_it_is_nothing(tmp_path, caplog):
    from coordinator.runtime.run import run_federated

    def start(out, **sets):
        said: list[str] = []
        overrides = {"run.rounds": 1, "run.out": str(out), "model.name": "mlp", "model.hidden": [8],
                     "data.eval": "digits", "clients.expected": 4, "clients.spawn": 4, "transport.kind": "inproc",
                     "export.enabled": False, **sets}
        run_federated(load_config(None, [(*k.split(".", 1), v) for k, v in overrides.items()]), say=said.append)
        return said

    said = start(tmp_path / "median", **{"aggregate.rule": "median"})
    assert "aggregation: median tolerates up to 1 hostile client of the 4 a round" in said, said
    with caplog.at_level("WARNING", logger="fedge"):
        said = start(tmp_path / "trimmed", **{"aggregate.rule": "trimmed_mean"})
    assert any("trimmed_mean (trim 0.2) tolerates no hostile client" in line for line in said), said
    assert any("trimmed_mean" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


def test_client_objectives_are_for_in_process_clients_only(tmp_path):
    from coordinator.runtime.run import run_federated

    config = load_config(None, [("run", "out", str(tmp_path / "run")), ("clients", "spawn", 2),
                                ("clients", "expected", 2)])   # transport.kind = "mqtt"
    with pytest.raises(ConfigError, match="in-process clients"):
        run_federated(config, say=lambda s: None, client_objectives=lambda cid: {})
    assert not (tmp_path / "run").exists()
