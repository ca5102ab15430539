"""The paired per-seed statistic (bench/paired.py) on small inputs worked out by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from paired import paired, paired_difference  # noqa: E402


def test_known_differences() -> None:
    # differences 2, 3, 4: mean 3, sample std 1, t(0.975, 2) = 4.302653 -> half-width 4.302653 / sqrt(3) = 2.48
    result = paired_difference({0: 12.0, 1: 13.0, 2: 14.0}, {0: 10.0, 1: 10.0, 2: 10.0})
    assert result is not None
    assert result.seeds == (0, 1, 2) and result.n == 3
    assert result.mean == pytest.approx(3.0) and result.std == pytest.approx(1.0)
    half = 4.302652729911275 / 3 ** 0.5
    assert result.interval == pytest.approx((3.0 - half, 3.0 + half))
    assert result.direction == 1 and result.as_dict()["excludes_zero"] is True


def test_interval_straddling_zero() -> None:
    result = paired([1.0, -1.0, 0.5])
    assert result.interval is not None and result.interval[0] < 0 < result.interval[1]
    assert result.direction == 0 and result.as_dict()["excludes_zero"] is False


def test_below_zero() -> None:
    assert paired([-2.0, -2.2, -1.8]).direction == -1


def test_one_seed_has_no_interval() -> None:
    result = paired_difference({0: 0.8, 1: 0.7}, {0: 0.75})
    assert result is not None and result.n == 1 and result.seeds == (0,)
    assert result.mean == pytest.approx(0.05)
    assert result.std is None and result.interval is None and result.direction == 0


def test_only_common_seeds_pair() -> None:
    result = paired_difference({0: 1.0, 2: 3.0, 5: 9.0}, {1: 0.0, 2: 1.0, 5: 5.0})
    assert result is not None and result.seeds == (2, 5) and result.differences == (2.0, 4.0)


def test_no_common_seed_and_no_values() -> None:
    assert paired_difference({0: 1.0}, {1: 1.0}) is None
    with pytest.raises(ValueError, match="no seed ran in both"):
        paired([])


def test_a_report_on_another_baseline_or_figure_writes_beside_the_default() -> None:
    from paired_report import default_name
    from run_matrix import load_matrix

    matrix = load_matrix(Path(__file__).resolve().parents[1] / "bench" / "matrices" / "spherefed.toml")
    assert default_name(matrix, "fedavg", "last5", "test_accuracy") == "spherefed.json"
    assert default_name(matrix, "fedavg", "final", "test_accuracy") == "spherefed-final.json"
    assert default_name(matrix, "fedavg+ffc", "final", "test_accuracy") == "spherefed-vs-fedavg+ffc-final.json"
    assert default_name(matrix, "fedavg", "last5", "personalized_accuracy_mean") == \
        "spherefed-personalized_accuracy_mean.json"


def test_a_codec_report_counts_bytes_per_device_and_the_accuracy_within_an_equal_upload() -> None:
    from compression_report import accuracy_within, bytes_per_device, reached

    rows = [{"round": 0, "test_accuracy": 0.1},
            {"round": 1, "selected": 2, "returned": 2, "bytes_up": 200, "bytes_down": 1100, "bytes_broadcast": 1000},
            {"round": 2, "selected": 2, "returned": 1, "bytes_up": 100, "bytes_down": 1100, "bytes_broadcast": 1000,
             "test_accuracy": 0.5},
            {"round": 3, "selected": 2, "returned": 2, "bytes_up": 200, "bytes_down": 1100, "bytes_broadcast": 1000,
             "test_accuracy": 0.7}]
    up, down = bytes_per_device(rows)
    assert up == 500 / 5 and down == 1000 + 100 / 2   # a result per device that answered; the broadcast + its task
    assert accuracy_within(rows, 300) == (2, 0.5) and accuracy_within(rows, 299) == (0, 0.1)
    assert reached(rows, 0.6) == 3 and reached(rows, 0.8) is None


def test_the_codec_report_pairs_every_row_with_the_baseline_of_its_seeds() -> None:
    from compression_report import report
    from run_matrix import load_matrix

    root = Path(__file__).resolve().parents[1]
    entries = report(load_matrix(root / "bench/matrices/downlink.toml"), root / "bench/results",
                     root / "bench/results/codec_speed.json")
    by_row = {e["row"]: e for e in entries}
    assert by_row["fp32"]["paired_vs_baseline"] is None and by_row["fp32"]["down_times_fewer"] == 1.0
    int8 = by_row["int8"]
    assert int8["paired_vs_baseline"]["n"] == len(int8["seeds"]) and int8["down_times_fewer"] > 3
