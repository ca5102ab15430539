"""The per-round table when output is piped (a file, a CI log): one plain line per round, with the columns
of the modes a run has on (real runs for those)."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

from rich.console import Console

from coordinator.ui.cli import main
from coordinator.ui.report import RoundTable

ROWS = [
    {"round": 0, "test_accuracy": 0.1024, "test_loss": 2.3031, "returned": 0, "selected": 0, "seconds": 0.4},
    {"round": 7, "test_accuracy": 0.91234, "test_loss": 0.2345, "personalized_accuracy_mean": 0.95, "returned": 10,
     "selected": 10, "late": 1, "rejected": 2, "bytes_down": 123_456_789, "bytes_up": 98_765_432, "seconds": 123.4},
    {"round": 1000, "test_accuracy": None, "test_loss": 12.3456, "personalized_accuracy_mean": 0.5, "returned": 100,
     "selected": 100, "late": 10, "rejected": 10, "bytes_down": 1023.9 * 2**20, "bytes_up": 1023.9 * 2**20,
     "seconds": 99999.9},
]


def _piped_lines(rows: list[dict]) -> list[str]:
    console = Console(file=io.StringIO(), width=80, force_terminal=False)
    with RoundTable(console) as table:
        for row in rows:
            table.add(row)
    return console.file.getvalue().splitlines()


def test_piped_output_is_one_line_per_round_within_80_columns():
    header, *lines = _piped_lines(ROWS)
    assert header.split() == ["round", "accuracy", "loss", "personal", "clients", "late/rej", "down", "up",
                              "seconds"]
    assert len(lines) == len(ROWS)
    for line, row in zip(lines, ROWS):
        assert line.split()[0] == str(row["round"])
        assert len(line) <= 80, line
    assert lines[1].split() == ["7", "0.9123", "0.2345", "0.9500", "10/10", "1/2", "117.7", "MiB", "94.2", "MiB",
                                "123.4"]
    assert lines[2].split()[1] == "-"                          # no global accuracy (DFL)


def test_a_cell_wider_than_its_column_widens_the_line_without_wrapping_it():
    huge = {"round": 3, "test_loss": 1.0, "bytes_down": 5 * 2**40, "seconds": 12_345_678.9}   # 5120.0 GiB
    header, line = _piped_lines([huge])
    assert line.split()[0] == "3" and line.split()[-1] == "12345678.9" and "5120.0 GiB" in line


def test_progress_shows_clients_coming_online_and_results_coming_in():
    out = io.StringIO()
    table = RoundTable(Console(file=out, width=80, force_terminal=False))
    table.PIPED_EVERY = 0.0   # every change makes a line
    table.progress({"kind": "waiting", "online": [], "needed": 2})
    table.progress({"kind": "waiting", "online": ["pi-01"], "needed": 2})
    exchange = {"kind": "exchange", "round": 1, "phase": "train", "attempt": 1, "results": 0, "selected": 2,
                "bytes_down": 3_000_000, "bytes_up": 0, "started": time.monotonic() - 12, "timeout": 300.0}
    table.progress(exchange)
    table.progress({**exchange, "bytes_up": 10})        # bytes alone: no new line within PIPED_EVERY
    table.progress({**exchange, "results": 1, "bytes_up": 1_500_000})
    lines = out.getvalue().splitlines()
    assert lines[0] == "waiting for clients: 0/2 online"
    assert lines[1] == "waiting for clients: 1/2 online (pi-01)"
    assert lines[2].startswith("round 1: 0/2 results, 2.9 MiB down, 0 B up, 12 s of 300 s")
    assert lines[3].startswith("round 1: 1/2 results") and len(lines) == 4


def test_a_quick_round_adds_no_progress_lines_to_a_log_but_waiting_shows_at_once():
    out = io.StringIO()
    table = RoundTable(Console(file=out, width=80, force_terminal=False))
    table.progress({"kind": "waiting", "online": ["a"], "needed": 2})
    for results in range(3):
        table.progress({"kind": "exchange", "round": 1, "phase": "train", "attempt": 1, "results": results,
                        "selected": 3, "bytes_down": 0, "bytes_up": 0, "started": time.monotonic(), "timeout": 9.0})
    assert out.getvalue().splitlines() == ["waiting for clients: 1/2 online (a)"]


# --------------------------------------------------------------------------- the columns a mode adds, in real runs
RUN = ["run", "--transport", "inproc", "--spawn-clients", "4", "--clients", "4", "--rounds", "2", "--data", "digits",
       "--model", "mlp", "--set", "model.hidden=[16]", "--set", "export.enabled=false"]


def _table_of(capsys, out: Path, *sets: str) -> tuple[list[str], list[list[str]], list[dict]]:
    """Run the CLI piped; the table's header, its lines (split on two spaces or more) and metrics.jsonl."""
    assert main([*RUN, "--out", str(out), *[arg for s in sets for arg in ("--set", s)]]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["round", "accuracy"])
    header = lines[start].split()
    table = [line.split() for line in lines[start + 1:start + 4]]
    return header, table, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_under_central_dp_and_secagg_the_table_shows_epsilon_spent_and_dropouts_tolerated(tmp_path, capsys):
    header, table, rows = _table_of(capsys, tmp_path / "run", "privacy.mode=central", "privacy.clip_norm=0.5",
                                    "privacy.noise_multiplier=1.0", "clients.max_attempts=1", "secagg.enabled=true",
                                    "privacy.allow_swamping_noise=true")   # 4 devices: the table, not learning
    assert header[-4:] == ["seconds", "ε", "spent", "drop/tol"]
    for line, row in zip(table[1:], rows[1:]):
        assert line[-2] == f"{row['dp_epsilon']:.2f}" and row["dp_epsilon"] > 0
        assert line[-1] == f"{row['secagg_dropped']}/{row['secagg_degree'] - row['secagg_threshold']}"
    assert table[2][-2] != table[1][-2]   # spent so far: it grows round by round


def test_in_async_mode_the_table_shows_staleness(tmp_path, capsys):
    header, table, rows = _table_of(capsys, tmp_path / "run", "run.mode=async", "async.concurrency=4",
                                    "async.buffer_size=2")
    assert header[-3:] == ["seconds", "stale", "avg/max"] and "ε" not in header and "drop/tol" not in header
    for line, row in zip(table[1:], rows[1:]):
        counts = {int(s): n for s, n in row["staleness"].items()}
        mean = sum(s * n for s, n in counts.items()) / sum(counts.values())
        assert line[-1] == f"{mean:.1f}/{max(counts)}"


def test_without_those_modes_the_table_has_its_usual_columns(tmp_path, capsys):
    header, _, _ = _table_of(capsys, tmp_path / "run")
    assert header[-1] == "seconds"
