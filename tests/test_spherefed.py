"""SphereFed and FFC: the fixed sphere head, exact calibration from summed statistics, and runs.

Real digits and real models throughout. The exactness test pools every client's
features and solves the least-squares problem centrally with NumPy; the runs go
through the real client loop (in-process, and separate client processes over
Mosquitto with a spy that records every message of the run).
"""

from __future__ import annotations

import json
import logging
import struct
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from coordinator.config import ConfigError, load_config
from methods.spherefed.strategy import FfcSection
from coordinator.runtime.engine import Coordinator, EvalData
from coordinator.runtime.run import run_federated
from coordinator.strategy_setup import make_strategy
from coordinator.strategies.base import ClientResult
from methods.spherefed.strategy import SphereFed
from edge_client.wire.chunking import ChunkingTransport
from edge_client.client import ClientSettings, EdgeClient
from edge_client.wire.codec import parse_codec
from edge_client.data import load_dataset, partition_indices
from edge_client.models import ModelSpecError, federated_names
from edge_client.registry import build_model
from edge_client.objectives import LocalData, ObjectiveError, TaskContext
from edge_client.wire.protocol import DEFAULT_MAX_MESSAGE_BYTES, ResultBody, decode, encode
from methods.spherefed.device import (STAT_NAMES, FfcStats, ffc_stats, pack_upper, packed_size, sphere_accuracies,
                                        sphere_loss, sphere_train, unpack_upper, wire_numbers)
from methods.spherefed.model import CLASSIFIER, SphereError, SphereHead, fixed_classifier
from edge_client.wire.transport import BrokerSettings, InprocHub, MqttTransport
from edge_client.wire.updates import ResidualStore, UploadSettings, decode_upload, encode_upload
from profiling.profiler import Profiler

DIGITS = {"num_classes": 10, "in_channels": 1, "image_size": 8}


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def ctx() -> TaskContext:
    return TaskContext(seed=0, round=1, client_id="c", state_dir=None, profiler=Profiler())


def sphere_model(name: str = "mlp", dtype: torch.dtype = torch.float32, **options) -> torch.nn.Module:
    torch.manual_seed(0)
    spec = {"name": name, **DIGITS, "head": "sphere", "sphere_seed": 7, **options}
    return build_model(spec).to(dtype)


# ----------------------------------------------------------------------------- the head


def test_fixed_classifier_has_orthonormal_rows_and_is_rebuilt_from_the_seed():
    w = fixed_classifier(10, 128, seed=3)
    assert w.shape == (10, 128) and w.dtype == torch.float64
    assert torch.allclose(w @ w.t(), torch.eye(10, dtype=torch.float64), atol=1e-13)
    assert torch.equal(w, fixed_classifier(10, 128, seed=3))
    assert not torch.allclose(w, fixed_classifier(10, 128, seed=4))
    assert torch.equal(fixed_classifier(10, 128, seed=3), fixed_classifier(20, 128, seed=3)[:10])   # first C rows
    square = fixed_classifier(64, 64, seed=0)
    assert torch.allclose(square.t() @ square, torch.eye(64, dtype=torch.float64), atol=1e-13)   # Q itself


@pytest.mark.parametrize("name", ["mlp", "cnn", "vgg9"])
def test_every_model_takes_the_sphere_head(name, digits):
    model = sphere_model(name, hidden=[64]) if name == "mlp" else sphere_model(name)
    head = model.classifier
    assert isinstance(head, SphereHead) and head.out_features == 10
    w = head.weight.double()
    assert torch.allclose(w @ w.t(), torch.eye(10, dtype=torch.float64), atol=1e-6)   # float32 copy
    # Never trained: no parameter in the head; the fixed copy is not even in the state dict.
    assert list(head.parameters()) == []
    assert [k for k in model.state_dict() if k.startswith("classifier")] == [CLASSIFIER]
    assert CLASSIFIER in federated_names(model)
    x = torch.from_numpy(digits.x_test[:32])
    scores = model(x)
    z = F.normalize(model.features(x).flatten(1), dim=1)
    assert torch.allclose(scores, z @ head.weight.t(), atol=1e-6)
    assert float(scores.detach().abs().max()) <= 1 + 1e-6     # unit features on orthonormal rows


