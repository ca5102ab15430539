"""FFC's calibration pass under central differential privacy: the device's bound, the coordinator's noise,
the noiseless limit, the account composed with training's, and what stays refused.

Digits and a tiny mlp; one short in-process run.
"""

from __future__ import annotations

import json
import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.pld import PLDAccountant

from coordinator.config import ConfigError, load_config
from coordinator.privacy import CentralPrivacy, release_epsilon
from coordinator.runtime.run import run_federated
from coordinator.strategies.base import ClientResult
from coordinator.strategy_setup import make_strategy
from edge_client.data import load_dataset
from edge_client.objectives import LocalData, ObjectiveError, TaskContext
from edge_client.privacy import update_norm
from edge_client.registry import build_model
from methods.spherefed.device import (BOUNDED_NAMES, ffc_stats, floor_eigenvalues, noise_floor, packed_size,
                                      unpack_upper)
from methods.spherefed.model import CLASSIFIER
from methods.spherefed.strategy import FfcSection, SphereFed
from profiling.profiler import Profiler
from storage.state import ServerState

DIGITS = {"num_classes": 10, "in_channels": 1, "image_size": 8}
CENTRAL = {"privacy.mode": "central", "clients.max_attempts": 1}


def config(**sets):
    base = {"run.strategy": "spherefed", "run.rounds": 2, "model.name": "mlp", "model.hidden": [32],
            "model.head": "sphere", "data.eval": "digits", "clients.expected": 4, "clients.per_round": 2,
            "transport.kind": "inproc", "clients.spawn": 4, "export.enabled": False, **sets}
    return load_config(None, [(*k.split(".", 1), v) for k, v in base.items()])


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def sphere_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model({"name": "mlp", "hidden": [32], **DIGITS, "head": "sphere", "sphere_seed": 7})


def device_stats(model, digits, parts, **hyper) -> list[ClientResult]:
    x, y = torch.from_numpy(digits.x_train), torch.from_numpy(digits.y_train)
    out = []
    for i, p in enumerate(parts):
        ctx = TaskContext(seed=0, round=1, client_id=f"c{i}", state_dir=None, profiler=Profiler())
        o = ffc_stats(model, LocalData(x[p], y[p]), hyper, ctx)
        out.append(ClientResult(f"c{i}", o.num_samples, o.tensors, o.metrics))
    return out


# -- the device's bound -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_device_statistics_are_within_the_bound_as_one_vector(digits, dtype):
    model = sphere_model()
    parts = np.array_split(np.arange(600), 3)
    free = device_stats(model, digits, parts, dtype=dtype)
    bounded = device_stats(model, digits, parts, dtype=dtype, clip=20.0)
    for f, b in zip(free, bounded):
        norm = update_norm({k: f.tensors[k] for k in BOUNDED_NAMES})
        assert norm > 20.0 and b.metrics["ffc_clipped"] == 1.0   # 200 unit features are far past 20
        assert update_norm({k: b.tensors[k] for k in BOUNDED_NAMES}) <= 20.0
        # one factor for G and B: the device's own least-squares problem is unchanged
        ratio = b.tensors["ffc.cross"].double() / f.tensors["ffc.cross"].double()
        gram_ratio = b.tensors["ffc.gram"].double() / f.tensors["ffc.gram"].double()
        finite = torch.isfinite(ratio)
        assert torch.allclose(ratio[finite], torch.full_like(ratio[finite], 20.0 / norm), rtol=1e-5)
        assert torch.allclose(gram_ratio[torch.isfinite(gram_ratio)], torch.tensor(20.0 / norm, dtype=torch.float64),
                              rtol=1e-5)
        assert torch.equal(b.tensors["ffc.count"], f.tensors["ffc.count"])
    loose = device_stats(model, digits, parts[:1], dtype=dtype, clip=1e9)[0]
    assert loose.metrics["ffc_clipped"] == 0.0 and torch.equal(loose.tensors["ffc.gram"], free[0].tensors["ffc.gram"])
    for bad in (0, -1.0, math.inf, True):
        with pytest.raises(ObjectiveError, match="clip a positive number"):
            device_stats(model, digits, parts[:1], clip=bad)


