"""`fedge-profile show` and `html` on a recorded run (tests/fixtures/profile_run, see record_profile_run.py).

The fixture is a real 14-round run over Mosquitto: two spawned clients on digits and
``dev-slow`` on twelve times the digits train split, with deadline selection and a
5 s round timeout. dev-slow missed a deadline (its result arrived late), was
skipped for it, and was tried again after five skips. The expectations below are
read from the fixture's own files, so re-recording it keeps them true.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from profiling.cli import main
from profiling.html import PLOTS, plot_headline, plot_bytes, plot_memory, plot_round_times
from profiling.runs import RunRecords, device_stats, load, straggler_ranks
from profiling.units import human_bytes

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "profile_run"
DEVICES = ("dev-slow", "sim-000", "sim-001")
ROWS = [json.loads(line) for line in (FIXTURE / "metrics.jsonl").read_text().splitlines()]
SLOW_LINES = [json.loads(line) for line in (FIXTURE / "clients" / "dev-slow.jsonl").read_text().splitlines()]
LATE_ROUNDS = [line["round"] for line in SLOW_LINES if line["late"]]
SKIPPED_ROUNDS = [row["round"] for row in ROWS if "dev-slow" in row.get("skipped", [])]


@pytest.fixture
def wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")   # rich would otherwise fold the wide tables to 80 columns


def table_rows(text: str, first_cell: str) -> list[list[str]]:
    """Cells of the rich table rows whose first or second cell is ``first_cell``."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if first_cell in cells[:2]:
            rows.append(cells)
    return rows


def test_records_of_the_fixture_are_read_back():
    run = load(FIXTURE)
    assert [r["round"] for r in run.rounds] == list(range(15)) and run.round_timeout == 5.0
    assert sorted(run.devices) == list(DEVICES)
    slow = run.devices["dev-slow"]
    assert slow.facts["cores"] >= 1 and slow.facts["torch"]
    assert LATE_ROUNDS and SKIPPED_ROUNDS, "the fixture should show a straggler; re-record it"
    late = [t for t in slow.tasks if t.late]
    assert [t.round for t in late] == LATE_ROUNDS and all(t.round_seconds > 5.0 for t in late)
    assert not any(t.missed for t in slow.tasks)          # each missed line was replaced by its late answer
    assert len(slow.tasks) == len({line["task_id"] for line in SLOW_LINES})
    assert all(t.profile["phases"].get("encode") for t in run.devices["sim-000"].tasks[:-1])   # from the next result
    stats = {s.client_id: s for s in map(device_stats, run.devices.values())}
    assert straggler_ranks(stats.values())["dev-slow"] == 1
    for s in stats.values():
        assert s.step_p50 <= s.step_p95 <= s.step_max and s.peak_rss_bytes > 0 and s.temperature_c is None
        assert {"forward", "backward", "optimizer"} <= set(s.breakdown)


def test_show_prints_devices_phases_and_rounds(capsys, wide_terminal):
    assert main(["show", str(FIXTURE)]) == 0
    out = capsys.readouterr().out
    for title in ("Devices", "Where a task's time goes", "Rounds", "final accuracy"):
        assert title in out
    slow = table_rows(out, "dev-slow")[0]
    tasks = len({line["task_id"] for line in SLOW_LINES})
    assert slow[0] == "1" and slow[3] == f"{tasks} ({len(LATE_ROUNDS)} late)"   # rank 1 = the straggler
    assert slow[-1] == str(len(SKIPPED_ROUNDS))
    rounds_part = out[out.index("Rounds"):]
    for row in ROWS[1:]:
        cells = table_rows(rounds_part, str(row["round"]))[0]
        assert cells[8] == (", ".join(row["skipped"]) or "—") and cells[6] == row["slowest_client"]
    summary = json.loads((FIXTURE / "summary.json").read_text())
    assert f"{summary['final_accuracy']:.4f}" in out
    assert "—" in out                                       # no temperature sensor here: absent, not 0


def test_show_reads_one_devices_history(capsys, wide_terminal):
    assert main(["show", str(FIXTURE / "clients" / "sim-000" / "profile.jsonl")]) == 0
    out = capsys.readouterr().out
    run_id = json.loads((FIXTURE / "summary.json").read_text())["run_id"]
    assert "Tasks of sim-000" in out and len(table_rows(out, run_id)) == len(ROWS) - 1
    assert main(["show", str(FIXTURE / "clients" / "dev-slow.jsonl")]) == 0
    out = capsys.readouterr().out
    assert out.count("late") == len(LATE_ROUNDS)


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_html_is_one_self_contained_file_with_the_plots(tmp_path, capsys):
    report = tmp_path / "out" / "report.html"
    assert main(["html", str(FIXTURE), "-o", str(report)]) == 0
    text = report.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    images = re.findall(r'<figure id="([a-z-]+)"><img alt="[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)"',
                        text)
    assert [anchor for anchor, _ in images] == ["headroom", "over-time", "accuracy", "bytes", "round-times", "phases",
                                                "memory"]
    for _, data in images:
        width, height = _png_size(base64.b64decode(data))
        assert width > 300 and height > 150
    assert not re.search(r'(src|href)="(?!data:)', text)   # nothing to fetch: it opens anywhere
    for device in DEVICES:
        assert f"<td class=\"l\">{device}</td>" in text
    assert "Devices&#x27; facts" in text and "Rounds" in text