def test_local_training_moves_the_extractor_only_against_the_fixed_classifier(digits):
    model = sphere_model("mlp", hidden=[64])
    head = model.classifier
    with torch.no_grad():
        head.weight.mul_(3.0)     # as if a calibrated classifier had been loaded for an evaluation
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = LocalData(torch.from_numpy(digits.x_train[:256]), torch.from_numpy(digits.y_train[:256]))
    out = sphere_train(model, data, {"epochs": 2, "batch_size": 32, "lr": 0.05}, ctx())
    assert torch.equal(head.weight, head.fixed)                 # reset, then never trained
    assert all(not torch.equal(model.state_dict()[k], v) for k, v in before.items() if k != CLASSIFIER)
    scores = model(data.x).detach()
    expected = ((scores - F.one_hot(data.y, 10).float()) ** 2).sum(1).mean()
    assert float(sphere_loss(scores, data.y)) == pytest.approx(float(expected))
    assert 0 < out.metrics["train_loss"] < 2       # squared distance of bounded scores to a one-hot label


def test_a_model_with_fewer_features_than_classes_is_refused():
    with pytest.raises(ModelSpecError, match=r"d >= the number of classes.*d = 8 < C = 10"):
        build_model({"name": "mlp", "hidden": [8], **DIGITS, "head": "sphere"})
    with pytest.raises(ModelSpecError, match="head must be one of linear, sphere"):
        build_model({"name": "cnn", **DIGITS, "head": "cosine"})
    with pytest.raises(ModelSpecError, match="sphere_seed applies only to head = sphere"):
        build_model({"name": "cnn", **DIGITS, "sphere_seed": 3})
    build_model({"name": "mlp", "hidden": [10], **DIGITS, "head": "sphere"})   # d = C is enough


def test_spherefed_needs_the_sphere_head_and_valid_ffc_settings():
    assert load_config(None, [("run", "strategy", "spherefed")]).model["head"] == "sphere"   # the strategy sets it
    with pytest.raises(ConfigError, match="needs model.head = 'sphere'"):
        load_config(None, [("run", "strategy", "spherefed"), ("model", "head", "linear")])
    ok = [("run", "strategy", "spherefed"), ("model", "head", "sphere")]
    for bad, message in [(("ffc", "dtype", "float16"), "ffc.dtype"), (("ffc", "ridge", -1.0), "ffc.ridge"),
                         (("ffc", "every", 2), None), (("spherefed", "mu", -0.1), "spherefed.mu")]:
        overrides = ok + [bad] + ([("ffc", "enabled", False)] if message is None else [])
        with pytest.raises(ConfigError, match=message or "ffc.every needs ffc.enabled"):
            load_config(None, overrides)
    with pytest.raises(ConfigError, match="ffc.personalize needs data.local_test_fraction"):
        load_config(None, ok + [("ffc", "personalize", True), ("clients", "spawn", 2)])
    strategy = make_strategy(load_config(None, ok + [("run", "seed", 5), ("spherefed", "mu", 0.01)]))
    assert isinstance(strategy, SphereFed) and strategy.sphere_seed == 5 and strategy.hyper()["mu"] == 0.01


# ----------------------------------------------------------------------------- packing and the solve


