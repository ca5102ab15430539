"""Central DP's account checked against what the mechanism does: the adaptive clip count's sensitivity, an
epsilon recomputed by a formula written here (not dp_accounting's), and the account each draw allows."""

from __future__ import annotations

import itertools
import math

import dp_accounting
import pytest
import torch
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from coordinator.config import ConfigError, load_config
from coordinator.privacy import (COUNT_SENSITIVITY, CentralPrivacy, adapted_clip_norm, centred_count,
                                 noise_for_epsilon)
from coordinator.privacy_account import CentralAccount
from coordinator.runtime.round_times import RoundTimes
from coordinator.runtime.selection import Absences, Sampler
from coordinator.strategies.base import ClientResult, WeightedSum
from storage.state import ServerState

CENTRAL = [("privacy", "mode", "central"), ("clients", "max_attempts", 1)]


def _config(*sets):
    return load_config(None, [*CENTRAL, *sets])


# -- adaptive clipping: the count's release ------------------------------------------------------------------------
def test_one_device_more_or_less_moves_the_count_by_at_most_its_sensitivity():
    """Every set of bits up to 7 devices, every device added or removed: the statistic the noise covers moves by at
    most COUNT_SENSITIVITY, the figure the account's composition assumes."""
    for n in range(1, 8):
        for bits in itertools.product((0, 1), repeat=n):
            full = centred_count(sum(bits), n)
            for i in range(n):
                rest = bits[:i] + bits[i + 1:]
                assert abs(full - centred_count(sum(rest), n - 1)) <= COUNT_SENSITIVITY
    assert COUNT_SENSITIVITY == 0.5


def test_the_count_noise_is_its_multiplier_times_the_sensitivity():
    """The noisy share minus the noiseless one is one N(0, 1) draw times z_count x 1/2 over the denominator."""
    z_count, m = 3.0, 10
    noiseless = adapted_clip_norm(1.0, 7, 9, m, quantile=0.5, lr=0.2, count_noise_multiplier=0.0,
                                  generator=torch.Generator().manual_seed(1))[1]
    noisy = adapted_clip_norm(1.0, 7, 9, m, quantile=0.5, lr=0.2, count_noise_multiplier=z_count,
                              generator=torch.Generator().manual_seed(1))[1]
    draw = float(torch.randn((), dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    assert (noisy - noiseless) * m == pytest.approx(draw * z_count * COUNT_SENSITIVITY)
    assert noiseless == pytest.approx((7 - 9 / 2) / m + 0.5)


def _independent_rdp_epsilon(q: float, sigma: float, rounds: int, delta: float) -> float:
    """Poisson-subsampled Gaussian of multiplier ``sigma``: RDP at integer orders by the binomial expansion
    (Mironov, Talwar and Zhang 2019, section 3.3), composed over ``rounds``, converted to (epsilon, delta) by
    Canonne, Kamath and Steinke 2020 (Proposition 12), minimised over the orders. Written from the formulas."""
    best = math.inf
    for alpha in range(2, 257):
        terms = [math.lgamma(alpha + 1) - math.lgamma(k + 1) - math.lgamma(alpha - k + 1)
                 + (alpha - k) * math.log1p(-q) + k * math.log(q) + (k * k - k) / (2 * sigma ** 2)
                 for k in range(alpha + 1)]
        top = max(terms)
        log_a = top + math.log(sum(math.exp(t - top) for t in terms))
        rdp = rounds * log_a / (alpha - 1)
        eps = rdp + math.log1p(-1 / alpha) - (math.log(delta) + math.log(alpha)) / (alpha - 1)
        best = min(best, eps)
    return best


def test_an_adaptive_run_s_epsilon_recomputed_from_the_mechanism():
    """Release 30 rounds with adaptive clipping, then recompute the run's epsilon from what the mechanism adds:
    the sum has sensitivity C and noise z C, the count sensitivity 1/2 (measured above) and noise z_count / 2, so
    one Gaussian of multiplier (sum over releases of (sensitivity / std)^2)^(-1/2) per round."""
    z, z_count, m, n, rounds, delta = 2.0, 4.0, 10, 100, 30, 1e-5
    config = _config(("clients", "expected", n), ("clients", "per_round", m), ("privacy", "noise_multiplier", z),
                     ("privacy", "adaptive_clip", True), ("privacy", "count_noise_multiplier", z_count),
                     ("privacy", "accountant", "rdp"))
    privacy = CentralPrivacy.from_config(config)
    state = ServerState(round=0, params={"w": torch.zeros(4)})
    results = [ClientResult(f"c{i}", 10, {}, {"clipped": float(i % 2)}, {"w": torch.ones(4) * 0.1}) for i in range(m)]
    total = WeightedSum.reduce(WeightedSum.of(r.deltas, 1.0) for r in results)
    for r in range(rounds):
        _, state, row = privacy.release(state, total, results, torch.Generator().manual_seed(r))
    clip = 1.0
    per_release = [(clip / (z * clip)), (COUNT_SENSITIVITY / (z_count * COUNT_SENSITIVITY))]   # sensitivity / std
    sigma = sum(x * x for x in per_release) ** -0.5
    independent = _independent_rdp_epsilon(m / n, sigma, rounds, delta)
    # dp_accounting also tries fractional orders, so it can only be lower, and not by much
    assert row["dp_epsilon"] <= independent + 1e-9
    assert row["dp_epsilon"] == pytest.approx(independent, rel=0.02)
    # the uncentred count (sensitivity 1 under the same noise) would have needed a far larger epsilon
    uncentred = sum(x * x for x in [1 / z, 1 / (z_count * COUNT_SENSITIVITY)]) ** -0.5
    assert _independent_rdp_epsilon(m / n, uncentred, rounds, delta) > 1.2 * row["dp_epsilon"]


# -- what each draw allows the account to claim --------------------------------------------------------------------
def test_each_draw_composes_the_event_its_knowledge_allows():
    z, q, n, delta = 4.278, 0.1, 100, 1e-5

    def pld(event):
        accountant = PLDAccountant(value_discretization_interval=1e-3)
        accountant.compose(event)
        return accountant.get_epsilon(delta)

    poisson = CentralAccount("poisson", q, n, "pld").epsilon(100, z, delta)
    fixed = CentralAccount("fixed", q, n, "pld").epsilon(100, z, delta)
    seeded = CentralAccount("seeded", q, n, "pld").epsilon(16, z, delta)
    assert poisson == pytest.approx(pld(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), 100)))
    # replace-one doubles the sensitivity: the fixed draw is dominated by Poisson sampling of a Gaussian of z / 2
    assert fixed == pytest.approx(pld(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z / 2)), 100)))
    # a public draw amplifies nothing: a device drawn 16 times composes 16 Gaussians
    assert seeded == pytest.approx(pld(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), 16)))
    assert poisson < 1.0 < fixed < seeded
    # RDP's own event for a draw without replacement, under its replace-one relation: looser than PLD's
    rdp = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    rdp.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(n, 10, dp_accounting.GaussianDpEvent(z / 2)), 100))
    assert CentralAccount("fixed", q, n, "rdp").epsilon(100, z, delta) == pytest.approx(rdp.get_epsilon(delta))
    # with every device in every round nothing is sampled, and every draw is the same Gaussian
    everyone = {CentralAccount(s, 1.0, n, "pld").epsilon(5, z, delta) for s in ("poisson", "fixed", "seeded")}
    assert len(everyone) == 1