def test_reports_render_a_run_without_profiles_and_refuse_a_wrong_path(tmp_path, capsys, wide_terminal):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(FIXTURE / "metrics.jsonl", bare / "metrics.jsonl")
    assert main(["show", str(bare)]) == 0 and "no device profiles" in capsys.readouterr().out
    assert main(["html", str(bare), "-o", str(tmp_path / "bare.html")]) == 0
    assert (tmp_path / "bare.html").read_text().count("<img") == 2   # accuracy and bytes only
    assert main(["show", str(tmp_path / "nothing-here")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["html", str(tmp_path / "empty")]) == 2
    assert "run directory" in capsys.readouterr().err


def test_fedge_profile_is_declared_as_a_command():
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["fedge-profile"] == "profiling.cli:main"
    out = subprocess.run([sys.executable, "-m", "profiling.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and all(command in out.stdout for command in ("show", "html", "infer"))


def _drawn(fig):
    fig.draw_without_rendering()   # lays out ticks and legends as saving the PNG does
    return fig


def _shown_ticks(ax) -> list[float]:
    low, high = sorted(ax.get_xlim())
    return [t for t in ax.get_xticks() if low <= t <= high]


def test_per_round_plots_have_integer_round_ticks():
    run = load(FIXTURE)
    stats = run.stats()
    for plot in (plot_headline, plot_bytes, plot_round_times):
        ax = _drawn(plot(run, stats)).axes[0]
        ticks = _shown_ticks(ax)
        assert ticks and all(float(t).is_integer() for t in ticks), (plot.__name__, ticks)
        assert all(label.get_text().lstrip("−-").isdigit() for label in ax.get_xticklabels() if label.get_text())
    long_run = RunRecords(FIXTURE, rounds=[{"round": r, "test_accuracy": r / 60, "bytes_down": 1, "bytes_up": 1}
                                           for r in range(61)])
    for plot in (plot_headline, plot_bytes):   # past 20 rounds: fewer ticks, still whole rounds
        ticks = _shown_ticks(_drawn(plot(long_run, [])).axes[0])
        assert 3 <= len(ticks) <= 12 and all(float(t).is_integer() for t in ticks)


def test_legends_sit_outside_the_plotted_area():
    run = load(FIXTURE)
    stats = run.stats()
    for _, _, plot in PLOTS:
        fig = _drawn(plot(run, stats))
        area = fig.axes[0].get_window_extent()
        legends = fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
        for legend in legends:
            assert not legend.get_window_extent().overlaps(area), plot.__name__


def _deadline_line(ax):
    lines = [line for line in ax.get_lines() if line.get_gid() == "deadline"]
    assert len(lines) == 1
    return lines[0]


def test_round_time_axis_keeps_to_the_data_and_draws_the_deadline():
    run = load(FIXTURE)
    longest = max(t.round_seconds for d in run.devices.values() for t in d.tasks if t.round_seconds is not None)
    ax = _drawn(plot_round_times(run, run.stats())).axes[0]
    assert run.round_timeout < longest                    # the straggler's late answer went past the deadline
    assert _deadline_line(ax).get_ydata()[0] == run.round_timeout and longest <= ax.get_ylim()[1] < 1.2 * longest
    run.config["clients"]["round_timeout"] = 60 * longest   # far above every round time
    fig = _drawn(plot_round_times(run, run.stats()))
    ax = fig.axes[0]
    assert longest <= ax.get_ylim()[1] < 1.2 * longest      # not stretched to the timeout
    assert _deadline_line(ax).get_ydata()[0] == ax.get_ylim()[1]   # along the top edge ...
    labels = [t.get_text() for t in fig.legends[0].get_texts()] + [t.get_text() for t in ax.texts]
    assert sum(f"{60 * longest:g} s" in label for label in labels) == 2   # ... with its value named


# -- a real run with more than one kind of task --------------------------------------------------------------


@pytest.fixture(scope="module")
def sphere_run(tmp_path_factory) -> Path:
    """A real two-round SphereFed run (in-process clients on digits): training tasks, then an FFC task each."""
    from coordinator.ui.cli import main as coordinator_main

    out = tmp_path_factory.mktemp("sphere") / "run"
    assert coordinator_main(["run", "--transport", "inproc", "--spawn-clients", "2", "--clients", "2", "--rounds", "2",
                             "--data", "digits", "--model", "mlp", "--set", "model.hidden=[16]", "--strategy",
                             "spherefed", "--set", "export.enabled=false", "--out", str(out)]) == 0
    return out


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _with_ffc_peak(run: Path, to: Path, device: str = "sim-000") -> int:
    """Copy ``run`` to ``to`` with its device's peaks set as a deployed device's were: 316 MiB in its
    training tasks, 381 MiB in its FFC task (the clients of this run are threads of the test process,
    whose RSS is the whole test session's); return the FFC peak."""
    shutil.copytree(run, to)
    path = to / "clients" / f"{device}.jsonl"
    lines = _lines(path)
    peak = 381 * 2**20
    for line in lines:
        line["profile"]["peak_rss_bytes"] = peak if line["objective"] == "ffc_stats" else 316 * 2**20
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return peak


def test_reports_count_every_kind_of_task_and_take_the_peak_over_all_of_them(sphere_run, tmp_path, capsys,
                                                                            wide_terminal):
    run = load(sphere_run)
    for device, stats in ((d, s) for d, s in zip(run.devices, run.stats())):
        lines = _lines(sphere_run / "clients" / f"{device}.jsonl")
        kinds = {kind: sum(line["objective"] == kind for line in lines) for kind in ("sphere_train", "ffc_stats")}
        assert kinds["ffc_stats"] >= 1 and stats.tasks == len(lines) == sum(kinds.values())
        assert stats.kinds == kinds
        assert stats.peak_rss_bytes == max(line["profile"]["peak_rss_bytes"] for line in lines)
        assert stats.step_p50 is not None and stats.breakdown["forward"] > 0   # times still from training

    copy = tmp_path / "run"
    ffc_peak = human_bytes(_with_ffc_peak(sphere_run, copy))
    assert ffc_peak.endswith(" MiB")
    assert main(["show", str(copy)]) == 0
    out = capsys.readouterr().out
    device_row = table_rows(out[:out.index("Device resources")], "sim-000")[0]
    assert device_row[3] == "3" and device_row[4] == "sphere_train 2, ffc_stats 1"
    resources_row = table_rows(out[out.index("Device resources"):], "sim-000")[0]
    assert ffc_peak in resources_row                            # the FFC task's peak sizes the board
    report = tmp_path / "report.html"
    assert main(["html", str(copy), "-o", str(report)]) == 0
    assert ffc_peak in report.read_text() and "sphere_train 2, ffc_stats 1" in report.read_text()


def test_show_on_a_state_directory_names_the_device_by_its_client_id(sphere_run, tmp_path, capsys, wide_terminal):
    state = shutil.copytree(sphere_run / "clients" / "sim-001", tmp_path / "fedge-state")   # as on a device
    assert main(["show", str(state)]) == 0
    out = capsys.readouterr().out
    assert "Tasks of sim-001" in out and out.startswith("sim-001: ") and "fedge-state" not in out


def test_every_report_writes_bytes_in_mib(capsys, wide_terminal, tmp_path):
    assert main(["show", str(FIXTURE)]) == 0
    out = capsys.readouterr().out
    assert "MiB" in out and not re.search(r"\d (KB|MB|GB)\b", out)
    run = load(FIXTURE)
    for plot in (plot_bytes, plot_memory):
        assert plot(run, run.stats()).axes[0].get_ylabel() == "MiB"
    docs = (Path(__file__).resolve().parents[1] / "docs" / "profiling.md").read_text()
    assert "MiB" in docs and not re.search(r"\b(KB|MB|GB)\b", docs)   # one unit system, labelled


def test_memory_plot_leaves_absent_readings_as_gaps():
    run = load(FIXTURE)
    no_uss = run.devices["sim-001"]            # as a device that cannot read USS records it: null
    no_uss.tasks = [dataclasses.replace(t, profile={**t.profile, "peak_uss_bytes": None}) for t in no_uss.tasks]
    stats = run.stats()
    fig = _drawn(plot_memory(run, stats))
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["peak RSS", "peak USS"]                   # no "0: not measured"
    ax = fig.axes[0]
    uss_bars = [p for p in ax.patches if p.get_gid() == "peak USS"]
    measured = [s for s in stats if s.peak_rss_bytes is not None]
    assert len(uss_bars) == sum(s.peak_uss_bytes is not None for s in measured) == len(measured) - 1
    assert all(bar.get_height() > 0 for bar in ax.patches)      # nothing drawn as 0
    names = [label.get_text() for label in ax.get_xticklabels()]
    gap = names.index("sim-001")
    assert not any(abs(bar.get_x() + bar.get_width() / 2 - gap) < 0.4 for bar in uss_bars)


def test_the_docs_describe_every_infer_option():
    from profiling.cli import build_parser

    docs = (Path(__file__).resolve().parents[1] / "docs" / "profiling.md").read_text()
    infer = next(a for a in build_parser()._subparsers._group_actions[0].choices.values() if a.prog.endswith("infer"))
    for action in infer._actions:
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                assert f"`{option}" in docs or f" {option}" in docs, option
    section = docs[docs.index("## Inference on the device"):docs.index("## Device footprint")]
    assert "CPU provider (" not in section and "--provider" in section