@pytest.mark.parametrize("d", [1, 2, 7, 128])
def test_packed_upper_triangle_round_trip(d):
    a = torch.randn(d, d, dtype=torch.float64, generator=torch.Generator().manual_seed(d))
    sym = a + a.t()
    packed = pack_upper(sym)
    assert packed.shape == (packed_size(d),) == (d * (d + 1) // 2,)
    assert torch.equal(unpack_upper(packed, d), sym)
    with pytest.raises(SphereError, match=f"has {packed_size(d)} numbers"):
        unpack_upper(packed[:-1], d)


def test_singular_gram_falls_back_to_a_small_ridge_and_says_so(caplog):
    z = F.normalize(torch.randn(20, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0)), dim=1)
    y = torch.arange(20) % 10
    stats = FfcStats(z.t() @ z, z.t() @ F.one_hot(y, 10).double(), 20)   # 20 samples in 64 dimensions: rank 20
    with caplog.at_level(logging.WARNING, logger="fedge.sphere"):
        cal = stats.solve(0.0)
    assert cal.singular and cal.rank == 20 and 0 < cal.ridge < 1e-3
    assert bool(torch.isfinite(cal.weight).all()) and cal.weight.shape == (10, 64)
    assert "singular (numerical rank 20 of 64)" in caplog.text and f"ridge {cal.ridge:.3g}" in caplog.text
    # The solution still separates the training points: each one scores highest on its own class.
    assert torch.equal((z @ cal.weight.t()).argmax(1), y)
    caplog.clear()
    explicit = stats.solve(0.1)
    assert not explicit.singular and explicit.ridge == 0.1 and "singular" not in caplog.text


# ----------------------------------------------------------------------------- exactness


def client_stats_over_the_wire(model, x, y) -> tuple[FfcStats, int]:
    """One client's ffc_stats result, encoded and decoded as the real client and coordinator do."""
    out = ffc_stats(model, LocalData(x, y), {"dtype": "float64"}, ctx())
    settings = UploadSettings(parse_codec("fp64"), "raw")
    wire, delta = encode_upload(out.tensors, {}, settings, ResidualStore(None), "run", raw_only=True)
    body = ResultBody(num_samples=out.num_samples, codec=settings.codec, delta=tuple(delta))
    payload = encode("result", run_id="run", round=1, task_id="t", sender="c", body=body.to_body(), tensors=wire)
    msg = decode(payload)
    d, classes = model.classifier.in_features, model.classifier.out_features
    tensors = decode_upload(msg.tensors, ResultBody.from_body(msg.body), {k: t.shape for k, t in out.tensors.items()},
                            {})
    assert all(t.dtype == torch.float64 for t in tensors.values())
    return FfcStats.from_wire(tensors, d, classes), len(payload)


def splits(y: np.ndarray) -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(0)
    order = rng.permutation(len(y))
    cuts = np.sort(rng.choice(np.arange(1, len(y)), size=6, replace=False))
    return {
        "iid-3": partition_indices(y, "iid", 3, 0),
        "one-class-each": [np.flatnonzero(y == c) for c in range(10)],
        "dirichlet-0.1": partition_indices(y, "dirichlet:0.1", 5, 0),
        "uneven-7": np.split(order, cuts),
    }


