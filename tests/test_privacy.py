"""Central differential privacy: the device's clipping, the coordinator's noise, the account, the refusals,
and one short federated run with it on."""

from __future__ import annotations

import json
import math

import dp_accounting
import pytest
import torch
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from coordinator.config import ConfigError, load_config
from coordinator.privacy import (CentralPrivacy, accounted_noise_multiplier, adapted_clip_norm, epsilon_after,
                                 noisy_mean)
from coordinator.strategies.base import ClientResult, WeightedSum
from coordinator.strategy_setup import make_strategy
from coordinator.runtime.run import run_federated
from edge_client.privacy import clip_update, update_norm
from edge_client.registry import build_model
from edge_client.wire.bodies import TaskBody, UploadSettings
from edge_client.wire.codec import parse_codec
from edge_client.wire.errors import ProtocolError
from edge_client.wire.updates import ResidualStore, encode_clipped_upload
from storage.state import ServerState

CENTRAL = [("privacy", "mode", "central"), ("clients", "max_attempts", 1)]


def _config(*sets):
    return load_config(None, [*CENTRAL, *sets])


# -- clipping ---------------------------------------------------------------------------------------------------
def test_clip_scales_the_whole_update_to_the_norm_keeping_its_direction():
    update = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([[0.0, 4.0]])}   # norm 5 over both tensors
    clipped, was = clip_update(update, 1.0)
    assert was and update_norm(clipped) == pytest.approx(1.0, rel=1e-6) and update_norm(clipped) <= 1.0
    assert torch.allclose(clipped["a"], torch.tensor([0.6, 0.0]), atol=1e-6)
    assert torch.allclose(clipped["b"], torch.tensor([[0.0, 0.8]]), atol=1e-6)


def test_clip_under_the_bound_is_a_no_op():
    update = {"a": torch.tensor([0.3, 0.4])}
    same, was = clip_update(update, 1.0)
    assert not was and torch.equal(same["a"], update["a"])
    again, was_again = clip_update(clip_update({"a": torch.randn(1000) * 10}, 2.0)[0], 2.0)
    assert not was_again and update_norm(again) <= 2.0


@pytest.mark.parametrize("bound", [0.0, -1.0, math.inf, math.nan])
def test_clip_refuses_a_bound_that_is_not_positive_and_finite(bound):
    with pytest.raises(ValueError, match="positive finite"):
        clip_update({"a": torch.ones(2)}, bound)


def test_upload_is_clipped_before_the_codec_with_the_residual_inside_the_bound():
    received = {"w": torch.zeros(64)}
    settings = UploadSettings(parse_codec("int8"), "delta", True, clip_norm=0.5)
    store = ResidualStore(None)
    wire, delta, clipped = encode_clipped_upload({"w": torch.randn(64) * 3}, received, settings, store, "r")
    assert clipped and delta == ["w"]
    residual = store.tensors["w"]
    assert 0 < float(residual.norm()) < 0.5   # only what int8 dropped of the clipped update is carried
    _, _, small = encode_clipped_upload({"w": torch.full((64,), 1e-4)}, received, settings, store, "r")
    assert not small


def test_task_body_carries_a_validated_clip_norm():
    upload = UploadSettings(parse_codec("fp32"), "delta", True, clip_norm=0.7)
    body = TaskBody(objective="train", model={"name": "mlp"}, up=("w",), upload=upload).to_body()
    assert TaskBody.from_body(body).upload.clip_norm == 0.7
    for bad in (0, -1.0, "1", True):
        body["upload"]["clip_norm"] = bad
        with pytest.raises(ProtocolError, match="upload.clip_norm"):
            TaskBody.from_body(body)


