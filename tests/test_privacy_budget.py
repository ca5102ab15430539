"""A device's own local-DP budget: its ledger, what it refuses and why, and a run over Mosquitto in which one
device stops sending once its budget is spent while the others carry the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coordinator.config import load_config
from coordinator.privacy import local_epsilon
from coordinator.runtime.run import run_federated
from edge_client.client import ClientSettings
from edge_client.data import load_dataset
from edge_client.objectives import LocalData
from edge_client.privacy_budget import LEDGER_FILE, BudgetSettings, PrivacyBudget, PrivacyBudgetError
from edge_client.wire.topics import Topics

ROOT = Path(__file__).resolve().parents[1]
Z = 2.0


def _budget(tmp_path, epsilon: float, **kw) -> PrivacyBudget:
    return PrivacyBudget(BudgetSettings(epsilon, **kw), tmp_path)


def test_the_device_admits_exactly_the_releases_its_budget_covers(tmp_path):
    epsilon = local_epsilon(3, noise_multiplier=Z, delta=1e-5) * 1.0001   # room for three at z = 2, not four
    budget = _budget(tmp_path, epsilon)
    for k in range(3):
        assert budget.refusal(f"t{k}", "train", Z) is None
        budget.record(f"t{k}", "run-a", k + 1, Z)
    assert budget.spent() == pytest.approx(local_epsilon(3, noise_multiplier=Z, delta=1e-5))
    refused = budget.refusal("t3", "train", Z)
    assert refused is not None and "privacy budget is spent" in refused and "3 updates released" in refused
    again = _budget(tmp_path, epsilon)                     # a restart reads the same ledger
    assert len(again.releases) == 3 and again.spent() == budget.spent()
    assert again.refusal("t1", "train", Z) is None         # a task already counted is a repeat, not a release
    again.record("t1", "run-a", 2, Z)
    assert len(json.loads((tmp_path / LEDGER_FILE).read_text())["releases"]) == 3


def test_mixed_multipliers_compose_as_one_account(tmp_path):
    budget = _budget(tmp_path, 100.0)
    budget.record("a", "r", 1, 1.0)
    budget.record("b", "r", 2, 3.0)
    both = budget.spent()
    assert local_epsilon(1, noise_multiplier=3.0, delta=1e-5) < both < local_epsilon(2, noise_multiplier=1.0,
                                                                                      delta=1e-5)


@pytest.mark.parametrize(("noise", "floor", "said"), [
    (None, 0.0, "sends only updates it adds its own noise to"),
    (0.5, 1.0, "below this device's floor of 1"),
])
def test_tasks_without_enough_noise_are_refused_saying_what_to_change(tmp_path, noise, floor, said):
    refused = _budget(tmp_path, 10.0, min_noise_multiplier=floor).refusal("t", "train", noise)
    assert refused is not None and said in refused


@pytest.mark.parametrize(("settings", "said"), [
    ({"epsilon": 0.0}, "positive epsilon"),
    ({"epsilon": 1.0, "delta": 1.0}, "delta must be in (0, 1)"),
    ({"epsilon": 1.0, "min_noise_multiplier": -1.0}, "minimum noise multiplier"),
])
def test_bad_budgets_are_refused(settings, said):
    with pytest.raises(PrivacyBudgetError, match=said.replace("(", r"\(").replace(")", r"\)")):
        BudgetSettings(**settings)


def test_a_ledger_it_cannot_trust_stops_the_device(tmp_path):
    with pytest.raises(PrivacyBudgetError, match="needs a state directory"):
        PrivacyBudget(BudgetSettings(1.0), None)
    (tmp_path / LEDGER_FILE).write_text('{"releases": [{"task": "t", "z": -1}]}')
    with pytest.raises(PrivacyBudgetError, match="cannot be read"):
        _budget(tmp_path, 1.0)
    (tmp_path / LEDGER_FILE).unlink()
    budget = _budget(tmp_path, 10.0)
    (tmp_path / LEDGER_FILE).mkdir()   # the ledger's name taken by a directory: the write fails
    with pytest.raises(PrivacyBudgetError, match="the update was not sent"):
        budget.record("t", "r", 1, Z)
    assert budget.releases == []


def test_the_command_line_says_what_is_wrong_before_connecting(tmp_path):
    (tmp_path / LEDGER_FILE).write_text("not json")
    done = subprocess.run([sys.executable, "-m", "edge_client.cli", "run", "--client-id", "pi-01", "--data", "digits",
                           "--state-dir", str(tmp_path), "--privacy-budget", "3"], cwd=tmp_path,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "privacy ledger" in done.stderr and "cannot be read" in done.stderr


def test_over_mosquitto_a_spent_device_refuses_and_the_run_goes_on(tmp_path, mosquitto, prefix, mqtt_device):
    """Three devices all drawn every round under local DP; one has a budget for two updates: it trains in rounds
    1 and 2, refuses round 3 with its reason and withdraws, is not drawn in round 4, and the run completes on the
    other two."""
    sets = {"run.out": str(tmp_path / "run"), "run.rounds": 4, "model.name": "mlp", "model.hidden": [16],
            "data.eval": "digits", "export.enabled": False, "privacy.mode": "local", "privacy.clip_norm": 1.0,
            "privacy.noise_multiplier": Z, "clients.expected": 3, "clients.min_results": 2,
            "clients.round_timeout": 60.0, "clients.presence_timeout": 60.0, "clients.max_misses": 0,
            "transport.broker": mosquitto, "transport.prefix": prefix}
    config = load_config(None, [(*k.split(".", 1), v) for k, v in sets.items()])
    budget = BudgetSettings(local_epsilon(2, noise_multiplier=Z, delta=1e-5) * 1.0001)
    digits = load_dataset("digits")
    x, y = torch.from_numpy(digits.x_train), torch.from_numpy(digits.y_train)
    for i in range(3):
        mqtt_device(ClientSettings(client_id=f"budget-{i}", topics=Topics(prefix), state_dir=tmp_path / f"budget-{i}",
                                   privacy_budget=budget if i == 0 else None), LocalData(x[i::3][:150], y[i::3][:150]))
    result = run_federated(config, say=lambda s: None)
    rows = [json.loads(line) for line in (result.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["returned"] for r in rows if r["round"] > 0] == [3, 3, 2, 2]
    assert [r["selected"] for r in rows if r["round"] > 0] == [3, 3, 3, 2]
    ledger = json.loads((tmp_path / "budget-0" / LEDGER_FILE).read_text())["releases"]
    assert [r["round"] for r in ledger] == [1, 2] and all(r["z"] == Z for r in ledger)
    answers = [json.loads(line) for line in (result.out_dir / "clients" / "budget-0.jsonl").read_text().splitlines()]
    assert [a["round"] for a in answers] == [1, 2, 3]   # withdrawn after round 3: no task in round 4
    assert answers[2]["error"] and "privacy budget is spent" in answers[2]["error"]
    assert not (tmp_path / "budget-1" / LEDGER_FILE).exists()   # a device without a budget keeps no ledger


def test_a_withdrawal_travels_only_with_an_error_and_benches_the_device_for_the_run():
    from coordinator.runtime.selection import Absences
    from edge_client.wire.bodies import ResultBody

    body = ResultBody(error="budget spent", withdrawn=True).to_body()
    assert body["withdrawn"] is True and ResultBody.from_body(body).withdrawn
    assert "withdrawn" not in ResultBody(error="no data").to_body()
    with pytest.raises(ValueError, match="withdrawn"):
        ResultBody.from_body({"error": "x", "withdrawn": "yes"})
    absences = Absences(limit=2)
    assert absences.withdraw("d1") and not absences.withdraw("d1")
    absences.returned("d1")   # a later answer or a reconnect does not bring it back in this run
    assert absences.pool(["d0", "d1"], 1, retry=False) == ["d0"]