def test_calibration_uses_the_chosen_accountant_and_draw():
    z_pld = noise_for_epsilon(8.0, rounds=30, sampling_rate=0.1, delta=1e-5)
    z_rdp = noise_for_epsilon(8.0, rounds=30, sampling_rate=0.1, delta=1e-5, accountant="rdp")
    assert z_pld < z_rdp
    assert CentralAccount("poisson", 0.1, 100, "rdp").epsilon(30, z_rdp, 1e-5) == pytest.approx(8.0, rel=1e-3)
    z_fixed = noise_for_epsilon(8.0, rounds=30, sampling_rate=0.1, delta=1e-5, sampling="fixed", expected=100)
    assert z_fixed > z_pld
    assert CentralAccount("fixed", 0.1, 100, "pld").epsilon(30, z_fixed, 1e-5) == pytest.approx(8.0, rel=1e-3)


def test_a_seeded_draw_accounts_its_most_drawn_device():
    config = _config(("clients", "expected", 4), ("clients", "per_round", 2), ("privacy", "noise_multiplier", 2.0),
                     ("privacy", "sampling", "seeded"), ("privacy", "target_epsilon", 3.0))
    privacy = CentralPrivacy.from_config(config)
    assert privacy.account.per_device
    state = ServerState(round=0, params={"w": torch.zeros(4)})
    results = [ClientResult(f"c{i}", 10, {}, {"clipped": 0.0}, {"w": torch.ones(4) * 0.1}) for i in range(2)]
    total = WeightedSum.reduce(WeightedSum.of(r.deltas, 1.0) for r in results)
    drawn = [{"a", "b"}, {"a", "c"}, {"a", "d"}]
    for r, clients in enumerate(drawn):
        state = privacy.took_part(state, frozenset(clients))
        _, state, row = privacy.release(state, total, results, torch.Generator().manual_seed(r))
    assert row["dp_max_participations"] == 3 and row["dp_sampling"] == "seeded"
    assert row["dp_epsilon"] == pytest.approx(CentralAccount("seeded", 0.5, 4, "pld").epsilon(3, 2.0, 1e-5))
    stop = privacy.stop_before(ServerState(round=3, params=state.params, extra=state.extra))
    assert (stop != "") == (privacy.epsilon(4) > 3.0)