def test_ffc_equals_centralized_least_squares_for_any_split_and_grouping(digits):
    """W from summed client statistics = lstsq on the pooled features, to 1e-8 relative, in float64."""
    model = sphere_model("mlp", torch.float64, hidden=[64])   # full-rank features: a unique solution
    x, y = torch.from_numpy(digits.x_train).double(), torch.from_numpy(digits.y_train)
    with torch.no_grad():
        z = F.normalize(model.eval().features(x), dim=1).numpy()
    assert np.linalg.matrix_rank(z) == 64
    central = np.linalg.lstsq(z, np.eye(10)[digits.y_train], rcond=None)[0].T   # [C, d]

    float32_state = sphere_model("mlp", hidden=[64])
    strategy = SphereFed({}, sphere_seed=7, ffc=FfcSection())
    state = strategy.initialize({}, {k: v.clone() for k, v in float32_state.state_dict().items()})
    for name, parts in splits(digits.y_train).items():
        stats = [client_stats_over_the_wire(model, x[p], y[p])[0] for p in parts]
        assert sum(s.count for s in stats) == len(y)
        sequential = FfcStats.reduce(stats).solve(0.0)
        tree = FfcStats.reduce([FfcStats.reduce(stats[::2]), FfcStats.reduce(stats[1::2])]).solve(0.0)
        reverse = FfcStats.reduce(reversed(stats)).solve(0.0)
        assert not sequential.singular, name
        w = sequential.weight.numpy()
        assert np.linalg.norm(w - central) / np.linalg.norm(central) < 1e-8, name
        for other in (tree, reverse):
            assert np.linalg.norm(other.weight.numpy() - w) / np.linalg.norm(w) < 1e-12, name
        # The strategy's aggregation puts the same classifier (as float32) into the global model.
        results = [ClientResult(f"c{i}", s.count, s.to_wire()) for i, s in enumerate(stats)]
        new, metrics = strategy.aggregate("ffc", 1, state, results)
        assert torch.allclose(new.params[CLASSIFIER].double(), sequential.weight, rtol=0, atol=1e-6)
        assert (metrics["ffc_clients"], metrics["ffc_samples"], metrics["ffc_singular"]) == (len(parts), len(y), False)


def test_stats_message_holds_exactly_the_packed_sums(digits):
    """d(d+1)/2 + dC + 1 numbers, 8 or 4 bytes each, plus the envelope; nothing else."""
    model = sphere_model("mlp", hidden=[64])
    x, y = torch.from_numpy(digits.x_train[:300]), torch.from_numpy(digits.y_train[:300])
    numbers = wire_numbers(64, 10)
    assert numbers == 64 * 65 // 2 + 64 * 10 + 1
    for dtype, codec, itemsize in (("float64", "fp64", 8), ("float32", "fp32", 4)):
        out = ffc_stats(model, LocalData(x, y), {"dtype": dtype}, ctx())
        assert sorted(out.tensors) == sorted(STAT_NAMES) and out.num_samples == 300
        wire, delta = encode_upload(out.tensors, {}, UploadSettings(parse_codec(codec), "raw"), ResidualStore(None),
                                    "run", raw_only=True)
        body = ResultBody(num_samples=300, codec=parse_codec(codec), delta=tuple(delta))
        payload = encode("result", run_id="run", round=1, task_id="t", sender="c", body=body.to_body(), tensors=wire)
        (header,) = struct.unpack("<Q", payload[:8])
        assert len(payload) == 8 + header + numbers * itemsize
        assert sum(t.numel() for t in decode(payload).tensors.values()) == numbers


def test_float32_statistics_calibrate_as_well_as_float64(digits):
    """Half the bytes: the sums are rounded to float32, so the rank test and the fallback ridge use its eps."""
    model = sphere_model("cnn")   # ReLU features with dead units: G is singular in both precisions
    x, y = torch.from_numpy(digits.x_train), torch.from_numpy(digits.y_train)
    parts = np.array_split(np.arange(len(y)), 5)
    stats = [FfcStats.from_wire(ffc_stats(model, LocalData(x[p], y[p]), {"dtype": dtype}, ctx()).tensors, 128, 10)
             for dtype in ("float64", "float32") for p in parts]
    exact = FfcStats.reduce(stats[:5]).solve(0.0)
    rounded = FfcStats.reduce(stats[5:]).solve(0.0, precision=torch.float32)
    assert exact.singular and rounded.singular and rounded.ridge > exact.ridge
    xt, yt = torch.from_numpy(digits.x_test), torch.from_numpy(digits.y_test)
    acc64, acc32 = sphere_accuracies(model, xt, yt, [exact.weight, rounded.weight])
    assert acc64 > 0.85 and abs(acc32 - acc64) < 0.01


