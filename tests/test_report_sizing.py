"""The reports' sizing section: peak memory against each device's memory, per-sample speed, class, site,
traffic, time offline and inference, checked against the records the figures come from.

A real short run (SphereFed with its FFC calibration, so two kinds of task, on digits with three
spawned clients over Mosquitto, one of them benchmarked with ``fedge-profile infer``) and the
recorded ``tests/fixtures/profile_run`` (a straggler that holds more data) are rendered; every
expectation is computed here from the run's own files, not from the report code.
"""

from __future__ import annotations

import html
import logging
import json
import re
import shutil
import statistics
from pathlib import Path

import pytest

from coordinator.config import load_config
from coordinator.runtime.presence import PRESENCE_FILE, PresenceLog, Roster
from coordinator.runtime.run import run_federated
from coordinator.runtime.selection import Absences
from edge_client.client import presence_payload
from edge_client.wire.protocol import PresenceBody
from edge_client.wire.throttle import ThrottledLog
from profiling.cli import main
from profiling.html import render_html
from profiling.runs import load
from profiling.sizing import offline_spans, sizing
from profiling.units import human_bytes, milliseconds

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "profile_run"


def lines_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def html_table(text: str, title_start: str) -> dict[str, dict[str, str]]:
    """The HTML table whose title starts with ``title_start``: {device: {column: cell}}."""
    match = re.search(r"<h2>" + re.escape(html.escape(title_start)) + r".*?</h2>\s*<div class=\"scroll\"><table>"
                      r"(.*?)</table>", text, re.S)
    assert match, f"no table titled {title_start!r}"
    rows = re.findall(r"<tr>(.*?)</tr>", match.group(1), re.S)
    columns = [html.unescape(c) for c in re.findall(r"<th[^>]*>(.*?)</th>", rows[0])]
    table = {}
    for row in rows[1:]:
        cells = dict(zip(columns, (html.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row))))
        table[cells["device"]] = cells
    return table


def expected_sizing(run_dir: Path, client_id: str, training: set[str]) -> dict:
    """Peak, its kind and round, memory, headroom and per-sample time of one client, from its raw records."""
    lines = lines_of(run_dir / "clients" / f"{client_id}.jsonl")
    peak_line = max((line for line in lines if line["profile"].get("peak_rss_bytes")),
                    key=lambda line: line["profile"]["peak_rss_bytes"])
    totals = [line["profile"]["memory_total_bytes"] for line in lines if line["profile"].get("memory_total_bytes")]
    facts = json.loads((run_dir / "clients" / f"{client_id}.json").read_text())["device"]
    total = totals[-1] if totals else facts["ram_bytes"]
    per_sample = [line["profile"]["phases"]["train"] / line["profile"]["samples"] for line in lines
                  if line["objective"] in training and line["profile"].get("samples")]
    return {"peak": peak_line["profile"]["peak_rss_bytes"], "kind": peak_line["objective"],
            "round": peak_line["round"], "total": total, "headroom": total - peak_line["profile"]["peak_rss_bytes"],
            "per_sample": statistics.median(per_sample)}


@pytest.fixture(scope="module")
def sphere_run(tmp_path_factory, mosquitto):
    """Two SphereFed rounds (sphere_train, then ffc_stats after the last) with three spawned clients of one
    class and site, and an inference benchmark of the exported model in sim-000's state directory."""
    tmp = tmp_path_factory.mktemp("sizing")
    patch = pytest.MonkeyPatch()
    patch.setenv("FEDGE_DEVICE_CLASS", "test-box")   # the spawned clients inherit these
    patch.setenv("FEDGE_SITE", "lab-7")
    try:
        config = load_config(None, [
            ("run", "strategy", "spherefed"), ("run", "rounds", 2), ("run", "out", str(tmp / "run")),
            ("model", "name", "cnn"), ("model", "head", "sphere"), ("data", "eval", "digits"),
            ("clients", "expected", 3), ("clients", "spawn", 3), ("clients", "round_timeout", 60.0),
            ("clients", "presence_timeout", 60.0), ("transport", "broker", mosquitto),
            ("transport", "prefix", "sizing")])
        out = run_federated(config, say=lambda s: None).out_dir
    finally:
        patch.undo()
    assert main(["infer", str(out / "export" / "model.onnx"), "--state-dir", str(out / "clients" / "sim-000"),
                 "--runs", "20", "--warmup", "2", "--batch", "8"]) == 0
    return out


