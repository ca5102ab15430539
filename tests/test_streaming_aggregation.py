"""Results folded into the round's aggregate as they arrive: the same model, without holding every result."""

from __future__ import annotations

import random

import pytest
import torch

from coordinator.config import load_config
from coordinator.runtime.run import run_federated
from coordinator.strategies.base import AggregationError, ClientResult, WeightedSum
from coordinator.strategies.fedavg import FedAvg
from methods.fed2.strategy import Fed2
from methods.fedma.strategy import FedMA
from coordinator.aggregation import Aggregator
from storage.checkpoint import latest_checkpoint, load_checkpoint


def _results(n: int, seed: int = 0) -> list[ClientResult]:
    g = torch.Generator().manual_seed(seed)
    return [ClientResult(f"c{i:03d}", int(torch.randint(1, 5_000, (1,), generator=g)), {},
                         deltas={"w": torch.randn(64, 32, generator=g) * 10 ** float(torch.randint(-3, 3, (1,),
                                                                                                  generator=g)),
                                 "b": torch.randn(64, generator=g)}) for i in range(n)]


def test_folding_in_any_order_gives_the_sorted_order_sum():
    results = _results(200)
    sorted_sum = WeightedSum.reduce(WeightedSum.of(r.deltas, r.num_samples) for r in results)
    strategy = FedAvg({})
    for seed in range(5):
        arrival = results[:]
        random.Random(seed).shuffle(arrival)
        partial = None
        for r in arrival:
            partial = strategy.fold("train", partial, r)
        assert partial.weight == sorted_sum.weight
        for name, total in sorted_sum.sums.items():
            relative = ((partial.sums[name] - total).abs().max() / total.abs().max()).item()
            assert relative < 1e-12, (name, relative)


def test_only_associative_rules_stream():
    assert FedAvg({}).streams("train") and not FedAvg({}).streams("evaluate")
    robust = FedAvg({})
    robust.aggregator = Aggregator(rule="median")
    assert not robust.streams("train")
    assert not FedMA.streams(object.__new__(FedMA), "train")   # matching needs every client's layer at once
    holders = object.__new__(Fed2)
    holders.pairing, holders.aggregator = "holders", Aggregator()
    assert not holders.streams("train")

    class OwnAggregation(FedAvg):   # written before streaming: gets every result, as before
        def aggregate_train(self, round, state, results):
            return super().aggregate_train(round, state, results)

    assert not OwnAggregation({}).streams("train")


def _config(out, **sets):
    base = {"run.rounds": 3, "run.out": str(out), "model.name": "cnn", "data.eval": "digits",
            "data.partition": "dirichlet:0.5", "clients.expected": 6, "clients.spawn": 6, "clients.per_round": 4,
            "transport.kind": "inproc", "export.enabled": False, **sets}
    return load_config(None, [(*k.split(".", 1), v) for k, v in base.items()])


def test_a_streamed_run_holds_no_client_tensors_and_matches_the_held_one(tmp_path, monkeypatch):
    seen: list[tuple[bool, int]] = []          # (partial given, tensors held) per aggregation
    original = FedAvg.aggregate_train

    def spy(self, round, state, results, partial=None):
        seen.append((partial is not None, sum(len(r.tensors) + len(r.deltas) for r in results)))
        return original(self, round, state, results, partial)

    monkeypatch.setattr(FedAvg, "aggregate_train", spy)
    finals = {}
    # run.diagnostics needs every client's model, so it keeps the held path: the reference
    for name, sets in {"streamed": {}, "held": {"run.diagnostics": True}}.items():
        result = run_federated(_config(tmp_path / name, **sets), say=lambda s: None)
        state, _ = load_checkpoint(latest_checkpoint(result.out_dir / "checkpoints"))
        finals[name] = state.params
    assert seen[:3] == [(True, 0)] * 3                       # streamed: nothing but the partial at the end
    assert all(given is False and held > 0 for given, held in seen[3:])
    for key, value in finals["held"].items():
        torch.testing.assert_close(finals["streamed"][key], value, rtol=1e-5, atol=1e-6)


def test_a_result_without_samples_cannot_be_folded():   # the engine rejects it like a malformed result
    with pytest.raises(AggregationError, match="positive weight"):
        FedAvg({}).fold("train", None, ClientResult("c", 0, {}, deltas={"w": torch.ones(2)}))