def test_a_client_without_samples_is_refused_cleanly():
    model = sphere_model("mlp", hidden=[64])
    empty = LocalData(torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ObjectiveError, match="FFC needs local training samples and this device has none"):
        ffc_stats(model, empty, {}, ctx())
    zero = FfcStats.zeros(64, 10).to_wire()
    with pytest.raises(SphereError, match="positive whole number of samples"):
        FfcStats.from_wire(zero, 64, 10)
    # A malformed result is discarded and counted; the others still calibrate.
    good = FfcStats(torch.eye(64, dtype=torch.float64), torch.ones(64, 10, dtype=torch.float64), 5)
    strategy = SphereFed({}, sphere_seed=7)
    state = strategy.initialize({}, {k: v.clone() for k, v in model.state_dict().items()})
    results = [ClientResult("a", 5, good.to_wire()), ClientResult("b", 9, good.to_wire())]   # b lies about n
    new, metrics = strategy.aggregate("ffc", 3, state, results)
    assert (metrics["ffc_clients"], metrics["ffc_discarded"], metrics["ffc_samples"]) == (1, 1, 5)
    assert new.extra["ffc_round"] == 3 and not torch.equal(new.params[CLASSIFIER], state.params[CLASSIFIER])
    # Sums no features produce (an indefinite G) end the calibration, not the run: the fixed classifier stays.
    indefinite = FfcStats(-torch.eye(64, dtype=torch.float64), torch.ones(64, 10, dtype=torch.float64), 5)
    kept, metrics = strategy.aggregate("ffc", 3, state, [ClientResult("a", 5, indefinite.to_wire())])
    assert kept is state and "not a Gram matrix" in metrics["ffc_failed"]


def test_an_empty_client_fails_its_tasks_and_the_others_calibrate(tmp_path, digits):
    """Real edge clients through the in-process broker; one has no data at all."""
    hub = InprocHub()
    config = load_config(None, [
        ("run", "strategy", "spherefed"), ("run", "rounds", 1), ("model", "name", "mlp"), ("model", "hidden", [64]),
        ("model", "head", "sphere"), ("clients", "expected", 3), ("clients", "min_results", 2),
        ("clients", "round_timeout", 3.0), ("clients", "resend_every", 0.5)])
    spec = {**config.model, **DIGITS, "sphere_seed": 0}
    strategy = make_strategy(config)
    torch.manual_seed(0)
    params = {k: v.clone() for k, v in build_model(spec).state_dict().items()}
    coord = Coordinator(config, hub.connect("coordinator"), run_id="run1", out_dir=tmp_path, strategy=strategy,
                        state=strategy.initialize(spec, params),
                        eval_data=EvalData(torch.from_numpy(digits.x_test), torch.from_numpy(digits.y_test)))
    x, y = torch.from_numpy(digits.x_train), torch.from_numpy(digits.y_train)
    datas = [LocalData(x[:700], y[:700]), LocalData(x[700:], y[700:]), LocalData(x[:0], y[:0])]
    stop, threads = threading.Event(), []
    for i, data in enumerate(datas):
        settings = ClientSettings(client_id=f"c{i}")
        client = EdgeClient(settings, hub.connect(settings.client_id, will=EdgeClient.will(settings)), data)
        threads.append(threading.Thread(target=client.run, args=(stop,), daemon=True))
        threads[-1].start()
    try:
        coord.wait_for_clients(3, 10)
        row = coord.run_round(1)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
    assert (row["returned"], row["ffc_selected"], row["ffc_returned"], row["failed"]) == (2, 3, 2, 2)
    assert (row["ffc_clients"], row["ffc_samples"]) == (2, len(y))
    assert row["ffc_accuracy_after"] > row["ffc_accuracy_before"]
    assert row["seconds"] < 3.0   # an error answer counts as answered: neither phase waited for its 3 s deadline


# ----------------------------------------------------------------------------- over MQTT


