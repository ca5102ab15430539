"""Aggregation workers on a shared subscription: over Mosquitto, with worker and client processes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from coordinator.config import dump_config
from coordinator.runtime.run import run_federated
from storage.checkpoint import load_checkpoint
from test_federation import config_for, read_metrics

ROUNDS = 3


def _start_worker(config_path, worker_id: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "coordinator.ui.cli", "worker", "--config", str(config_path),
                             "--id", worker_id, "--exit-after-run"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_workers_give_the_single_coordinators_aggregate(tmp_path, mosquitto, prefix):
    """Two workers share the results of 4 client processes; every round's model equals the one the
    coordinator aggregates alone (same seed, same tasks), the same bytes are counted, and both workers
    folded some of the results (the broker hands out shares round robin)."""
    sets = dict(run__rounds=ROUNDS, checkpoint__keep="all", transport__broker=mosquitto, clients__expected=4,
                clients__spawn=4, transport__max_message_bytes=8 * 1024 * 1024)   # results unchunked
    alone = config_for(tmp_path / "alone", transport__prefix=prefix + "-alone", **sets)
    run_federated(alone, say=lambda s: None)

    shared = config_for(tmp_path / "shared", transport__prefix=prefix + "-shared", workers__count=2, **sets)
    dump_config(shared, tmp_path / "shared.toml")
    workers = [_start_worker(tmp_path / "shared.toml", f"w{i}") for i in range(2)]
    try:
        run_federated(shared, say=lambda s: None)
        outputs = [w.communicate(timeout=60)[0] for w in workers]
    finally:
        for w in workers:
            w.kill()
    assert [w.returncode for w in workers] == [0, 0], outputs

    for round in range(1, ROUNDS + 1):
        name = f"round_{round:04d}.safetensors"
        a, _ = load_checkpoint(tmp_path / "alone" / "checkpoints" / name)
        b, _ = load_checkpoint(tmp_path / "shared" / "checkpoints" / name)
        for key in a.params:
            assert torch.allclose(a.params[key], b.params[key], rtol=1e-5, atol=1e-6), (round, key)
    rows_alone, rows_shared = read_metrics(tmp_path / "alone"), read_metrics(tmp_path / "shared")
    for ra, rb in zip(rows_alone[1:], rows_shared[1:]):
        assert rb["returned"] == rb["selected"] == ra["returned"]
        # the workers report each result's bytes; tasks and results differ only in deadlines and timings
        for key in ("bytes_up", "bytes_down"):
            assert abs(rb[key] - ra[key]) < 1e-3 * ra[key], key
        assert "worker_lost" not in rb
    folded = [int(out.split("folded ")[1].split(",")[0]) for out in outputs]
    assert sum(folded) == 4 * ROUNDS and min(folded) > 0, outputs


def test_a_result_claimed_by_two_workers_counts_once_and_receipts_are_checked(tmp_path):
    """A device's re-send can reach a second worker: only the first claim is granted. A partial sum is
    merged only with receipts for what its worker was granted and their total weight."""
    from coordinator.runtime.round_book import RoundBook
    from coordinator.strategies.base import TaskPlan
    from edge_client.wire.codec import FP32
    from edge_client.wire.protocol import ManifestBody, ResultBody, Topics, decode, encode
    from edge_client.wire.transport import InprocHub
    from test_engine import make_coordinator

    hub = InprocHub()
    coord = make_coordinator(tmp_path, hub, expected=1, workers__count=2, transport__broker="mqtt://127.0.0.1:1",
                             codec__broadcast=True)
    listener = hub.connect("listener")
    for worker in ("w0", "w1"):
        listener.subscribe(Topics().worker(worker, "status"))
    names = sorted(coord.state.params)
    book = coord.intake.open(RoundBook(round=1, attempt=0, streaming=True))
    book.plans["t1"] = TaskPlan("c1", "train", {}, coord.state.params, names)
    book.manifest = ManifestBody("x1", "train", coord.state.spec, tuple(names), FP32, {"t1": "c1"})
    coord.sent_tasks.add("t1")
    body = {**ResultBody(num_samples=5, metrics={"train_loss": 1.0}).to_body(), "problem": "", "held": True}
    claim = encode("result", run_id="run1", round=1, task_id="t1", sender="c1", body=body)

    def verdicts():
        out = []
        while (msg := listener.get(0.2)) is not None:
            out.append((msg.topic.split("/")[-2], decode(msg.payload).body["state"]))
        return out

    coord.workers.on_claim("w0", claim)
    coord.workers.on_claim("w1", claim)   # the same result, re-sent and handed to the other worker
    assert verdicts() == [("w0", "ack"), ("w1", "rejected")]
    assert book.tally.counts["duplicates"] == 1 and list(book.granted) == ["t1"] and book.answered

    sums = {k: v.to(torch.float64) * 5 for k, v in coord.state.params.items()}

    def partial(worker, weight):
        return encode("partial", run_id="run1", round=1, task_id="", sender=worker,
                      body={"exchange": "x1", "weight": weight, "tasks": ["t1"]}, tensors=sums)

    coord.workers.on_partial("w1", partial("w1", 5.0))    # not granted to w1
    coord.workers.on_partial("w0", partial("w0", 6.0))    # weight is not the receipts' samples
    assert book.partial is None and "c1" not in book.results
    coord.workers.on_partial("w0", partial("w0", 5.0))
    assert list(book.results) == ["c1"] and not book.granted and book.partial.weight == 5.0
    for key, value in book.partial.mean().items():
        assert torch.equal(value, coord.state.params[key])


def test_results_held_by_a_worker_that_never_sends_its_partial_are_counted_lost(tmp_path):
    """A worker that dies between the grant and its partial sum costs the round those results (their
    devices were acknowledged at the grant): after workers.flush_timeout the round goes on, and the
    row says how many were lost."""
    from coordinator.runtime.round_book import RoundBook
    from coordinator.strategies.base import TaskPlan
    from edge_client.wire.codec import FP32
    from edge_client.wire.protocol import ManifestBody, ResultBody, Topics, decode, encode
    from edge_client.wire.transport import InprocHub
    from test_engine import make_coordinator

    hub = InprocHub()
    coord = make_coordinator(tmp_path, hub, expected=1, workers__count=1, transport__broker="mqtt://127.0.0.1:1",
                             codec__broadcast=True, workers__flush_timeout=0.5)
    listener = hub.connect("listener")
    listener.subscribe(Topics().manifest)
    names = sorted(coord.state.params)
    book = coord.intake.open(RoundBook(round=1, attempt=0, streaming=True))
    book.plans["t1"] = TaskPlan("c1", "train", {}, coord.state.params, names)
    book.manifest = ManifestBody("x1", "train", coord.state.spec, tuple(names), FP32, {"t1": "c1"})
    body = {**ResultBody(num_samples=5).to_body(), "problem": "", "held": True}
    coord.workers.on_claim("w0", encode("result", run_id="run1", round=1, task_id="t1", sender="c1", body=body))
    assert book.answered and not book.complete

    coord.workers.collect(book)   # asks for the partial sums (flush), waits 0.5 s, gives up
    flush = decode(listener.get(1.0).payload)
    assert flush.kind == "manifest" and flush.body["flush"] is True
    assert book.tally.worker_lost == 1 and not book.granted and not book.results


def test_worker_command_says_what_is_missing(capsys):
    from coordinator.ui.cli import main

    assert main(["worker"]) == 2
    assert "--broker mqtt://HOST:PORT" in capsys.readouterr().err
    assert main(["worker", "--broker", "mqtt://127.0.0.1:1", "--id", "no/slashes"]) == 2
    assert "--id 'no/slashes'" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["central", "local"])
def test_a_worker_under_dp_gives_the_coordinators_own_mean(tmp_path, mosquitto, prefix, mode):
    """With differential privacy (z = 0, so the sum is exact) a worker's partial sums of equally weighted updates
    give the models the coordinator makes alone. Central: the clip norm reaches the worker in the manifest, it
    holds results to it, and the fixed denominator is applied once, by the coordinator. Local: the manifest says
    the results are noisy, so the worker does not clip them again, and the mean is over the answers."""
    sets = dict(run__rounds=2, checkpoint__keep="all", transport__broker=mosquitto, clients__expected=3,
                clients__spawn=3, clients__max_attempts=1, transport__max_message_bytes=8 * 1024 * 1024,
                privacy__mode=mode, privacy__clip_norm=0.5, privacy__noise_multiplier=0.0)
    alone = config_for(tmp_path / "alone", transport__prefix=prefix + f"-{mode}-alone", **sets)
    run_federated(alone, say=lambda s: None)
    shared = config_for(tmp_path / "shared", transport__prefix=prefix + f"-{mode}-shared", workers__count=1, **sets)
    dump_config(shared, tmp_path / "shared.toml")
    worker = _start_worker(tmp_path / "shared.toml", "w0")
    try:
        run_federated(shared, say=lambda s: None)
        output = worker.communicate(timeout=60)[0]
    finally:
        worker.kill()
    assert worker.returncode == 0, output
    for round in (1, 2):
        name = f"round_{round:04d}.safetensors"
        a, _ = load_checkpoint(tmp_path / "alone" / "checkpoints" / name)
        b, _ = load_checkpoint(tmp_path / "shared" / "checkpoints" / name)
        for key in a.params:
            assert torch.allclose(a.params[key], b.params[key], rtol=1e-5, atol=1e-6), (round, key)
    rows = read_metrics(tmp_path / "shared")[1:]
    assert all(r["dp_clip_norm"] == 0.5 and r["returned"] == 3 and r["dp_mode"] == mode for r in rows)
    assert "folded 6," in output   # the worker folded every result of both rounds
    if mode == "central":
        assert any(r["dp_clipped_fraction"] > 0 for r in rows)   # the bound was at work, not only set
