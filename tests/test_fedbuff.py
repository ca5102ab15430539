"""Async mode's aggregation against FedBuff as published (Nguyen et al., AISTATS 2022, Algorithm 1):
each delta times s(t) = (1 + t) ** -a, summed and divided by K, every result counting equally, K
results per version; and ``async.weighting = "normalized"``, the sample-weighted rule kept beside it."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from coordinator.config import ConfigError, load_config
from coordinator.runtime.async_buffer import AsyncBuffer, Batch, staleness_discount
from coordinator.runtime.async_pace import PaceBook, VersionClock
from coordinator.runtime.asynchronous import AsyncRun, Flight
from coordinator.runtime.round_book import RoundBook
from coordinator.strategies.base import AggregationError, ClientResult, TaskPlan, WeightedSum
from storage.state import ServerState

# (delta of one coordinate, samples, versions behind): different staleness and sample counts
UPDATES = [(0.5, 10, 0), (-1.0, 20, 1), (2.0, 30, 3)]


def result(delta: float, samples: int = 10, loss: float = 1.0) -> ClientResult:
    return ClientResult("c", samples, {}, {"train_loss": loss}, {"w": torch.tensor([delta])})


def batch_of(weighting: str, updates, a: float = 0.5) -> Batch:
    batch = Batch(weighting)
    for delta, samples, staleness in updates:
        batch.add(result(delta, samples), staleness, a)
    return batch


def test_the_update_is_fedbuffs_published_formula():
    """x <- x - eta_g * sum_i s(t_i) delta_i / K, with s(t) = 1 / sqrt(1 + t): sample counts play no part."""
    K = len(UPDATES)
    by_hand = sum(d / (1 + s) ** 0.5 for d, _, s in UPDATES) / K   # (0.5 - 1/sqrt 2 + 2/2) / 3
    batch = batch_of("fedbuff", UPDATES)
    assert batch.update(1.0)["w"].item() == pytest.approx(by_hand, abs=1e-12)
    assert batch.update(0.3)["w"].item() == pytest.approx(0.3 * by_hand, abs=1e-12)   # server_lr is eta_g
    assert staleness_discount(3, 0.5) == 0.5 and staleness_discount(0, 0.5) == 1.0
    assert batch.columns()["staleness"] == {"0": 1, "1": 1, "3": 1} and batch.columns()["results"] == 3


def test_equally_stale_results_shrink_the_step_by_the_discount():
    """The regression: two results 3 versions behind step s(3) = 0.5 of their mean under FedBuff; under
    the normalized rule the discount cancels and the step is the whole mean."""
    stale = [(1.0, 10, 3), (3.0, 30, 3)]
    assert batch_of("fedbuff", stale).update()["w"].item() == pytest.approx(0.5 * (1.0 + 3.0) / 2)
    assert batch_of("normalized", stale).update()["w"].item() == pytest.approx((10 * 1.0 + 30 * 3.0) / 40)
    fresh = [(1.0, 10, 0), (3.0, 30, 0)]
    assert batch_of("fedbuff", fresh).update()["w"].item() == pytest.approx(2.0)   # no discount when fresh


def test_the_normalized_rule_gives_the_rule_before_fedbuff():
    weights = [n * (1 + s) ** -0.5 for _, n, s in UPDATES]
    by_hand = sum(w * d for w, (d, _, _) in zip(weights, UPDATES)) / sum(weights)
    assert batch_of("normalized", UPDATES).update()["w"].item() == pytest.approx(by_hand, abs=1e-12)
    assert batch_of("normalized", [(d, n, 0) for d, n, _ in UPDATES], a=0.0).update()["w"].item() == \
        pytest.approx(sum(d * n for d, n, _ in UPDATES) / 60, abs=1e-12)   # a = 0, all fresh: FedAvg's mean


def test_a_share_of_the_divisor_keeps_the_sum_associative():
    parts = [WeightedSum.of({"x": torch.tensor([v])}, w, share=1.0) for v, w in ((2.0, 1.0), (4.0, 0.5), (-1.0, 0.25))]
    left, right = (parts[0] + parts[1]) + parts[2], parts[0] + (parts[1] + parts[2])
    assert left.weight == right.weight == 3.0
    assert left.mean(torch.float64)["x"].item() == pytest.approx((2.0 + 2.0 - 0.25) / 3)
    assert torch.allclose(left.sums["x"], right.sums["x"])
    with pytest.raises(AggregationError, match="positive share"):
        WeightedSum.of({"x": torch.ones(1)}, 1.0, share=0.0)


def test_a_version_never_holds_more_than_k_results():
    """Five results taken while the model is at version 4, K = 2: three batches of 2, 2 and 1, each result
    counted as stale as the version it will meet (FedBuff's server would have made the versions between)."""
    buffer = AsyncBuffer(size=2)
    met = []
    for delta in (1.0, 2.0, 3.0, 4.0, 5.0):
        staleness = buffer.staleness(trained_from=3, version=4)
        met.append(staleness)
        buffer.add(result(delta), staleness)
    assert [b.count for b in buffer.batches] == [2, 2, 1] and buffer.count == 5
    assert met == [1, 1, 2, 2, 3]
    assert buffer.due()
    first = buffer.take()
    assert first.count == 2 and first.update()["w"].item() == pytest.approx((1.0 + 2.0) / 2 * 2 ** -0.5)
    assert buffer.due() and buffer.take().count == 2
    assert not buffer.due() and buffer.count == 1   # the last one waits for a second result


def test_a_batch_put_back_stays_first_and_takes_no_more():
    """A stop while a version is made puts its batch back first; what comes meanwhile starts the next."""
    buffer = AsyncBuffer(size=2)
    for delta in (1.0, 2.0):
        buffer.add(result(delta), buffer.staleness(0, 0))
    taken = buffer.take()
    buffer.add(result(9.0), buffer.staleness(0, 1))   # taken while the version was being made
    buffer.put_back(taken)
    assert [b.count for b in buffer.batches] == [2, 1] and buffer.due()
    assert buffer.staleness(0, 0) == 1   # back at version 0, a new result meets version 1 as the one before did
    assert buffer.take() is taken


def test_every_waiting_batch_goes_through_a_checkpoint_and_back():
    buffer = AsyncBuffer(size=2, weighting="fedbuff")
    for delta, samples, staleness in UPDATES:
        buffer.add(result(delta, samples), staleness)
    state = ServerState(round=3, params={"w": torch.zeros(1)}, buffers={"m/w": torch.ones(1)}, extra={"k": 1})
    saved = buffer.saved_in(state, {"t1": ["a", 3]})
    back, rest, flying = AsyncBuffer.taken_from(saved, size=2)
    assert rest == state and flying == {"t1": ["a", 3]}
    assert [b.count for b in back.batches] == [2, 1] and back.count == 3
    for mine, theirs in zip(buffer.batches, back.batches):
        assert torch.equal(mine.update()["w"], theirs.update()["w"]) and mine.columns() == theirs.columns()
        assert theirs.weighting == "fedbuff"
    empty, _, _ = AsyncBuffer.taken_from(AsyncBuffer().saved_in(state, {}))
    assert empty.count == 0 and not empty.batches


def test_a_checkpoint_from_before_fedbuff_finishes_its_batch_under_the_normalized_rule():
    """A checkpoint written before ``async.weighting`` holds a sample-weighted sum: its batch keeps that
    rule (summed is summed), the batches after it follow the configured one."""
    old = batch_of("normalized", UPDATES[:1])
    extra = {"count": 1, "samples": 10, "loss_sum": 10.0, "weight": old.partial.weight, "staleness": {"0": 1},
             "in_flight": {}}
    state = ServerState(round=2, params={"w": torch.zeros(1)}, buffers={"async/sum/w": old.partial.sums["w"]},
                        extra={"async": extra})
    back, rest, _ = AsyncBuffer.taken_from(state, size=2, weighting="fedbuff")
    assert [b.weighting for b in back.batches] == ["normalized"] and not rest.buffers
    back.add(result(-1.0, 20), 1)
    back.add(result(2.0, 30), 0)
    assert [b.weighting for b in back.batches] == ["normalized", "fedbuff"]
    assert back.batches[0].update()["w"].item() == pytest.approx((10 * 0.5 - 20 * 2 ** -0.5) / (10 + 20 * 2 ** -0.5))


# -- the driver: results taken together are split into versions of K ----------------------------------------

def driver(size: int, round: int, flights: list[Flight], max_staleness: int = 0) -> tuple[AsyncRun, list]:
    """An AsyncRun's result-taking parts around a stand-in coordinator at version ``round``."""
    rejected: list = []
    run = AsyncRun.__new__(AsyncRun)
    run.co = SimpleNamespace(state=SimpleNamespace(round=round), on_progress=lambda e: None,
                             intake=SimpleNamespace(count=lambda *a: rejected.append(a)))
    run.settings = SimpleNamespace(max_staleness=max_staleness, staleness_exponent=0.5)
    run.buffer, run.book, run.dropped = AsyncBuffer(size=size), RoundBook(round=round + 1, attempt=0), 0
    run.pace, run.contributions = PaceBook("send", max_staleness, VersionClock(0.0)), {}
    run._earlier = RoundBook(round=round + 1, attempt=0)
    run.flights = {f.task_id: f for f in flights}
    return run, rejected


def flight(client: str, version: int) -> Flight:
    plan = TaskPlan(client, "train", {}, {}, ["w"])
    return Flight(f"task-{client}", client, version, plan, time.monotonic(), time.monotonic() + 60)


def test_results_taken_together_fill_one_version_each():
    run, rejected = driver(2, round=5, flights=[flight(c, 4) for c in "abc"])
    run.book.results.update({c: result(float(i)) for i, c in enumerate("abc")})
    run._harvest(report=False)
    assert [b.count for b in run.buffer.batches] == [2, 1] and not run.flights and not rejected
    assert [sorted(b.staleness.items()) for b in run.buffer.batches] == [[(1, 2)], [(2, 1)]]


def test_a_staleness_limit_drops_only_beyond_it_and_none_by_default():
    run, _ = driver(4, round=10, flights=[flight("a", 0), flight("b", 8)], max_staleness=5)
    run.book.results.update({"a": result(1.0), "b": result(2.0)})
    run._harvest(report=False)
    assert run.dropped == 1 and run.buffer.count == 1
    assert run.contributions["a"]["dropped"] == 1 and run.contributions["b"]["counted"] == 1
    assert run.contributions["b"]["weight"] == pytest.approx(3 ** -0.5)   # FedBuff's d(2)
    run, _ = driver(4, round=10, flights=[flight("a", 0)])
    run.book.results.update({"a": result(1.0)})
    run._harvest(report=False)
    assert run.dropped == 0 and run.buffer.batches[0].staleness == {10: 1}


# -- configuration -------------------------------------------------------------------------------------------

def test_fedbuff_is_the_default_and_drops_nothing():
    a = load_config(None, [("run", "mode", "async")]).asynchronous
    assert (a.weighting, a.max_staleness, a.staleness_exponent, a.server_lr) == ("fedbuff", 0, 0.5, 1.0)
    assert load_config(None, [("run", "mode", "async"), ("async", "weighting", "normalized")]).asynchronous.weighting \
        == "normalized"


@pytest.mark.parametrize("key, value, message", [
    ("weighting", "fedavg", "async.weighting must be one of fedbuff, normalized"),
    ("weighting", "FedBuff", "async.weighting must be one of fedbuff, normalized"),
    ("max_staleness", -1, r"async.max_staleness must be >= 0 \(0: no limit\), got -1"),
])
def test_bad_weighting_and_staleness_limit_name_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [("run", "mode", "async"), ("async", key, value)])
