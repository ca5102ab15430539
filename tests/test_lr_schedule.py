"""``[schedule]``: the coordinator sets each round's local learning rate in the tasks, for every strategy."""

from __future__ import annotations

import json
import math

import pytest
import torch

from coordinator.config import ConfigError, load_config
from coordinator.runtime.run import run_federated
from coordinator.strategy_setup import make_strategy
from edge_client.registry import build_model
from storage.checkpoint import latest_checkpoint, load_checkpoint

DIGITS = {"num_classes": 10, "in_channels": 1, "image_size": 8}


def _config(*sets: tuple[str, str, object]):
    return load_config(None, [("run", "rounds", 4), ("train", "lr", 0.08), *sets])


def test_the_factor_warms_up_linearly_and_decays_by_a_cosine():
    warm = _config(("schedule", "warmup_rounds", 4)).schedule
    assert [warm.factor(r, 10) for r in (1, 2, 4, 9)] == pytest.approx([0.25, 0.5, 1.0, 1.0])
    cosine = _config(("schedule", "lr", "cosine")).schedule
    assert cosine.factor(1, 100) == pytest.approx(1.0) and cosine.factor(51, 100) == pytest.approx(0.5)
    assert 0 < cosine.factor(100, 100) < 1e-3
    both = _config(("schedule", "lr", "cosine"), ("schedule", "warmup_rounds", 2)).schedule
    assert both.factor(1, 4) == pytest.approx(0.5) and both.factor(3, 4) == pytest.approx((1 + math.cos(math.pi / 2)) / 2)


@pytest.mark.parametrize(("setting", "message"), [
    (("schedule", "lr", "step"), "schedule.lr must be one of constant, cosine, got 'step'"),
    (("schedule", "warmup_rounds", -1), "schedule.warmup_rounds must be >= 0"),
    (("schedule", "decay", 0.5), "unknown key schedule.decay; valid: lr, warmup_rounds"),
    (("spherefed", "lr_schedule", "cosine"), "spherefed.lr_schedule is now schedule.lr"),
])
def test_bad_schedules_are_refused_naming_the_key(setting, message):
    with pytest.raises(ConfigError, match=message):
        _config(setting)


@pytest.mark.parametrize(("strategy", "head"), [("fedavg", {}), ("fedprox", {}),
                                                ("spherefed", {"head": "sphere", "sphere_seed": 0})])
def test_every_strategy_sends_the_rate_of_the_round(strategy, head):
    spec = {"name": "mlp", "hidden": [16], **DIGITS, **head}
    cosine = make_strategy(_config(("run", "strategy", strategy), ("schedule", "lr", "cosine")))
    state = cosine.initialize(spec, dict(build_model(spec).state_dict()))
    rates = [cosine.configure("train", r, state, ["c"])[0].hyper["lr"] for r in (1, 2, 3, 4)]
    assert rates == pytest.approx([0.08 * (1 + math.cos(math.pi * (r - 1) / 4)) / 2 for r in (1, 2, 3, 4)])
    constant = make_strategy(_config(("run", "strategy", strategy)))
    assert [constant.configure("train", r, state, ["c"])[0].hyper["lr"] for r in (1, 4)] == [0.08, 0.08]


def _one_round(tmp_path, name: str, *sets: tuple[str, str, object]) -> tuple[dict[str, torch.Tensor], dict]:
    base = {"run.rounds": 1, "run.out": str(tmp_path / name), "model.name": "mlp", "data.eval": "digits",
            "clients.expected": 3, "clients.spawn": 3, "transport.kind": "inproc", "export.enabled": False}
    config = load_config(None, [(*k.split(".", 1), v) for k, v in base.items()] + list(sets))
    out = run_federated(config, say=lambda s: None).out_dir
    state, _ = load_checkpoint(latest_checkpoint(out / "checkpoints"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return state.params, next(row for row in rows if row.get("round") == 1)


def test_devices_train_at_the_scheduled_rate(tmp_path):
    """Round 1 of a 4-round warm-up from 0.1 trains exactly as a constant 0.025: the devices used the task's rate."""
    warm, row = _one_round(tmp_path, "warm", ("train", "lr", 0.1), ("schedule", "warmup_rounds", 4))
    plain, plain_row = _one_round(tmp_path, "plain", ("train", "lr", 0.025))
    assert row["train_lr"] == pytest.approx(0.025) and "train_lr" not in plain_row
    assert all(torch.equal(warm[k], plain[k]) for k in plain)