def test_sizing_figures_of_a_real_run_match_its_records(sphere_run):
    run = load(sphere_run)
    training = {"sphere_train"}
    assert run.training_objectives == training
    rows = {s.client_id: s for s in sizing(run)}
    assert sorted(rows) == ["sim-000", "sim-001", "sim-002"]
    for cid, s in rows.items():
        want = expected_sizing(sphere_run, cid, training)
        assert s.memory_total_bytes == want["total"] > 0   # the profile's own memory_total_bytes
        assert (s.peak_rss_bytes, s.peak_kind, s.peak_round) == (want["peak"], want["kind"], want["round"])
        assert s.headroom_bytes == want["headroom"] == s.memory_total_bytes - s.peak_rss_bytes
        assert set(s.peaks) == {"sphere_train", "ffc_stats"} and max(s.peaks.values()) == s.peak_rss_bytes
        assert s.seconds_per_sample == pytest.approx(want["per_sample"])
        assert (s.device_class, s.site) == ("test-box", "lab-7")
        rounds = lines_of(sphere_run / "metrics.jsonl")[1:]
        assert s.bytes_up == sum(r["bytes_per_client"][cid]["up"] for r in rounds) > 0
        # its tasks, and the model broadcast of each round it had one in
        assert s.bytes_down == sum(r["bytes_per_client"][cid]["down"] + r["bytes_broadcast"] for r in rounds
                                   if r["bytes_per_client"][cid]["down"] > 0) > 0
        assert s.offline == []
    assert rows["sim-000"].inference is not None and rows["sim-000"].inference.batch == 8
    assert rows["sim-001"].inference is None
    assert all(isinstance(line.get("time"), float) for cid in rows
               for line in lines_of(sphere_run / "clients" / f"{cid}.jsonl"))
    online = [p["client_id"] for p in lines_of(sphere_run / PRESENCE_FILE) if p["state"] == "online"]
    assert sorted(online) == sorted(rows)


def test_html_sizing_section_shows_headroom_peak_kind_and_per_sample_speed(sphere_run, tmp_path):
    report = tmp_path / "report.html"
    assert main(["html", str(sphere_run), "-o", str(report)]) == 0
    text = report.read_text()
    assert text.index('id="sizing"') < text.index("Devices (tasks of every kind")   # sizing comes first
    fit = html_table(text, "Will it fit?")
    kinds = html_table(text, "Peak memory per kind of task")
    speed = html_table(text, "Speed per sample")
    traffic = html_table(text, "Traffic, time offline and inference")
    for cid in ("sim-000", "sim-001", "sim-002"):
        want = expected_sizing(sphere_run, cid, {"sphere_train"})
        row = fit[cid]
        assert row["memory"] == human_bytes(want["total"]) and row["peak"] == human_bytes(want["peak"])
        assert row["headroom"] == human_bytes(want["headroom"])
        assert row["peak set by"] == f"{want['kind']} (round {want['round']})"
        assert kinds[cid][want["kind"]] == human_bytes(want["peak"])
        assert (speed[cid]["class"], speed[cid]["site"]) == ("test-box", "lab-7")
        assert speed[cid]["ms/sample"] == milliseconds(want["per_sample"]) and traffic[cid]["offline"] == "no"
    infer = lines_of(sphere_run / "clients" / "sim-000" / "profile.jsonl")[-1]
    one = next(r for r in infer["results"] if r["batch"] == 1)
    assert traffic["sim-000"]["p50 ms"] == milliseconds(one["p50"])
    assert traffic["sim-001"]["p50 ms"] == "—"
    assert html_table(text, "Inference benchmarks").keys() == {"sim-000"}
    for anchor in ("headroom", "over-time"):
        assert re.search(rf'<figure id="{anchor}"><img alt="[^"]+" src="data:image/png;base64,', text)


def test_show_on_a_devices_own_history_says_whether_it_fits(sphere_run, capsys, monkeypatch):
    """On the device itself (its state directory): the same headroom, from its own profile.jsonl."""
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["show", str(sphere_run / "clients" / "sim-000")]) == 0
    out = capsys.readouterr().out
    history = [line for line in lines_of(sphere_run / "clients" / "sim-000" / "profile.jsonl")
               if line["kind"] == "task"]
    top = max(history, key=lambda line: line["peak_rss_bytes"])
    headroom = history[-1]["memory_total_bytes"] - top["peak_rss_bytes"]
    fit = out[out.index("Will it fit?"):]
    row = next(line for line in fit.splitlines() if "sim-000" in line)
    assert human_bytes(headroom) in row and f"{top['objective']} (round {top['round']})" in row


def test_a_device_with_more_data_is_slowest_per_task_but_not_per_sample():
    """The fixture's dev-slow trains on far more samples per task: the straggler rank puts it first, the
    per-sample rank where its speed puts it."""
    run = load(FIXTURE)
    rows = {s.client_id: s for s in sizing(run)}
    per_sample = {cid: expected_sizing(FIXTURE, cid, {"train"})["per_sample"] for cid in rows}
    assert rows["dev-slow"].samples_per_task > 5 * rows["sim-000"].samples_per_task
    assert min(per_sample, key=per_sample.get) == "dev-slow", "the fixture's straggler should be fastest per sample"
    text = render_html(run)
    speed, traffic = html_table(text, "Speed per sample"), html_table(text, "Traffic, time offline")
    assert speed["dev-slow"]["round rank"] == "1" and speed["dev-slow"]["rank"] == str(len(rows))
    for cid, s in rows.items():
        assert speed[cid]["ms/sample"] == milliseconds(per_sample[cid])
        # the fixture predates memory_total_bytes: the headroom is against the RAM its hello reported
        facts = json.loads((FIXTURE / "clients" / f"{cid}.json").read_text())["device"]
        assert s.memory_total_bytes == facts["ram_bytes"] and s.headroom_bytes == facts["ram_bytes"] - s.peak_rss_bytes
        assert s.offline is None and traffic[cid]["offline"] == "—"   # no presence records: unknown, not "no"


