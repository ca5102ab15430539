"""Central DP's noise on the mean at a small fleet's size: said before round 1, refused where it swamps the update,
named when a private round diverges, and no retry claimed where none follows. Real runs on digits."""

from __future__ import annotations

import logging

import pytest

from coordinator.config import ConfigError, load_config
from coordinator.privacy_noise import REFUSE_RATIO, WARN_RATIO, NoiseOnMean
from coordinator.runtime.run import run_federated
from coordinator.runtime.run_error import RunError


def _config(tmp_path, **sets):
    base = {"run.rounds": 5, "run.out": str(tmp_path / "run"), "model.name": "mlp", "data.eval": "digits",
            "clients.expected": 3, "clients.spawn": 3, "clients.max_attempts": 1, "transport.kind": "inproc",
            "export.enabled": False, "privacy.mode": "central", "privacy.clip_norm": 1.0, **sets}
    return load_config(None, [(*k.split(".", 1), v) for k, v in base.items()])


def test_the_levels_follow_z_over_m_and_name_the_devices_that_bring_it_down():
    assert NoiseOnMean(0.05, 1.0, 10).level == "small"
    assert NoiseOnMean(0.2, 1.0, 10).level == "costs" and NoiseOnMean(0.2, 1.0, 10).ratio == pytest.approx(WARN_RATIO)
    swamped = NoiseOnMean(1.342, 0.5, 3)
    assert swamped.level == "swamps" and swamped.std == pytest.approx(1.342 * 0.5 / 3)
    assert swamped.devices_for(REFUSE_RATIO) == 14 and 1.342 / 14 < REFUSE_RATIO <= 1.342 / 13


def test_a_run_whose_noise_swamps_the_mean_is_refused_before_round_1(tmp_path):
    """The noise `fedge-coordinator privacy` gives for epsilon 8 over 5 rounds, on 3 devices: z / m = 0.447."""
    config = _config(tmp_path, **{"privacy.noise_multiplier": 1.342})
    with pytest.raises(ConfigError) as refused:
        run_federated(config, say=lambda s: None)
    text = str(refused.value)
    assert "= 0.4473 per coordinate, 0.4473 x the clip norm" in text
    assert "at least 14 devices a round" in text and "clients.expected = 14" in text
    assert "epsilon above" in text and "privacy.allow_swamping_noise = true" in text
    assert not (tmp_path / "run").exists()   # nothing was started


def test_noise_that_costs_accuracy_is_warned_before_round_1_and_small_noise_is_said(tmp_path, caplog):
    said: list[str] = []
    sets = {"run.rounds": 1, "model.hidden": [16], "privacy.noise_multiplier": 0.12}
    with caplog.at_level(logging.WARNING, logger="fedge.coordinator"):
        run_federated(_config(tmp_path, **sets), say=said.append)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("0.04 x the clip norm" in w and "costs accuracy" in w and "at least 7 devices a round" in w
               for w in warned), warned
    quiet = _config(tmp_path / "quiet", **{**sets, "privacy.noise_multiplier": 0.03})
    run_federated(quiet, say=said.append)
    assert any("0.01 x the clip norm" in line and "below 0.02" in line for line in said), said


@pytest.mark.parametrize("sampling", ["fixed", "poisson"])
def test_a_private_round_that_diverges_names_the_noise_and_claims_no_retry(tmp_path, caplog, sampling):
    """Allowed to run anyway, the swamped run's devices diverge on the noisy model: the error says the noise is the
    cause, not the learning rate, and no "retrying" is logged where a private round has its one attempt."""
    config = _config(tmp_path, **{"privacy.noise_multiplier": 3.0, "privacy.allow_swamping_noise": True,
                                  "privacy.sampling": sampling})
    with caplog.at_level(logging.INFO, logger="fedge.coordinator"), pytest.raises(RunError) as ended:
        run_federated(config, say=lambda s: None)
    text = str(ended.value)
    assert "diverged" in text and "= 1 per coordinate, 1 x the clip norm" in text
    assert "The noise, not the learning rate, is the likely cause" in text
    assert "lower the learning rate" not in text
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]


def test_the_privacy_command_says_what_the_noise_does_at_the_fleet_size_it_is_given(capsys):
    from coordinator.ui.cli import main as coordinator_main

    assert coordinator_main(["privacy", "--epsilon", "8", "--rounds", "5", "--per-round", "3", "--expected", "3"]) == 0
    out = capsys.readouterr().out
    assert "privacy.noise_multiplier = 1.342" in out and "at 3 devices a round, 0.4474 x C" in out
    assert "swamps the update" in out and "a run refuses it unless privacy.allow_swamping_noise = true" in out
    assert "at least 14 devices a round" in out and "epsilon above" in out
    assert coordinator_main(["privacy", "--epsilon", "8", "--rounds", "100", "--per-round", "100",
                             "--expected", "1000"]) == 0
    out = capsys.readouterr().out
    assert "at 100 devices a round, 0.00936 x C: below 0.02" in out and "refuses" not in out


def test_a_private_round_with_too_few_results_claims_no_retry(tmp_path, caplog):
    """A private round has one attempt (clients.max_attempts = 1): when its devices miss the round's deadline the run
    ends saying so, and nothing says "retrying" first."""
    config = _config(tmp_path, **{"privacy.noise_multiplier": 0.01, "privacy.sampling": "fixed",
                                  "clients.round_timeout": 0.01})
    with caplog.at_level(logging.INFO, logger="fedge.coordinator"), pytest.raises(RunError, match="in 1 attempts"):
        run_federated(config, say=lambda s: None)
    assert not [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