# -- the coordinator's noise ------------------------------------------------------------------------------------
def test_the_summed_statistics_get_noise_of_z_times_the_bound_and_g_stays_symmetric():
    privacy = CentralPrivacy(1.0, 1.0, 1e-5, 0.0, 2, 0.5)
    d, classes = 200, 10
    sums = {"ffc.gram": torch.zeros(packed_size(d), dtype=torch.float64),
            "ffc.cross": torch.zeros(d, classes, dtype=torch.float64)}
    state = ServerState(round=3, params={}, extra={"privacy": {"clip_norm": 1.0, "rounds": 3}})
    noisy, after, row = privacy.release_sum(state, sums, 40.0, 0.7, generator=torch.Generator().manual_seed(0))
    values = torch.cat([noisy["ffc.gram"], noisy["ffc.cross"].flatten()])
    assert float(values.std()) == pytest.approx(0.7 * 40.0, rel=0.01)
    assert abs(float(values.mean())) < 5 * 28.0 / math.sqrt(values.numel())
    gram = unpack_upper(noisy["ffc.gram"], d)
    assert torch.equal(gram, gram.t())
    assert row["dp_releases"] == 1 and row["dp_epsilon"] == pytest.approx(privacy.epsilon(3, [0.7]))
    assert after.extra["privacy"] == {"clip_norm": 1.0, "rounds": 3, "releases": [0.7]}   # training's account kept
    # the floor makes the noisy G positive definite, so the solve is well posed
    floored = floor_eigenvalues(gram, noise_floor(28.0, d))
    assert float(torch.linalg.eigvalsh(gram)[0]) < 0 < float(torch.linalg.eigvalsh(floored)[0])


def test_without_noise_and_with_a_loose_bound_the_private_head_is_the_plain_one(digits):
    model = sphere_model()
    parts = np.array_split(np.arange(len(digits.y_train)), 4)
    strategy = SphereFed({}, sphere_seed=7, ffc=FfcSection())
    state = strategy.initialize({}, {k: v.clone() for k, v in model.state_dict().items()})
    plain, _ = strategy.aggregate("ffc", 1, state, device_stats(model, digits, parts))
    private = SphereFed({}, sphere_seed=7, ffc=FfcSection(clip=1e9, noise_multiplier=0.0))
    private.privacy = CentralPrivacy(1.0, 1.0, 1e-5, 0.0, 2, 0.5)
    tasks = private.configure("ffc", 1, state, ["c0"])
    assert tasks[0].hyper["clip"] == 1e9
    new, metrics = private.aggregate("ffc", 1, state, device_stats(model, digits, parts, clip=1e9))
    assert torch.allclose(new.params[CLASSIFIER], plain.params[CLASSIFIER], rtol=0, atol=1e-6)
    assert metrics["dp_ffc_noise_std"] == 0.0 and metrics["dp_epsilon"] == math.inf
    # with noise the head moves, and the pass is accounted
    private.ffc = FfcSection(clip=50.0, noise_multiplier=1.0)
    noisy, metrics = private.aggregate("ffc", 1, state, device_stats(model, digits, parts, clip=50.0))
    assert not torch.allclose(noisy.params[CLASSIFIER], plain.params[CLASSIFIER], atol=1e-3)
    assert metrics["dp_ffc_epsilon"] == pytest.approx(release_epsilon([1.0], delta=1e-5))
    assert noisy.extra["privacy"]["releases"] == [1.0] and metrics["dp_ffc_eigenvalue_floor"] > 0
    assert metrics["dp_ffc_clipped_fraction"] == 1.0


# -- the account ------------------------------------------------------------------------------------------------
def _by_hand(rounds, q, z, z_ffc, delta, passes=1):
    """The run's default account (PLD), composed here from dp_accounting's own events."""
    accountant = PLDAccountant()
    if rounds:
        accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds)
    accountant.compose(dp_accounting.GaussianDpEvent(z_ffc), passes)
    return accountant.get_epsilon(delta)


