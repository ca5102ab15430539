"""FedMA against FedAvg at equal bytes and equal rounds: which of FedAvg's curves each figure is read from.

FedMA's claim is accuracy per byte, so the comparison must read FedAvg where FedMA's traffic ends, and
from the run tested every round where it can; these runs are built by hand so every expected figure
is plain arithmetic.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from fedma_compare import compare  # noqa: E402


def _run(accuracies: dict[int, float], rounds: int, bytes_per_round: int, seed: int = 0) -> dict:
    rows = [{"round": r, "bytes_down": bytes_per_round if r else 0, "bytes_up": 0,
             "test_accuracy": accuracies.get(r)} for r in range(rounds + 1)]
    return {"seed": seed, "rounds": rounds, "rows": rows, "summary": {}}


# FedAvg: 10 MB a round, tested every 5 rounds over 30; its early twin tested every round over 10.
FULL = _run({0: 0.1, 5: 0.80, 10: 0.85, 15: 0.86, 20: 0.87, 25: 0.88, 30: 0.89}, 30, 10_000_000)
EARLY = _run({r: 0.1 + 0.07 * r for r in range(11)}, 10, 10_000_000)


def test_equal_bytes_read_between_evaluations_of_the_full_run() -> None:
    fedma = _run({9: 0.83}, 9, 7_000_000)            # 63 MB: between FedAvg's rounds 5 and 10
    result = compare(fedma, FULL)
    assert result["fedma_bytes"] == 63_000_000
    assert result["baseline_accuracy_at_equal_bytes"] == pytest.approx(0.80 + 0.05 * 13 / 50)
    assert (result["baseline_accuracy_before_equal_bytes"], result["baseline_accuracy_after_equal_bytes"]) == (0.80, 0.85)
    assert result["baseline_accuracy_at_equal_rounds"] == pytest.approx(0.84)   # round 9, between 5 and 10
    assert result["baseline_rounds_to_fedma_accuracy"] == 10


def test_the_early_run_is_read_where_fedma_traffic_falls_within_it() -> None:
    fedma = _run({9: 0.83}, 9, 7_000_000)
    result = compare(fedma, FULL, EARLY)
    assert result["baseline_accuracy_at_equal_bytes"] == pytest.approx(0.1 + 0.07 * 6.3)
    assert (result["baseline_accuracy_before_equal_bytes"], result["baseline_accuracy_after_equal_bytes"]) == \
        pytest.approx((0.1 + 0.07 * 6, 0.1 + 0.07 * 7))
    assert result["baseline_accuracy_at_equal_rounds"] == pytest.approx(0.1 + 0.07 * 9)
    # the early run never reaches 0.83 (0.80 at round 10), so the full run says when FedAvg did: round 10
    assert result["baseline_rounds_to_fedma_accuracy"] == 10


def test_equal_rounds_beyond_the_early_run_read_the_full_run() -> None:
    fedma = _run({27: 0.88}, 27, 2_000_000)          # 54 MB: inside the early run; 27 phases: beyond it
    result = compare(fedma, FULL, EARLY)
    assert result["baseline_accuracy_at_equal_bytes"] == pytest.approx(0.1 + 0.07 * 5.4)
    assert result["baseline_accuracy_at_equal_rounds"] == pytest.approx(0.88 + 0.01 * 2 / 5)   # between rounds 25 and 30


def test_each_evaluation_is_compared_at_its_own_traffic() -> None:
    fedma = _run({3: 0.5, 6: 0.7}, 6, 5_000_000)     # 15 MB after 3 phases, 30 MB after 6
    evaluations = compare(fedma, FULL, EARLY)["evaluations"]
    assert [(e["phase"], e["fedma_bytes"], e["fedma_accuracy"]) for e in evaluations] == \
        [(3, 15_000_000, 0.5), (6, 30_000_000, 0.7)]
    assert [e["baseline_accuracy_at_equal_bytes"] for e in evaluations] == \
        pytest.approx([0.1 + 0.07 * 1.5, 0.1 + 0.07 * 3])
    assert [e["baseline_accuracy_at_equal_rounds"] for e in evaluations] == \
        pytest.approx([0.1 + 0.07 * 3, 0.1 + 0.07 * 6])
