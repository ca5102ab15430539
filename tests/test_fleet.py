"""The fleet load generator end to end on a small fleet: every selected device's result counts.

Ten stand-in devices in one process against the real coordinator and a Mosquitto of the
generator's own, two rounds with short think times; the JSON must hold every figure the
sweep reports, and the devices' records must agree with the coordinator's rows.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from coordinator.ops.mosquitto import mosquitto_binary
from edge_client.data import FASHION_MNIST_DIR

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import fleet  # noqa: E402

FIELDS = ("fleet", "per_round", "codec_up", "rounds", "complete", "overhead_s", "overhead_s_max",
          "seconds_per_round", "coordinator_cpu_s_per_round", "coordinator_peak_rss_mb",
          "coordinator_peak_rss_mb_rounds", "broker_peak_rss_mb", "broker_rss_mb_before_round_1",
          "device_cpu_s_per_round", "messages_per_round", "mb_per_round", "coordinator_mb_per_round", "selected",
          "returned", "lost", "late", "rejected", "inbox_dropped", "resends", "unacked", "per_round_detail")


@pytest.fixture(scope="module")
def needs_broker_and_data() -> None:
    if mosquitto_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("mosquitto is not installed; `make test` installs it with apt when run as root")
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    if not Path(FASHION_MNIST_DIR).is_dir():
        pytest.skip("Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)")


def test_think_time_specs_parse_and_draw_in_range():
    import random

    rng = random.Random(0)
    uniform = fleet.Think.parse("uniform:0.5:1.5")
    assert all(0.5 <= uniform.draw(rng) <= 1.5 for _ in range(100))
    assert fleet.Think.parse("fixed:2").draw(rng) == 2.0
    draws = sorted(fleet.Think.parse("lognormal:2:0.5").draw(rng) for _ in range(2001))
    assert 1.8 < draws[1000] < 2.2   # the median is the median
    for bad in ("lognormal:2", "gamma:1:1", "uniform:2:1", "fixed:-1", "lognormal:x:1"):
        with pytest.raises(Exception):
            fleet.Think.parse(bad)


def test_cells_cover_each_share_and_codec_once():
    args = fleet.parse_args(["--fleet", "10,100", "--per-round", "tenth,all", "--codec-up", "fp32,int8",
                             "--skip-cell", "100/100/int8"])
    keys = [cell.key for cell in fleet.cells_of(args)]
    assert keys == ["10/1/fp32", "10/1/int8", "10/10/fp32", "10/10/int8", "100/10/fp32", "100/10/int8",
                    "100/100/fp32"]


def test_ten_devices_every_result_counted(tmp_path: Path, needs_broker_and_data: None) -> None:
    out, png = tmp_path / "fleet.json", tmp_path / "fleet.png"
    assert fleet.main(["--fleet", "10", "--per-round", "all", "--processes", "1", "--rounds", "2",
                       "--think", "uniform:0.1:0.4", "--out", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    assert set(report["definitions"]) >= {"overhead_s", "coordinator_cpu_s_per_round", "messages_per_round"}
    (cell,) = report["cells"]
    assert "failure" not in cell, cell.get("failure")
    for name in FIELDS:
        assert name in cell, name
    assert cell["complete"] and cell["fleet"] == 10 and cell["per_round"] == 10 and cell["codec_up"] == "fp32"
    assert [p["round"] for p in cell["per_round_detail"]] == [1, 2]
    for p in cell["per_round_detail"]:
        assert p["selected"] == p["returned"] == 10, p
        assert p["rejected"] == p["failed"] == p["late"] == 0 and p["unacked"] == 0, p
        assert 0.1 <= p["slowest_think_s"] <= 0.4 and p["seconds"] > p["slowest_think_s"]
        assert p["overhead_s"] == pytest.approx(p["seconds"] - p["slowest_think_s"])
        assert p["device_messages_out"] >= 10 and p["device_bytes_out"] >= p["coordinator_bytes_up"] > 10 * 1_000_000
        assert p["coordinator_cpu_s"] > 0
    assert cell["lost"] == 0 and cell["coordinator_peak_rss_mb"] > 0 and cell["broker_peak_rss_mb"] > 0
    assert png.stat().st_size > 0
    assert "| 10 | 10 | `fp32` |" in fleet.table(report["cells"])


def test_a_counting_link_forwards_both_ways_and_dates_its_counts():
    """The uplink forwarder of a bench site: what it carries arrives intact, each way is counted apart,
    and ``between`` gives the bytes inside a window of wall time."""
    import socket
    import threading
    import time

    from counting_link import CountingLink

    server = socket.create_server(("127.0.0.1", 0))

    def echo_twice() -> None:   # the "centre": answers every byte with two
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data * 2)

    threading.Thread(target=echo_twice, daemon=True).start()
    with CountingLink(server.getsockname()[1]) as link, socket.create_connection(("127.0.0.1", link.port)) as site:
        site.sendall(b"x" * 1000)
        got = b""
        while len(got) < 2000:
            got += site.recv(65536)
        middle = time.time()
        time.sleep(0.01)
        site.sendall(b"y" * 10)
        while len(got) < 2020:
            got += site.recv(65536)
        assert got == b"x" * 2000 + b"y" * 20
        assert (link.up, link.down, link.connections) == (1010, 2020, 1)
        assert link.between(0, middle) == (1000, 2000)
        assert link.between(middle, time.time()) == (10, 20)
    server.close()


def test_a_bench_site_is_bridged_as_provisioning_writes_it():
    """A bench site broker's bridge: provisioning's section over bridged_topics, MQTT 3.1.1 with a kept
    session, without TLS, to the forwarder's port; with an aggregator its devices' results stay on the site."""
    args = fleet.parse_args(["--fleet", "10", "--per-round", "all", "--sites", "0,3", "--site-aggregators", "off,on"])
    cells = fleet.cells_of(args)
    assert [c.key for c in cells] == ["10/10/fp32", "10/10/fp32/sites=3", "10/10/fp32/sites=3+aggregators"]
    sites = fleet.bench_sites(cells[2], [f"dev-{i}" for i in range(10)])
    assert [s.devices for s in sites][0] == ("dev-0", "dev-3", "dev-6", "dev-9")
    conf = fleet.site_broker_config(sites[0], 4321, Path("/unused"))
    assert "address 127.0.0.1:4321\n" in conf and "bridge_protocol_version mqttv311\n" in conf
    assert "cleansession false\n" in conf and "bridge_cafile" not in conf
    assert "topic fleet/clients/dev-3/task/# in 1\n" in conf and "topic fleet/clients/dev-1/task/#" not in conf
    assert "topic fleet/workers/agg-site-0/partial/# out 1\n" in conf and "/result/#" not in conf
    plain = fleet.site_broker_config(fleet.bench_sites(cells[1], [f"dev-{i}" for i in range(10)])[0], 4321, Path("/x"))
    assert "topic fleet/clients/dev-3/result/# out 1\n" in plain and "agg-site-0" not in plain
    # cells written before sites existed read as the flat topology
    old = {"fleet": 10, "per_round": 10, "codec_up": "fp32"}
    assert fleet.Cell.of(old).key == "10/10/fp32" and fleet.Cell.of(old).topology == ""
    with pytest.raises(SystemExit):
        fleet.parse_args(["--sites", "2", "--site-aggregators", "on", "--workers", "2"])
