"""The Prometheus endpoint of a run and of an aggregation worker, the Grafana dashboard that reads it, and
``fedge-coordinator status``.

A real run (digits, 3 in-process clients training, 2 rounds) serves its metrics on a free port; the test
scrapes it over HTTP after round 1 and after the last round and checks every counter against the
``metrics.jsonl`` rows written by then, and the device percentiles against the profiles in ``clients/``.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.config import ConfigError, load_config
from coordinator.runtime.presence import Roster
from coordinator.runtime.profiles import ProfileStore
from coordinator.runtime.run import run_federated
from coordinator.runtime.selection import Absences
from coordinator.runtime.worker import AggregationWorker, serve_worker
from coordinator.telemetry import (DEVICE_FIGURES, QUANTILES, ROW_FIGURES, MetricsError, MetricsServer, RunTelemetry,
                                   WorkerTelemetry, run_telemetry)
from coordinator.ui.cli import main
from edge_client.client import presence_payload
from edge_client.wire.protocol import PresenceBody, Topics
from edge_client.wire.throttle import ThrottledLog
from edge_client.wire.transport import BrokerSettings, InprocHub, MqttTransport
from test_federation import config_for, read_metrics

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana-fedge.json"


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """Sample name -> {sorted label items: value}, parsed as Prometheus parses it."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def counter(samples: dict, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include ``labels``."""
    return sum(v for key, v in samples.get(name, {}).items() if set(labels.items()) <= set(key))


@pytest.fixture(scope="module")
def watched_run(tmp_path_factory):
    """A 2-round run with metrics on a free port, scraped from ``on_round`` after each row is written."""
    out = tmp_path_factory.mktemp("metrics") / "run"
    config = config_for(out, transport__kind="inproc", metrics__enabled=True, metrics__port=0,
                        export__enabled=False)
    said: list[str] = []
    scrapes: list[tuple[int, dict, list[dict], dict[str, dict]]] = []

    def on_round(row: dict) -> None:
        url = re.search(r"serving metrics at (http://\S+)", "\n".join(said)).group(1)
        profiles = {p.stem: json.loads(p.read_text())["profile"] for p in (out / "clients").glob("*.json")}
        rows = read_metrics(out) if row["round"] else []   # round 0's row is written with round 1's
        scrapes.append((row["round"], scrape(url), rows, profiles))

    result = run_federated(config, say=said.append, on_round=on_round)
    return result, scrapes, said


def test_the_endpoint_counts_what_the_rows_say_during_and_after_the_run(watched_run):
    result, scrapes, said = watched_run
    assert [s[0] for s in scrapes] == [0, 1, 2]
    for round, samples, rows, profiles in scrapes[1:]:
        assert [r["round"] for r in rows] == list(range(round + 1))   # the row is in when on_round hears of it
        assert counter(samples, "fedge_round") == round
        assert counter(samples, "fedge_results_total", outcome="accepted") == sum(r["returned"] for r in rows) > 0
        for outcome, column in (("late", "late"), ("rejected", "rejected"), ("failed", "failed")):
            assert counter(samples, "fedge_results_total", outcome=outcome) == sum(r.get(column, 0) for r in rows)
        assert counter(samples, "fedge_bytes_total", direction="down") == sum(r["bytes_down"] for r in rows) > 0
        assert counter(samples, "fedge_bytes_total", direction="up") == sum(r["bytes_up"] for r in rows) > 0
        assert counter(samples, "fedge_clients_selected_total") == sum(r["selected"] for r in rows)
        assert counter(samples, "fedge_round_seconds_count") == round
        assert counter(samples, "fedge_round_seconds_sum") == pytest.approx(sum(r["seconds"] for r in rows[1:]))
        assert counter(samples, "fedge_test_accuracy") == rows[-1]["test_accuracy"]
        assert counter(samples, "fedge_devices_online", site="") == 3   # no FEDGE_SITE: one group, site ""
        assert all(dict(key)["device_class"] for key in samples["fedge_devices_online"])   # board or architecture
        # the percentiles of the online devices' latest profiles, as clients/ID.json holds them
        times = sorted(p["seconds"] for p in profiles.values())
        assert len(times) == 3
        assert counter(samples, "fedge_device_task_seconds", quantile="0.5") == pytest.approx(times[1])
        assert counter(samples, "fedge_device_task_seconds", quantile="0.99") == pytest.approx(
            times[1] + 0.98 * (times[2] - times[1]))
        assert counter(samples, "fedge_device_peak_memory_bytes", quantile="0.5") > 0
    assert "fedge_dp_epsilon" not in scrapes[-1][1]   # privacy is off: no epsilon at all, not a 0
    assert any(s.startswith("serving metrics at http://127.0.0.1:") for s in said)
    assert (result.out_dir / "metrics.jsonl").is_file()