# -- noise --------------------------------------------------------------------------------------------------------
def test_noise_std_on_the_mean_is_z_times_c_over_the_selected():
    total = WeightedSum({"w": torch.zeros(200_000, dtype=torch.float64)}, 3.0)   # 3 returned of 8 selected
    z, c, m = 1.3, 0.5, 8
    mean = noisy_mean(total, z * c, m, torch.Generator().manual_seed(1))["w"]
    assert float(mean.std()) == pytest.approx(z * c / m, rel=0.01)
    assert abs(float(mean.mean())) < 5 * z * c / m / math.sqrt(200_000)


def test_noisy_mean_divides_the_sum_by_the_fixed_denominator():
    total = WeightedSum.reduce(WeightedSum.of({"w": torch.full((3,), v)}, 1.0) for v in (1.0, 2.0))
    mean = noisy_mean(total, 0.0, 4, torch.Generator())["w"]
    assert torch.allclose(mean, torch.full((3,), 0.75, dtype=torch.float64))


def test_adaptive_clip_moves_towards_the_quantile():
    g = torch.Generator().manual_seed(0)
    down, b = adapted_clip_norm(1.0, 10, 10, 10, quantile=0.5, lr=0.2, count_noise_multiplier=0.0, generator=g)
    assert b == 1.0 and down == pytest.approx(math.exp(-0.1))
    up, _ = adapted_clip_norm(1.0, 0, 10, 10, quantile=0.5, lr=0.2, count_noise_multiplier=0.0, generator=g)
    assert up == pytest.approx(math.exp(0.1))


# -- the account --------------------------------------------------------------------------------------------------
def test_epsilon_grows_with_rounds_and_matches_dp_accounting():
    q, z, delta = 0.1, 1.1, 1e-5
    eps = [epsilon_after(r, sampling_rate=q, noise_multiplier=z, delta=delta, accountant="rdp") for r in (0, 1, 10, 100)]
    assert eps[0] == 0.0 and eps[1] < eps[2] < eps[3]
    direct = RdpAccountant()
    direct.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), 100)
    assert eps[3] == pytest.approx(direct.get_epsilon(delta))
    # the default, PLD, is tighter and still dp_accounting's figure for the same event
    pld = PLDAccountant()
    pld.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), 100)
    assert epsilon_after(100, sampling_rate=q, noise_multiplier=z, delta=delta) == pytest.approx(
        pld.get_epsilon(delta), abs=1e-3)
    assert epsilon_after(100, sampling_rate=q, noise_multiplier=z, delta=delta) < eps[3]
    assert epsilon_after(5, sampling_rate=q, noise_multiplier=0.0, delta=delta) == math.inf


def test_adaptive_clipping_spends_budget_through_the_count():
    assert accounted_noise_multiplier(1.0, None) == 1.0
    assert accounted_noise_multiplier(1.0, 1.0) == pytest.approx(1 / math.sqrt(2))
    assert accounted_noise_multiplier(1.0, 0.0) == 0.0


def _results(n, clipped):
    return [ClientResult(f"c{i}", 10, {}, {"clipped": float(i < clipped)}, {"w": torch.ones(4) * 0.1})
            for i in range(n)]


def test_release_accounts_a_round_and_stops_before_the_target():
    config = _config(("clients", "expected", 10), ("clients", "per_round", 2), ("privacy", "noise_multiplier", 3.0),
                     ("privacy", "target_epsilon", 1.0), ("privacy", "accountant", "rdp"))
    privacy = CentralPrivacy.from_config(config)
    assert privacy.sampling_rate == 0.2 and privacy.per_round == 2
    state = ServerState(round=0, params={"w": torch.zeros(4)})
    results = _results(2, 1)
    total = WeightedSum.reduce(WeightedSum.of(r.deltas, 1.0) for r in results)
    rounds = 0
    while not privacy.stop_before(state):
        _, state, row = privacy.release(state, total, results, torch.Generator().manual_seed(rounds))
        rounds += 1
        state = ServerState(round=rounds, params=state.params, extra=state.extra)
        assert row["dp_epsilon"] == pytest.approx(privacy.epsilon(rounds)) and row["dp_epsilon"] <= 1.0
        assert row["dp_clipped_fraction"] == 0.5 and row["dp_clip_norm"] == 1.0
    assert rounds == 9 and privacy.epsilon(rounds + 1) > 1.0   # 0.429 after one round, 1.04 after ten
    assert "past privacy.target_epsilon = 1" in privacy.stop_before(state)