def test_offline_spans_come_from_the_presence_the_coordinator_logged(tmp_path):
    """Presence messages through the coordinator's roster become presence.jsonl; an absence still open at the
    end of the records ends there."""
    run_dir = tmp_path / "run"
    roster = Roster(Absences(0), ThrottledLog(logging.getLogger("test")),
                    PresenceLog(run_dir / PRESENCE_FILE, lambda: 4))
    for state in ("online", "offline", "online", "offline"):
        roster.on_presence("pi-1", presence_payload("pi-1", PresenceBody(state)))
    roster.on_presence("pi-2", presence_payload("pi-2", PresenceBody("online")))
    roster.on_presence("pi-2", b"not a message")            # dropped, as the coordinator does
    (run_dir / "metrics.jsonl").write_text(json.dumps({"round": 0}) + "\n")
    logged = lines_of(run_dir / PRESENCE_FILE)
    assert [(p["client_id"], p["state"], p["after_round"]) for p in logged] == [
        ("pi-1", "online", 4), ("pi-1", "offline", 4), ("pi-1", "online", 4), ("pi-1", "offline", 4),
        ("pi-2", "online", 4)]
    run = load(run_dir)
    t = [p["time"] for p in logged]
    assert offline_spans(run, "pi-1") == [(t[1], t[2]), (t[3], t[4])]   # the second ends at the last record
    assert offline_spans(run, "pi-2") == []


def test_malformed_records_leave_figures_absent_and_never_crash_the_report(tmp_path, capsys, monkeypatch):
    """What the report reads came from devices and files: wrong types are dropped, not computed with."""
    monkeypatch.setenv("COLUMNS", "250")
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE, run_dir)
    (run_dir / PRESENCE_FILE).write_text("\n".join(json.dumps(line) for line in (
        {"time": "soon", "client_id": "sim-000", "state": "offline"}, {"time": 1.0, "client_id": 7, "state": "offline"},
        {"time": 2.0, "client_id": "sim-000", "state": "asleep"}, [1, 2])) + "\n{torn")
    (run_dir / "clients" / "sim-000" / "profile.jsonl").write_text("\n".join(json.dumps(line) for line in (
        {"kind": "infer", "results": 5, "peak_rss_bytes": "big"},
        {"kind": "infer", "model_name": ["x"], "results": [{"batch": "1", "p50": 0.1, "p95": 0.1, "p99": 0.1,
                                                            "samples_per_second": 10.0},
                                                           {"batch": 4, "p50": "fast", "p95": 0.1, "p99": 0.1,
                                                            "samples_per_second": 10.0}, "x"]})) + "\n")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows[1]["bytes_per_client"] = {"sim-001": {"down": -5, "up": "many"}, "sim-000": [1]}
    rows[2]["bytes_per_client"] = "all of them"
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    lines = lines_of(run_dir / "clients" / "sim-001.jsonl")
    lines[0]["profile"]["peak_rss_bytes"] = 0           # a zero peak still draws on the log axis
    lines[1]["profile"]["memory_total_bytes"] = "lots"
    lines[1]["time"] = "noon"
    (run_dir / "clients" / "sim-001.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    run = load(run_dir)
    assert run.presence == []
    by_id = {s.client_id: s for s in sizing(run)}
    assert by_id["sim-000"].inference is None and by_id["sim-000"].offline is None
    assert by_id["sim-001"].bytes_up == sum(r["bytes_per_client"]["sim-001"]["up"] for r in rows[3:])
    assert main(["html", str(run_dir), "-o", str(tmp_path / "report.html")]) == 0
    assert 'id="headroom"' in (tmp_path / "report.html").read_text()
    assert main(["show", str(run_dir)]) == 0 and "Will it fit?" in capsys.readouterr().out


def test_a_presence_log_that_cannot_be_written_does_not_stop_the_coordinator(tmp_path, caplog):
    """presence.jsonl is for reports: when it cannot be written (here a directory stands in its place), the
    roster still takes the client online and says why the line is missing."""
    blocked = tmp_path / PRESENCE_FILE
    blocked.mkdir()
    roster = Roster(Absences(0), ThrottledLog(logging.getLogger("test")), PresenceLog(blocked, lambda: 0))
    with caplog.at_level(logging.WARNING, logger="fedge.coordinator"):
        assert roster.on_presence("pi-1", presence_payload("pi-1", PresenceBody("online")))
    assert "pi-1" in roster.online and "could not record that client pi-1 is online" in caplog.text