def test_the_pass_is_composed_after_the_training_rounds_in_one_account():
    privacy = CentralPrivacy(1.0, 1.1, 1e-5, 0.0, 2, 0.2)
    assert privacy.epsilon(7, [3.0]) == pytest.approx(_by_hand(7, 0.2, 1.1, 3.0, 1e-5), abs=1e-3)
    assert privacy.epsilon(7, [3.0, 3.0]) == pytest.approx(_by_hand(7, 0.2, 1.1, 3.0, 1e-5, passes=2), abs=1e-3)
    assert privacy.epsilon(7) < privacy.epsilon(7, [3.0]) < privacy.epsilon(7) + release_epsilon([3.0], delta=1e-5)
    # a target check before the last round counts its pass in
    tight = CentralPrivacy(1.0, 1.1, 1e-5, privacy.epsilon(7) * 1.001, 2, 0.2)
    state = ServerState(round=6, params={}, extra={"privacy": {"rounds": 6}})
    assert tight.stop_before(state) == "" and "planned release" in tight.stop_before(state, [3.0])


def test_a_private_ffc_run_reports_the_composed_epsilon_in_its_row_and_summary(tmp_path):
    sets = {**CENTRAL, "run.strategy": "fedavg_ffc", "model.head": "linear", "run.out": str(tmp_path),
            "privacy.clip_norm": 5.0, "privacy.noise_multiplier": 0.8, "ffc.noise_multiplier": 2.0,
            "ffc.clip": 100.0, "privacy.allow_swamping_noise": True}   # z / m = 0.4: the account is what is checked
    result = run_federated(config(**sets), say=lambda s: None)
    rows = [json.loads(line) for line in (result.out_dir / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    expected = _by_hand(2, 0.5, 0.8, 2.0, 1e-5)
    assert last["dp_epsilon"] == pytest.approx(expected, abs=1e-3) and last["dp_ffc_passes"] == 1
    assert rows[-2]["dp_epsilon"] < expected   # round 1: training only
    summary = json.loads((result.out_dir / "summary.json").read_text())
    assert summary["dp_epsilon"] == pytest.approx(expected, abs=1e-3) and summary["dp_ffc_passes"] == 1
    assert summary["dp_ffc_epsilon"] == pytest.approx(release_epsilon([2.0], delta=1e-5))
    assert last["ffc_clients"] == 4 and last["dp_ffc_noise_std"] == 200.0


# -- refusals ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sets, message", [
    ({"privacy.mode": "local"}, "privacy.mode = 'local' cannot run FFC"),
    ({"secagg.enabled": True, "clients.per_round": 4}, "secagg.enabled = true cannot run FFC"),
    ({**CENTRAL, "ffc.personalize": True, "data.local_test_fraction": 0.2}, "ffc.personalize = false"),
    ({**CENTRAL, "ffc.clip": 0.0}, "ffc.clip must be a positive number"),
    ({**CENTRAL, "ffc.noise_multiplier": -1.0}, "ffc.noise_multiplier must be >= 0"),
    ({**CENTRAL, "privacy.target_epsilon": 1.0}, "a run the target stops early is never calibrated"),
])
def test_what_ffc_still_cannot_run_with_is_refused_naming_the_key(sets, message):
    with pytest.raises(ConfigError, match=message):
        make_strategy(config(**sets))


def test_central_dp_runs_ffc_and_repeated_passes_are_each_accounted():
    strategy = make_strategy(config(**CENTRAL, **{"ffc.every": 1}))
    assert isinstance(strategy.privacy, CentralPrivacy) and strategy.calibrates(1, False)
    state = ServerState(round=0, params={})
    # target check before round 1 of 2 with a pass every round: both passes are counted
    tight = CentralPrivacy(1.0, 1.0, 1e-5, strategy.privacy.epsilon(1, [1.0]) * 1.001, 2, 0.5)
    strategy.privacy = tight
    assert "2 planned release" in strategy.stop_before(1, state)
    assert make_strategy(config(**CENTRAL, **{"ffc.enabled": False})).privacy is not None
    assert make_strategy(config(**CENTRAL, **{"run.strategy": "fedavg_ffc", "model.head": "linear"})).privacy


def test_the_privacy_command_says_what_the_ffc_pass_costs(capsys):
    from coordinator.ui.cli import main as coordinator_main

    assert coordinator_main(["privacy", "--epsilon", "8", "--epsilon", "1", "--rounds", "10", "--per-round", "10",
                             "--expected", "10", "--release-noise", "4", "--accountant", "rdp"]) == 0
    out = capsys.readouterr().out
    alone = release_epsilon([4.0], delta=1e-5, accountant="rdp")
    assert f"alone: epsilon {alone:.4g}" in out and "privacy.noise_multiplier = " in out
    assert "epsilon 1: out of reach" in out   # the pass alone spends more than 1
