"""bench/plot_matrix.py: figures of a matrix's run files, grouped by the other axes' labels.

The run files here are synthetic (a few rows each): this tests the plotting, not training.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from plot_matrix import main, plot_matrix  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"

MATRIX = """
name = "tiny"
seeds = [0, 1]
baseline = "method=fedavg"

[base.run]
rounds = 10

[[axes.alpha]]
label = "a0.1"
data.partition = "dirichlet:0.1"

[[axes.alpha]]
label = "a0.5"
data.partition = "dirichlet:0.5"

[[axes.model]]
label = "cnn"
model.name = "cnn"

[[axes.method]]
label = "pan"
run.strategy = "fedavg"
model.pan = "mul"

[[axes.method]]
label = "fedavg"
run.strategy = "fedavg"

[[axes.method]]
label = "short"
run.strategy = "fedma"
run.rounds = 4
"""


def rows(rounds: int, every: int, start: float, personalized: bool = False) -> list[dict]:
    out = []
    for r in range(rounds + 1):
        row = {"round": r, "bytes_down": 0 if r == 0 else 1000, "bytes_up": 0 if r == 0 else 5000}
        if r % every == 0 or r == rounds:
            row["test_accuracy"] = min(0.99, start + 0.05 * r)
            if personalized:
                row["personalized_accuracy_mean"] = min(0.99, start + 0.06 * r)
        out.append(row)
    return out


def write_run(results: Path, labels: list[str], seed: int, rounds: int, **record) -> None:
    body = {"matrix": "tiny", "group": "/".join(labels), "labels": labels, "seed": seed, "rounds": rounds,
            "config": {}, "seconds": 1.0, "rows": rows(rounds, 5 if rounds > 4 else 4, 0.1 + 0.01 * seed),
            "summary": {}}
    body.update(record)
    path = results / "tiny" / f"{'-'.join(labels)}-s{seed}-r{rounds}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body), encoding="utf-8")


@pytest.fixture
def matrix(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(MATRIX, encoding="utf-8")
    results = tmp_path / "results"
    for seed in (0, 1):
        write_run(results, ["a0.1", "cnn", "fedavg"], seed, 10)
        write_run(results, ["a0.1", "cnn", "pan"], seed, 10)
    write_run(results, ["a0.1", "cnn", "short"], 0, 4)              # its own run.rounds
    write_run(results, ["a0.5", "cnn", "fedavg"], 0, 10, rows=[(r | {"personalized_accuracy_mean": 0.5})
                                                                for r in rows(10, 5, 0.2)])
    write_run(results, ["a0.1", "cnn", "fedavg"], 0, 3)              # an older shorter trial: not read
    write_run(results, ["a0.1", "cnn", "pan"], 2, 10, rows=[])       # no rows: skipped
    write_run(results, ["a0.1", "cnn", "pan"], 3, 10, subset=True)   # skipped
    (results / "tiny" / "broken.json").write_text("{", encoding="utf-8")
    return path


def is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG


def test_one_figure_per_cell_of_the_other_axes(matrix: Path, tmp_path: Path, capsys):
    out = tmp_path / "images"
    assert main([str(matrix), "--results", str(tmp_path / "results"), "--out-dir", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["tiny-a0.1_cnn.png", "tiny-a0.5_cnn.png"]
    assert all(is_png(out / n) for n in names)
    printed = capsys.readouterr()
    assert "tiny-a0.1_cnn.png" in printed.out and "tiny-a0.5_cnn.png" in printed.out
    assert "skipped 4 run files" in printed.err and "other round counts" in printed.err


def test_lines_baseline_first_with_seed_counts(matrix: Path, tmp_path: Path, monkeypatch):
    import plot_matrix as pm

    drawn = {}
    monkeypatch.setattr(pm, "draw", lambda m, fixed, lines, *rest: drawn.setdefault(fixed, lines))
    plot_matrix(matrix, results=tmp_path / "results", out_dir=tmp_path / "images")
    lines = drawn[("a0.1", "cnn")]
    assert [(s.label, s.seeds) for s in lines] == [("fedavg", [0, 1]), ("pan", [0, 1]), ("short", [0])]
    a = lines[0].arrays()
    assert list(a["round"]) == [0, 5, 10]
    assert a["min"][0] == pytest.approx(0.10) and a["max"][0] == pytest.approx(0.11)
    assert a["mean"][0] == pytest.approx(0.105)
    assert list(a["bytes"]) == [0, 30000, 60000]    # cumulative down + up
    assert list(lines[2].arrays()["round"]) == [0, 4]
    drawn.clear()
    plot_matrix(matrix, x="upload", results=tmp_path / "results", out_dir=tmp_path / "images")
    assert list(drawn[("a0.1", "cnn")][0].arrays()["bytes"]) == [0, 25000, 50000]   # the upload alone


def test_bytes_axis_and_other_compared_axis(matrix: Path, tmp_path: Path):
    out = tmp_path / "images"
    assert main([str(matrix), "--results", str(tmp_path / "results"), "--out-dir", str(out), "--x", "bytes"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["tiny-a0.1_cnn-bytes.png", "tiny-a0.5_cnn-bytes.png"]
    assert all(is_png(p) for p in out.iterdir())
    written, _ = plot_matrix(matrix, axis="alpha", results=tmp_path / "results", out_dir=out)
    assert sorted(p.name for p in written) == ["tiny-cnn_fedavg.png", "tiny-cnn_pan.png", "tiny-cnn_short.png"]
    written, _ = plot_matrix(matrix, metric="personalized_accuracy_mean", results=tmp_path / "results", out_dir=out)
    assert [p.name for p in written] == ["tiny-a0.5_cnn-personalized.png"]
    assert is_png(written[0])


def test_rounds_option_reads_the_shorter_runs(matrix: Path, tmp_path: Path):
    written, _ = plot_matrix(matrix, results=tmp_path / "results", out_dir=tmp_path / "images", rounds=3)
    assert [p.name for p in written] == ["tiny-a0.1_cnn.png"] and is_png(written[0])


def test_no_runs_says_where_and_what_to_run(matrix: Path, tmp_path: Path, capsys):
    empty = tmp_path / "empty"
    assert main([str(matrix), "--results", str(empty), "--out-dir", str(tmp_path / "images")]) == 2
    err = capsys.readouterr().err
    assert str(empty / "tiny") in err and "bench/run_matrix.py" in err and "tiny.toml" in err
    assert not (tmp_path / "images").exists()
    assert main([str(matrix), "--results", str(tmp_path / "results"), "--rounds", "7",
                 "--out-dir", str(tmp_path / "images")]) == 2
    err = capsys.readouterr().err
    assert "runs of 7 rounds" in err and "3, 4, 10" in err


def test_unknown_axis(matrix: Path, tmp_path: Path, capsys):
    assert main([str(matrix), "--axis", "lr", "--results", str(tmp_path / "results"),
                 "--out-dir", str(tmp_path / "images")]) == 2
    err = capsys.readouterr().err
    assert "no axis 'lr'" in err and "alpha, model, method" in err


def test_weight_divergence_per_round(matrix: Path, tmp_path: Path):
    results = tmp_path / "results"
    diverging = [r | {"weight_divergence_mean": 0.5 / (1 + r["round"])} for r in rows(10, 5, 0.1) if r["round"] > 0]
    write_run(results, ["a0.5", "cnn", "pan"], 0, 10, rows=diverging)
    written, _ = plot_matrix(matrix, metric="weight_divergence_mean", results=results, out_dir=tmp_path / "images")
    assert [p.name for p in written] == ["tiny-a0.5_cnn-divergence.png"] and is_png(written[0])