def test_status_lists_the_devices_of_a_run_directory(watched_run, capsys):
    result, _, _ = watched_run
    assert main(["status", "--run-dir", str(result.out_dir), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["broker"] is None   # a run directory alone reads no broker
    assert status["run"]["finished"] and status["run"]["round"] == 2
    assert [d["client_id"] for d in status["devices"]] == ["sim-000", "sim-001", "sim-002"]
    for device in status["devices"]:
        assert device["last_round"] == 2 and device["recent_failures"] == 0 and device["recent_answers"] == 2
        assert device["task_seconds"] > 0 and device["peak_memory_bytes"] > 0 and device["device_class"]
    assert main(["status", "--run-dir", str(result.out_dir)]) == 0
    table = capsys.readouterr().out
    assert "3 devices" in table and "sim-002" in table and "finished" in table


def test_status_reads_the_retained_presences_on_the_broker(mosquitto, prefix, capsys):
    """Two devices online (one saying its class and site) and one whose last will said offline."""
    topics = Topics(prefix)
    publisher = MqttTransport(BrokerSettings(url=mosquitto, session_expiry=0), f"pub-{prefix}").connect()
    try:
        facts = {"arch": "aarch64", "board": "Raspberry Pi 4 Model B", "device_class": "pi4", "site": "lab-a"}
        for client, body in (("pi-01", PresenceBody("online", num_samples=120, device=facts)),
                             ("pi-02", PresenceBody("online", num_samples=80, device={"arch": "aarch64"})),
                             ("pi-03", PresenceBody("offline"))):
            publisher.publish(topics.client(client, "presence"), presence_payload(client, body), retain=True)
    finally:
        publisher.close()
    assert main(["status", "--broker", mosquitto, "--set", f"transport.prefix={prefix}", "--wait", "1",
                 "--json"]) == 0
    devices = {d["client_id"]: d for d in json.loads(capsys.readouterr().out)["devices"]}
    assert devices["pi-01"]["online"] and (devices["pi-01"]["device_class"], devices["pi-01"]["site"]) == ("pi4",
                                                                                                         "lab-a")
    assert devices["pi-01"]["samples"] == 120
    assert devices["pi-02"]["device_class"] == "aarch64" and devices["pi-02"]["site"] == ""
    assert devices["pi-03"]["online"] is False


def test_status_says_what_it_needs(capsys):
    assert main(["status"]) == 2
    assert "--broker" in capsys.readouterr().err
    assert main(["status", "--run-dir", "/nonexistent/run"]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_a_worker_serves_its_counters(mosquitto, prefix):
    """An aggregation worker on Mosquitto (a shared subscription needs a real MQTT 5 broker): what reaches its
    share of the result topics is counted, here a message that is no result at all."""
    config = load_config(None, [("transport", "broker", mosquitto), ("transport", "prefix", prefix)])
    said: list[str] = []
    stop = threading.Event()
    serving = threading.Thread(target=serve_worker, args=(config, "w0"),
                               kwargs={"stop": stop, "say": said.append, "metrics": ("127.0.0.1", 0)}, daemon=True)
    serving.start()
    device = MqttTransport(BrokerSettings(url=mosquitto, session_expiry=0), f"dev-{prefix}").connect()
    try:
        deadline = time.monotonic() + 10
        while not any("aggregation worker w0" in s for s in said) and time.monotonic() < deadline:
            time.sleep(0.05)   # subscribed once it says so
        url = re.search(r"serving metrics at (http://\S+)", "\n".join(said)).group(1)
        garbage = b"not a fedge message" * 10
        device.publish(Topics(prefix).client("dev-1", "result"), garbage)
        while counter(samples := scrape(url), "fedge_worker_results_total", outcome="unusable") < 1:
            assert time.monotonic() < deadline, samples
            time.sleep(0.05)
    finally:
        device.close()
        stop.set()
        serving.join(timeout=10)
    assert counter(samples, "fedge_worker_results_total", outcome="folded") == 0
    assert counter(samples, "fedge_worker_bytes_received_total") == len(garbage)
    assert counter(samples, "fedge_worker_info", worker_id="w0") == 1


def _exported_names() -> set[str]:
    """Every sample name a coordinator and a worker export, with a row that has every figure (and a run on an
    app's headline)."""
    telemetry = RunTelemetry(run_id="r", strategy="fedavg", model="cnn", headline="r2")
    telemetry.observe({"round": 1, "seconds": 1.0, "test_r2": 0.5, **{key: 0.5 for key in ROW_FIGURES}})
    worker = AggregationWorker(load_config(None, []), InprocHub().connect("w"), "w")
    names = set()
    for registry in (telemetry.registry, WorkerTelemetry(worker.worker_id, worker.stats).registry):
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            names.add(family.name)
            names |= {s.name for s in family.samples}
            if family.type == "histogram":
                names |= {f"{family.name}_{suffix}" for suffix in ("bucket", "sum", "count")}
            if family.type == "counter":
                names.add(f"{family.name}_total")
    return names | set(DEVICE_FIGURES) | {"fedge_devices_online"}


def test_the_dashboard_queries_only_metrics_the_coordinator_exports():
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 8
    queried = {name for expr in exprs for name in re.findall(r"\bfedge_[a-z_]+", expr)}
    assert queried - _exported_names() == set()
    for must in ("fedge_devices_online", "fedge_results_total", "fedge_round_seconds_sum", "fedge_bytes_total",
                 "fedge_test_accuracy", "fedge_device_step_seconds", "fedge_device_peak_memory_bytes",
                 "fedge_device_temperature_celsius"):
        assert must in queried, must
    for panel in dashboard["panels"]:
        if panel.get("targets"):
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_metrics_off_need_no_library_and_on_say_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)   # as on a machine without it
    config = load_config(None, [])
    with run_telemetry(config, "r", print) as telemetry:   # off: nothing imported, nothing served
        assert telemetry.observing(print) is print
    with pytest.raises(ConfigError, match="pip install prometheus-client"):
        load_config(None, [("metrics", "enabled", True)])
    with pytest.raises(MetricsError, match="pip install prometheus-client"):
        RunTelemetry(run_id="r", strategy="fedavg", model="cnn")


def test_a_busy_port_is_one_line_saying_what_to_change():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        telemetry = RunTelemetry(run_id="r", strategy="fedavg", model="cnn")
        with pytest.raises(MetricsError, match="--metrics-port"):
            MetricsServer(telemetry.registry, "127.0.0.1", taken.getsockname()[1])


def test_devices_are_grouped_and_quantiles_taken_over_those_online_that_report_the_figure(tmp_path):
    """A roster and a profile store fed as the coordinator feeds them: presences and answers' profiles."""
    roster, store = Roster(Absences(0), ThrottledLog(logging.getLogger("test"))), ProfileStore(tmp_path / "clients")
    for client, facts, temperature in (("a", {"device_class": "jetson", "site": "s"}, 40.0),
                                       ("b", {"device_class": "jetson", "site": "s"}, 50.0),
                                       ("c", {"device_class": "jetson", "site": "s"}, 60.0),
                                       ("d", {"device_class": "jetson", "site": "s"}, None),
                                       ("e", {"arch": "x86_64"}, None), ("z", {"arch": "x86_64"}, 99.0)):
        roster.on_presence(client, presence_payload(client, PresenceBody("online", device=facts)))
        profile = {"seconds": 1.0} if temperature is None else {"seconds": 1.0, "temperature_c": temperature}
        store.add(client, round=1, task_id=f"t-{client}", objective="train", round_seconds=1.0, profile=profile)
    roster.on_presence("z", presence_payload("z", PresenceBody("offline")))   # gone: its figures no longer count
    telemetry = RunTelemetry(run_id="r", strategy="fedavg", model="cnn")
    telemetry.watch(roster, store)
    samples = {}
    for family in text_string_to_metric_families(generate_latest(telemetry.registry).decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert samples[("fedge_devices_online", (("device_class", "jetson"), ("site", "s")))] == 4
    assert samples[("fedge_devices_online", (("device_class", "x86_64"), ("site", "")))] == 1
    assert QUANTILES == (0.5, 0.9, 0.99)
    assert samples[("fedge_device_temperature_celsius", (("quantile", "0.5"),))] == 50.0
    assert samples[("fedge_device_temperature_celsius", (("quantile", "0.9"),))] == pytest.approx(58.0)
    assert samples[("fedge_device_task_seconds", (("quantile", "0.99"),))] == 1.0
    assert not any(name == "fedge_device_step_seconds" for name, _ in samples)   # nobody reported it