# -- refusals -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting, message", [
    (("privacy", "mode", "remote"), "privacy.mode must be one of off, central, local"),
    (("privacy", "clip_norm", 0.0), "privacy.clip_norm must be a positive number"),
    (("privacy", "noise_multiplier", -1.0), "privacy.noise_multiplier must be >= 0"),
    (("privacy", "delta", 1.0), "privacy.delta must be in"),
    (("privacy", "target_epsilon", -1.0), "privacy.target_epsilon must be >= 0"),
    (("privacy", "target_quantile", 1.0), "privacy.target_quantile must be in"),
    (("privacy", "clip_lr", 0.0), "privacy.clip_lr must be > 0"),
    (("aggregate", "rule", "median"), "aggregate.rule = 'mean'"),
    (("aggregate", "norm_bound", 2.0), "aggregate.norm_bound = 0"),
    (("run", "mode", "async"), "run.mode = 'sync'"),
    (("clients", "selection", "deadline"), "clients.selection = 'random'"),
    (("run", "diagnostics", True), "run.diagnostics = false"),
    (("privacy", "sampling", "stratified"), "privacy.sampling must be one of poisson, fixed, seeded"),
    (("privacy", "accountant", "moments"), "privacy.accountant must be one of pld, rdp"),
])
def test_bad_privacy_settings_are_refused_naming_the_key(setting, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _config(setting)


def test_retries_are_refused_under_central_dp():
    with pytest.raises(ConfigError, match="clients.max_attempts = 1"):
        load_config(None, [("privacy", "mode", "central")])


@pytest.mark.parametrize("strategy, message", [("fedma", "does not fold one update"),
                                               ("dfl", "does not fold one update"),
                                               ("fed2", "paired averaging")])
def test_strategies_that_need_each_update_are_refused(strategy, message):
    with pytest.raises(ConfigError, match=message):
        make_strategy(_config(("run", "strategy", strategy), ("run", "rounds", 4)))


def test_server_optimizers_take_central_dp_with_equal_weights():
    strategy = make_strategy(_config(("run", "strategy", "fedadam")))
    assert strategy.privacy is not None
    a, b = _results(2, 0)
    folded = strategy.fold("train", strategy.fold("train", None, a), b)
    assert folded.weight == 2.0


@pytest.mark.parametrize("sets, message", [
    ([("privacy", "sampling", "poisson")], "privacy.sampling applies with privacy.mode = 'central'"),
    ([*CENTRAL, ("privacy", "spent_devices", "skip")], "privacy.spent_devices applies with privacy.mode = 'local'"),
    ([("privacy", "mode", "local"), ("privacy", "sampling", "poisson")],
     "privacy.sampling applies with privacy.mode = 'central'"),
    ([*CENTRAL, ("privacy", "sampling", "poisson"), ("secagg", "enabled", True), ("clients", "expected", 6),
      ("clients", "per_round", 3)],
     "cannot run with secagg.enabled = true"),
])
def test_each_modes_own_settings_are_refused_in_the_other(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, sets)


def test_poisson_draws_each_device_with_probability_q_whatever_the_round_size():
    import random

    from coordinator.runtime.round_times import RoundTimes
    from coordinator.runtime.selection import Absences, Sampler

    config = _config(("privacy", "sampling", "poisson"), ("clients", "expected", 1000), ("clients", "per_round", 100))
    sampler = Sampler(config, Absences(0), RoundTimes())
    online = [f"d{i:04d}" for i in range(1000)]
    sizes = [len(sampler.draw(online, r, 0).clients) for r in range(1, 21)]
    assert abs(sum(sizes) / 20 - 100) < 3 * math.sqrt(100 * 0.9 / 20) and len(set(sizes)) > 1
    sampler.entropy = random.Random(0)   # the same stream, the same draw: the draws come from ``entropy`` alone
    first = sampler.draw(online, 1, 0).clients
    sampler.entropy = random.Random(0)
    assert sampler.draw(online, 2, 0).clients == first
    fixed = Sampler(_config(("clients", "expected", 1000), ("clients", "per_round", 100), ("privacy", "sampling", "fixed")),
                    Absences(0), RoundTimes())
    assert fixed.poisson is None and len(fixed.draw(online, 1, 0).clients) == 100


# -- a run --------------------------------------------------------------------------------------------------------
def test_a_short_federated_run_with_central_dp(tmp_path):
    sets = {"run.rounds": 3, "run.out": str(tmp_path), "model.name": "mlp", "data.eval": "digits",
            "clients.expected": 4, "clients.spawn": 4, "clients.per_round": 4, "clients.max_attempts": 1,
            "transport.kind": "inproc", "export.enabled": False, "train.epochs": 2,
            "privacy.mode": "central", "privacy.clip_norm": 5.0, "privacy.noise_multiplier": 0.01,
            "privacy.adaptive_clip": True}
    config = load_config(None, [(*k.split(".", 1), v) for k, v in sets.items()])
    result = run_federated(config, say=lambda s: None)
    rows = [json.loads(line) for line in (result.out_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["round"] > 0]
    assert len(trained) == 3
    eps = [r["dp_epsilon"] for r in trained]
    assert all(e > 0 and math.isfinite(e) for e in eps) and eps == sorted(eps)
    assert all(0 <= r["dp_clipped_fraction"] <= 1 and r["dp_clip_norm"] > 0 for r in trained)
    assert trained[1]["dp_clip_norm"] == pytest.approx(trained[0]["dp_next_clip_norm"])
    assert result.summary["dp_epsilon"] == eps[-1] and result.summary["dp_rounds"] == 3
    assert result.summary["final_accuracy"] > 0.5


def test_worker_manifest_carries_the_clip_norm():
    from edge_client.wire.worker_bodies import ManifestBody

    manifest = ManifestBody("x1", "train", {"name": "mlp"}, ("w",), parse_codec("fp32"), {"t1": "c1"}, clip_norm=0.5)
    assert ManifestBody.from_body(manifest.to_body()).clip_norm == 0.5
    body = {**manifest.to_body(), "clip_norm": -1}
    with pytest.raises(ProtocolError, match="clip_norm"):
        ManifestBody.from_body(body)
    noisy = ManifestBody.from_body({**manifest.to_body(), "noise_multiplier": 2.0})   # local DP
    assert noisy.noise_multiplier == 2.0 and manifest.noise_multiplier is None
    with pytest.raises(ProtocolError, match="noise_multiplier"):
        ManifestBody.from_body({**manifest.to_body(), "noise_multiplier": -1})


def test_a_worker_holds_central_results_to_the_bound_but_not_local_ones():
    """The worker's plan comes from the manifest: a clip norm alone (central) clips what it accepts; with the
    device noise (local) the noisy update is kept as it came."""
    from coordinator.runtime.worker import AggregationWorker
    from edge_client.wire.protocol import decode, encode
    from edge_client.wire.worker_bodies import ManifestBody

    worker = AggregationWorker.__new__(AggregationWorker)
    spec = {"name": "mlp", "hidden": [4], "num_classes": 3, "in_channels": 1, "image_size": 2}
    sent = {n: torch.zeros(t.shape) for n, t in build_model(spec).state_dict().items()}   # the model broadcast
    worker.strategy, worker.broadcasts, worker._shapes = make_strategy(_config()), {"a" * 64: sent}, ("", {})
    big = {n: torch.full(t.shape, 10.0) for n, t in sent.items()}
    names = sorted(big)
    msg = decode(encode("result", run_id="r", round=1, task_id="t1", sender="c1",
                        body={"num_samples": 5, "metrics": {"clipped": 1.0}, "codec": "fp32", "delta": names},
                        tensors=big))
    for noise, bounded in ((None, True), (1.0, False)):
        manifest = ManifestBody("x", "train", spec, tuple(names), parse_codec("fp32"), {"t1": "c1"}, "a" * 64,
                                clip_norm=0.5, noise_multiplier=noise)
        result = worker._accept(manifest, "c1", msg)
        assert (update_norm(result.deltas) <= 0.5 + 1e-6) == bounded


def test_the_noise_for_a_target_epsilon_ends_the_account_there():
    from coordinator.privacy import epsilon_after, noise_for_epsilon

    for target in (1.0, 8.0):
        z = noise_for_epsilon(target, rounds=50, sampling_rate=0.1, delta=1e-5)
        assert epsilon_after(50, sampling_rate=0.1, noise_multiplier=z, delta=1e-5) == pytest.approx(target, rel=1e-3)
    # less noise for a looser target, more for more rounds
    assert noise_for_epsilon(8, rounds=50, sampling_rate=0.1, delta=1e-5) < noise_for_epsilon(
        1, rounds=50, sampling_rate=0.1, delta=1e-5) < noise_for_epsilon(1, rounds=200, sampling_rate=0.1, delta=1e-5)
    with pytest.raises(ValueError, match="epsilon must be a positive"):
        noise_for_epsilon(0, rounds=50, sampling_rate=0.1, delta=1e-5)


def test_the_privacy_command_prints_the_multiplier_and_refuses_impossible_sampling(capsys):
    from coordinator.ui.cli import main as coordinator_main

    assert coordinator_main(["privacy", "--epsilon", "8", "--rounds", "100", "--per-round", "10",
                             "--expected", "100", "--accountant", "rdp"]) == 0
    out = capsys.readouterr().out
    assert "q = 0.1" in out and "privacy.noise_multiplier = 0.99" in out
    assert coordinator_main(["privacy", "--epsilon", "8", "--rounds", "100", "--per-round", "20",
                             "--expected", "10"]) == 2
    assert "cannot exceed" in capsys.readouterr().err


def test_a_poisson_run_releases_rounds_of_any_size_empty_ones_included(tmp_path, monkeypatch):
    """q = 1/4 over 4 devices: rounds of 0 to 4 devices, each released with its noise and accounted; an empty round
    moves the model by the noise alone."""
    import random

    from coordinator.runtime import selection

    monkeypatch.setattr(selection.random, "SystemRandom", lambda: random.Random(5))   # a stream with an empty round
    sets = {"run.rounds": 6, "run.out": str(tmp_path), "model.name": "mlp", "model.hidden": [16],
            "data.eval": "digits", "clients.expected": 4, "clients.spawn": 4, "clients.per_round": 1,
            "clients.max_attempts": 1, "transport.kind": "inproc", "export.enabled": False,
            "privacy.mode": "central", "privacy.sampling": "poisson", "privacy.clip_norm": 1.0,
            "privacy.noise_multiplier": 0.5, "privacy.allow_swamping_noise": True}   # z / m = 0.5: accounting only
    config = load_config(None, [(*k.split(".", 1), v) for k, v in sets.items()])
    result = run_federated(config, say=lambda s: None)
    trained = [json.loads(line) for line in (result.out_dir / "metrics.jsonl").read_text().splitlines()][1:]
    assert len(trained) == 6 and {r["dp_sampling"] for r in trained} == {"poisson"}
    sizes = [r["selected"] for r in trained]
    assert 0 in sizes and len(set(sizes)) > 1, sizes
    assert result.summary["dp_sampling"] == "poisson"
    assert all(r["returned"] == r["selected"] for r in trained)
    assert [r["dp_epsilon"] for r in trained] == pytest.approx(
        [epsilon_after(k, sampling_rate=0.25, noise_multiplier=0.5, delta=1e-5) for k in range(1, 7)])