def test_secret_draws_are_not_the_seeded_ones():
    online = [f"d{i:03d}" for i in range(100)]

    def draws(sampling):
        sampler = Sampler(_config(("clients", "expected", 100), ("clients", "per_round", 10),
                                  ("privacy", "sampling", sampling)), Absences(0), RoundTimes())
        return [sampler.draw(online, r, 0).clients for r in range(1, 11)]

    assert draws("seeded") == draws("seeded")
    assert draws("fixed") != draws("fixed")      # from the OS's entropy: equal with probability ~1e-130
    assert all(len(d) == 10 for d in draws("fixed"))
    plain = Sampler(load_config(None, [("clients", "expected", 100), ("clients", "per_round", 10)]), Absences(0),
                    RoundTimes())
    assert [plain.draw(online, r, 0).clients for r in range(1, 11)] == draws("seeded")


def test_central_dp_draws_poisson_by_default_and_secagg_asks_for_a_fixed_draw():
    privacy = CentralPrivacy.from_config(_config())
    assert privacy.sampling == "poisson" and privacy.accountant == "pld"
    with pytest.raises(ConfigError, match="use privacy.sampling = 'fixed'"):
        _config(("secagg", "enabled", True), ("clients", "expected", 6), ("clients", "per_round", 3))
    assert _config(("secagg", "enabled", True), ("clients", "expected", 6), ("clients", "per_round", 3),
                   ("privacy", "sampling", "fixed")).privacy.sampling == "fixed"
    # with every device in every round nothing is sampled, and a Poisson draw at q = 1 takes them all
    assert _config(("secagg", "enabled", True), ("clients", "expected", 6)).privacy.sampling == ""


def test_the_privacy_command_calibrates_with_the_chosen_accountant(capsys):
    from coordinator.ui.cli import main as coordinator_main

    base = ["privacy", "--epsilon", "8", "--per-round", "10", "--expected", "100"]
    assert coordinator_main([*base, "--rounds", "100", "--accountant", "rdp"]) == 0
    out = capsys.readouterr().out
    assert "privacy.noise_multiplier = 0.99" in out and "RDP" in out
    assert coordinator_main([*base, "--rounds", "10"]) == 0
    assert "PLD" in capsys.readouterr().out
    assert coordinator_main([*base, "--rounds", "10", "--sampling", "seeded"]) == 0
    assert "no amplification" in capsys.readouterr().out


def test_a_seeded_run_reports_its_most_drawn_device_and_journals_its_tasks(tmp_path):
    """A short run over the in-process transport with the reproducible draw: each row's epsilon is the account of
    its most-drawn device so far, and the devices of each round are journaled as local DP's are, for a resume."""
    import json

    from coordinator.runtime.run import run_federated

    sets = {"run.rounds": 3, "run.out": str(tmp_path), "model.name": "mlp", "model.hidden": [16],
            "data.eval": "digits", "clients.expected": 4, "clients.spawn": 4, "clients.per_round": 2,
            "clients.max_attempts": 1, "transport.kind": "inproc", "export.enabled": False,
            "privacy.mode": "central", "privacy.sampling": "seeded", "privacy.clip_norm": 1.0,
            "privacy.noise_multiplier": 2.0, "privacy.allow_swamping_noise": True}   # z / m = 1: accounting only
    result = run_federated(load_config(None, [(*k.split(".", 1), v) for k, v in sets.items()]), say=lambda s: None)
    trained = [json.loads(line) for line in (result.out_dir / "metrics.jsonl").read_text().splitlines()][1:]
    journal = [json.loads(line) for line in (result.out_dir / "tasks-sent.jsonl").read_text().splitlines()]
    counts: dict[str, int] = {}
    for row, sent in zip(trained, journal, strict=True):
        for client in sent["clients"]:
            counts[client] = counts.get(client, 0) + 1
        most = max(counts.values())
        assert row["dp_sampling"] == "seeded" and row["dp_max_participations"] == most
        assert row["dp_epsilon"] == pytest.approx(CentralAccount("seeded", 0.5, 4, "pld").epsilon(most, 2.0, 1e-5))
