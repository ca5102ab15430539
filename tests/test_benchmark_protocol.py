"""Every method matrix follows the benchmark protocol, or says why a cell does not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from benchmark_protocol import deviations, load_protocol  # noqa: E402
from run_matrix import add_rounds_to_baseline, expand, load_matrix, protocol_check, summarize  # noqa: E402

from coordinator.config import load_config  # noqa: E402

MATRICES = sorted((ROOT / "bench" / "matrices").glob("*.toml"))


@pytest.mark.parametrize("path", MATRICES, ids=[p.stem for p in MATRICES])
def test_every_cell_follows_the_protocol_or_says_why(path):
    matrix = load_matrix(path)
    runs = expand(matrix, None, None, [])
    found = protocol_check(runs, load_protocol())
    assert runs and all(not departures or run.off_protocol for run, departures in zip(runs, found)), \
        [(run.group, departures) for run, departures in zip(runs, found) if departures and not run.off_protocol]


def test_a_departure_is_named():
    protocol = load_protocol()
    good = [("data", "eval", "fashion-mnist"), ("clients", "expected", 100), ("clients", "per_round", 10),
            ("train", "batch_size", 64), ("train", "lr", 0.02), ("run", "rounds", 100), ("eval", "every", 5),
            ("data", "partition", "dirichlet:0.5")]
    assert deviations(load_config(None, good), protocol, [0, 1, 2]) == []
    bad = load_config(None, good + [("train", "lr", 0.1), ("run", "rounds", 30), ("model", "name", "vgg9"),
                                    ("data", "partition", "iid")])
    found = " | ".join(deviations(bad, protocol, [0]))
    for text in ("train.lr = 0.1", "run.rounds = 30", "model = 'vgg9@1.0/none'", "data.partition = 'iid'", "seeds [0]"):
        assert text in found, (text, found)


def test_an_entry_only_with_another_axis_label_joins_only_those_cells(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text('seeds = [0]\n'
                    '[[axes.model]]\nlabel = "cnn"\nmodel.name = "cnn"\n'
                    '[[axes.model]]\nlabel = "vgg9"\nmodel.name = "vgg9"\n'
                    '[[axes.method]]\nlabel = "plain"\n'
                    '[[axes.method]]\nlabel = "from3"\nonly_with = "model=cnn"\nmodel.fed2_from = 3\n'
                    'run.rounds = 12\n')
    runs = expand(load_matrix(path), [0], None, [])
    assert [run.group for run in runs] == ["cnn/plain", "cnn/from3", "vgg9/plain"]
    assert [run.rounds for run in runs] == [5, 12, 5]          # an entry's own rounds (FedMA counts phases)
    assert ("model", "fed2_from", 3) in runs[1].overrides and all(k != "only_with" for _, k, _ in runs[1].overrides)
    text = path.read_text()
    path.write_text(text.replace('"model=cnn"', '"model=cnn, alpha=a0.1"').replace(
        'seeds = [0]\n', 'seeds = [0]\n[[axes.alpha]]\nlabel = "a0.1"\n[[axes.alpha]]\nlabel = "a0.5"\n'))
    assert [run.group for run in expand(load_matrix(path), [0], None, [])] == [
        "a0.1/cnn/plain", "a0.1/cnn/from3", "a0.1/vgg9/plain", "a0.5/cnn/plain", "a0.5/vgg9/plain"]
    path.write_text(text.replace('"model=cnn"', '"model=vgg9|cnn"'))      # either label
    assert [run.group for run in expand(load_matrix(path), [0], None, [])] == [
        "cnn/plain", "cnn/from3", "vgg9/plain", "vgg9/from3"]
    path.write_text(text.replace('"model=cnn"', '"model=cnn|resnet"'))
    with pytest.raises(Exception, match="only_with must be AXIS=LABEL of another axis"):
        load_matrix(path)
    path.write_text(text.replace('"model=cnn"', '"model=resnet"'))
    with pytest.raises(Exception, match="only_with must be AXIS=LABEL of another axis"):
        load_matrix(path)


def test_personalized_rounds_to_baseline_and_spread_over_clients(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text('seeds = [0]\nbaseline = "method=fedavg"\n'
                    '[[axes.method]]\nlabel = "fedavg"\n[[axes.method]]\nlabel = "dfl"\n')
    matrix = load_matrix(path)

    def record(group, personal, tested):
        rows = [{"round": r, "seconds": 1.0, "bytes_down": 10, "bytes_up": 20,
                 "personalized_accuracy_mean": personal(r), "personalized_accuracy_min": personal(r) - 0.1,
                 "personalized_accuracy_std": 0.02, **({"test_accuracy": personal(r)} if tested else {})}
                for r in range(1, 11)]
        return {"group": group, "seed": 0, "rounds": 10, "seconds": 10.0, "rows": rows}

    records = [record("fedavg", lambda r: 0.05 * r, True), record("dfl", lambda r: 0.1 * r, False)]
    table = summarize(records)
    add_rounds_to_baseline(table, records, matrix)
    fedavg, dfl = table
    assert fedavg["personalized_accuracy_mean"] == pytest.approx(0.4)       # rounds 6..10
    assert dfl["personalized_accuracy_client_std_mean"] == pytest.approx(0.02)
    assert dfl["rounds_to_baseline_personalized"] == [4]                      # 0.4 reached at round 4
    assert dfl["rounds_to_baseline_final"] == [None]                          # DFL has no global test accuracy
    assert fedavg["rounds_to_baseline_personalized"] == [8]


def test_an_entry_may_declare_fewer_seeds(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text('seeds = [0, 1, 2]\n'
                    '[[axes.model]]\nlabel = "cnn"\nmodel.name = "cnn"\n'
                    '[[axes.model]]\nlabel = "vgg9"\nmodel.name = "vgg9"\nseeds = [0]\n'
                    'off_protocol = "one seed: the budget"\n')
    matrix = load_matrix(path)
    runs = expand(matrix, None, None, [])
    assert [(run.group, run.seed) for run in runs] == [("cnn", 0), ("cnn", 1), ("cnn", 2), ("vgg9", 0)]
    assert runs[0].cell_seeds == (0, 1, 2) and runs[3].cell_seeds == (0,)
    assert all(("seeds" not in key) for run in runs for _, key, _ in run.overrides)
    found = protocol_check(runs, load_protocol())
    assert any("seeds [0]" in d for d in found[3]) and not any("seeds" in d for d in found[0])
    assert [run.seed for run in expand(matrix, [1], None, []) if run.group == "vgg9"] == [1]   # --seeds wins
    path.write_text(path.read_text().replace("seeds = [0]\n", 'seeds = "0"\n'))
    with pytest.raises(Exception, match="seeds must be a non-empty list of integers"):
        load_matrix(path)


def _dfl_record(partition: str, row: str, seed: int, mean: float, worst: float) -> dict:
    evaluated = [{"round": r, "personalized_accuracy_mean": mean, "personalized_accuracy_min": worst}
                 for r in range(5, 101, 5)]
    return {"labels": [partition, row], "seed": seed, "rows": [{"round": 0}, *evaluated]}


def test_the_dfl_verdict_pairs_seeds_and_applies_the_held_out_criterion():
    from dfl_verdict import compare, held_out_check, per_seed

    records = [_dfl_record(p, "fedavg", s, 0.80 + 0.02 * s, 0.70) for p in ("color5", "rotate5", "invert5")
               for s in (0, 1)]
    # DFL sits 3 points over FedAvg on the seen partitions and 4 on the held-out one, in every seed
    records += [_dfl_record(p, "dfl", s, 0.80 + 0.02 * s + gain, 0.70) for p, gain in
                (("color5", 0.03), ("rotate5", 0.03), ("invert5", 0.04)) for s in (0, 1)]
    order = [f"{p}/{r}" for p in ("color5", "rotate5", "invert5") for r in ("fedavg", "dfl")]
    table = compare(per_seed(records), order)
    assert table["color5"]["dfl"]["gain"]["mean"] == pytest.approx(0.03)
    assert table["color5"]["dfl"]["gain"]["std"] == pytest.approx(0.0)       # the seed offset cancels
    check = held_out_check(table, "dfl")
    assert check["gain_at_least_as_large"] and not check["worst_gap_no_larger"] and not check["generalizes"]
    assert held_out_check(compare(per_seed(records[:4]), order), "dfl") is None   # invert5 has not run
    # a DFL variant is also paired with plain DFL of the same seed; FedAvg and DFL themselves are not
    records += [_dfl_record("color5", "dfl-refresh", 0, 0.80 + 0.03 + 0.05, 0.75)]
    table = compare(per_seed(records), [*order, "color5/dfl-refresh"])
    assert table["color5"]["dfl-refresh"]["over_dfl"]["mean"] == pytest.approx(0.05)
    assert table["color5"]["dfl-refresh"]["seeds"] == [0]
    assert "over_dfl" not in table["color5"]["dfl"] and "over_dfl" not in table["color5"]["fedavg"]