def test_spherefed_with_ffc_over_mosquitto_never_sends_the_classifier(tmp_path, mosquitto, prefix):
    """Separate client processes; a spy records every task, model broadcast and result of the run."""
    spy = ChunkingTransport(MqttTransport(BrokerSettings(url=mosquitto), f"spy-{prefix}").connect(),
                            max_decoded_bytes=DEFAULT_MAX_MESSAGE_BYTES)
    spy.subscribe(f"{prefix}/#")
    config = load_config(None, [
        ("run", "strategy", "spherefed"), ("run", "rounds", 2), ("run", "out", str(tmp_path / "run")),
        ("model", "name", "cnn"), ("model", "head", "sphere"), ("data", "eval", "digits"),
        ("data", "partition", "dirichlet:0.5"), ("data", "local_test_fraction", 0.2),
        ("clients", "expected", 2), ("clients", "spawn", 2), ("clients", "round_timeout", 60.0),
        ("clients", "presence_timeout", 60.0), ("ffc", "personalize", True),
        ("transport", "broker", mosquitto), ("transport", "prefix", prefix)])
    result = run_federated(config, say=lambda s: None)
    out = result.out_dir
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    spec = result.summary["model"]
    assert spec["head"] == "sphere" and spec["sphere_seed"] == 0

    # Calibrated after the last round only; both accuracies are logged, and FFC helps here.
    assert "ffc_accuracy_after" not in rows[1] and rows[1]["classifier_bytes_saved"] == 4 * 10 * 128 * (1 + 2)
    last = rows[2]
    assert (last["ffc_selected"], last["ffc_returned"], last["ffc_clients"], last["rejected"]) == (2, 2, 2, 0)
    assert last["ffc_accuracy_after"] == last["test_accuracy"] > last["ffc_accuracy_before"]
    assert last["ffc_personalized_clients"] == 2 and 0 < last["ffc_personalized_accuracy_mean"] <= 1
    assert last["ffc_stats_numbers"] == 128 * 129 // 2 + 128 * 10 + 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ffc_accuracy_after"] == summary["final_accuracy"] == last["test_accuracy"]
    assert summary["ffc_accuracy_before"] == last["ffc_accuracy_before"] and summary["ffc_round"] == 2

    # The checkpoints: the fixed classifier after round 1, the calibrated one after round 2.
    fixed = fixed_classifier(10, 128, 0).float()
    assert torch.equal(load_file(str(out / "checkpoints" / "round_0001.safetensors"))[CLASSIFIER], fixed)
    calibrated = load_file(str(out / "checkpoints" / "round_0002.safetensors"))[CLASSIFIER]
    assert calibrated.shape == (10, 128) and not torch.allclose(calibrated, fixed, atol=1e-3)

    # On the wire: the classifier never; FFC results carry the packed sums in float64 and nothing else.
    run_id, ffc_results, objectives = result.summary["run_id"], 0, set()
    while (incoming := spy.get(0.5)) is not None:
        if not incoming.payload or not incoming.topic.rsplit("/", 1)[-1] in ("task", "result", "model"):
            continue
        msg = decode(incoming.payload)
        if msg.run_id != run_id:
            continue
        assert not any(name.split(":")[0].startswith("classifier") for name in msg.tensors), (msg.kind, msg.body)
        if msg.kind == "task":
            objectives.add(msg.body["objective"])
        if msg.kind == "result" and set(msg.tensors) == set(STAT_NAMES):
            ffc_results += 1
            assert all(t.dtype == torch.float64 for t in msg.tensors.values())
            assert sum(t.numel() for t in msg.tensors.values()) == wire_numbers(128, 10)
            (header,) = struct.unpack("<Q", incoming.payload[:8])
            assert len(incoming.payload) == 8 + header + 8 * wire_numbers(128, 10)
    spy.close()
    assert objectives == {"sphere_train", "ffc_stats"} and ffc_results >= 2
