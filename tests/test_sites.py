"""Sites: site brokers bridged to the central broker by Mosquitto's own bridge, as `provision --sites` writes
them (TLS, passwords, ACLs), on loopback. Devices are EdgeClient threads on digits partitions; the
coordinator runs on the centre; a site aggregator is a real worker on its site broker."""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
import torch
from paho.mqtt.enums import CallbackAPIVersion

from coordinator.ops.broker_endpoint import free_port
from coordinator.ops.mosquitto import LocalMosquitto, mosquitto_binary
from coordinator.ops.provision import provision
from coordinator.ops.sites import Site
from coordinator.runtime.run import run_federated
from coordinator.runtime.worker import serve_worker
from edge_client.bundle import read_bundle
from edge_client.client import ClientSettings, EdgeClient
from edge_client.datasets import load_dataset
from edge_client.objectives import LocalData
from edge_client.partitions import client_split
from edge_client.wire.protocol import Topics
from edge_client.wire.transport import BrokerSettings, MqttTransport
from storage.checkpoint import load_checkpoint
from test_federation import config_for, read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from counting_link import CountingLink  # noqa: E402

pytestmark = pytest.mark.integration

DEVICES = ["a-1", "a-2", "b-1", "c-1"]   # a-* on site A, b-1 on site B, c-1 on the centre
PASSWORD_ENV = "FEDGE_SITES_TEST_PASSWORD"
# Results travel in 4 chunks of 64 KiB: a site's lone aggregator gets all of them and reassembles them.
RUN = dict(run__rounds=2, checkpoint__keep="all", clients__expected=len(DEVICES), clients__spawn=0,
           clients__round_timeout=20.0, clients__presence_timeout=20.0, clients__max_attempts=1,
           export__enabled=False, transport__max_message_bytes=64 * 1024)


class Deployment:
    """`provision --sites` into a temporary directory, its central broker and one broker per site started
    from the written configs (each site's bridge going through a CountingLink), all stopped by PID."""

    def __init__(self, root: Path, *, aggregator_a: bool) -> None:
        self.root = root
        self.centre_port = free_port()
        self.sites = [Site("site-a", "127.0.0.1", ("a-1", "a-2"), aggregator_a, free_port()),
                      Site("site-b", "127.0.0.1", ("b-1",), False, free_port())]
        self.out = root / "deploy"
        self.done = provision(self.out, hosts=["127.0.0.1"], devices=DEVICES, port=self.centre_port,
                              broker_dir=str(self.out / "broker"), listen="127.0.0.1", sites=self.sites)
        self.centre = LocalMosquitto(workdir=root / "centre", config=self.done.broker_conf.read_text(),
                                     port=self.centre_port)
        self.links: dict[str, CountingLink] = {}
        self.brokers: dict[str, LocalMosquitto] = {}

    def start(self) -> "Deployment":
        self.centre.start()
        for site in self.sites:
            link = self.links[site.name] = CountingLink(self.centre_port).start()
            site_dir = self.done.sites[site.name]
            conf = (site_dir / "fedge.conf").read_text()
            conf = conf.replace(str(self.out / "broker"), str(site_dir))   # installed in its own directory here
            conf = conf.replace(f"address 127.0.0.1:{self.centre_port}", f"address 127.0.0.1:{link.port}")
            self.brokers[site.name] = LocalMosquitto(workdir=self.root / site.name, config=conf, port=site.port)
            self.brokers[site.name].start()
        return self

    def stop(self) -> None:
        for broker in self.brokers.values():
            broker.stop()
        for link in self.links.values():
            link.cut()
        self.centre.stop()

    def settings(self, user: str, url: str | None = None) -> BrokerSettings:
        """A device's (or the coordinator's) broker settings from what was provisioned."""
        if user == "coordinator":
            return BrokerSettings(url=f"mqtts://127.0.0.1:{self.centre_port}", username=user,
                                  password=(self.out / "coordinator" / "password").read_text().strip(),
                                  ca_file=str(self.out / "ca.crt"), connect_timeout=5)
        bundle = read_bundle(self.out / "devices" / f"{user}.toml")
        return BrokerSettings(url=url or bundle.broker, username=user, password=bundle.password,
                              ca_data=bundle.ca_cert, connect_timeout=5)

    def run_config(self, out: Path):
        """The test run's config with the coordinator's provisioned [transport] and [workers] (its password
        in PASSWORD_ENV)."""
        aggregators = sum(site.aggregator for site in self.sites)
        return config_for(out, transport__broker=f"mqtts://127.0.0.1:{self.centre_port}",
                          transport__username="coordinator", transport__password_env=PASSWORD_ENV,
                          transport__ca_file=str(self.out / "ca.crt"), workers__count=aggregators,
                          workers__direct_results=bool(aggregators), **RUN)


class Devices:
    """One EdgeClient thread per device on partition i of 4 of digits, each on the broker ``settings`` names."""

    def __init__(self, settings: dict[str, BrokerSettings], prefix: str = "fedge") -> None:
        dataset = load_dataset("digits")
        self.stop = threading.Event()
        self.transports, self.threads = [], []
        for i, device in enumerate(DEVICES):
            client_settings = ClientSettings(client_id=device, topics=Topics(prefix),
                                             max_message_bytes=RUN["transport__max_message_bytes"])
            transport = MqttTransport(settings[device], device, will=EdgeClient.will(client_settings)).connect()
            x, y = client_split(dataset, "iid", i, len(DEVICES), seed=0)
            client = EdgeClient(client_settings, transport, LocalData(torch.from_numpy(x), torch.from_numpy(y)))
            self.transports.append(transport)
            self.threads.append(threading.Thread(target=client.run, args=(self.stop,), daemon=True))
            self.threads[-1].start()

    def close(self) -> None:
        self.stop.set()
        for thread, transport in zip(self.threads, self.transports):
            thread.join(10)
            transport.close()


class Aggregator:
    """Site A's aggregator: the real worker, from its provisioned bundle, on a thread."""

    def __init__(self, deployment: Deployment, config) -> None:
        self.stop, self.stats = threading.Event(), {}
        bundle = read_bundle(deployment.done.sites["site-a"] / "aggregator.toml")
        transport = dataclasses.replace(config.transport, broker=bundle.broker, username=bundle.username,
                                        ca_file="")
        config = dataclasses.replace(config, transport=transport)
        self.thread = threading.Thread(target=lambda: self.stats.update(
            serve_worker(config, bundle.client_id, stop=self.stop, say=lambda s: None, bundle=bundle)), daemon=True)
        self.thread.start()

    def close(self) -> dict[str, int]:
        self.stop.set()
        self.thread.join(15)
        return self.stats


@pytest.fixture(scope="module")
def flat_run(tmp_path_factory, mosquitto) -> Path:
    """The reference: the same devices, data and seed, all on one anonymous broker."""
    out = tmp_path_factory.mktemp("flat") / "run"
    prefix = f"flat-{os.getpid()}"
    devices = Devices({d: BrokerSettings(url=mosquitto) for d in DEVICES}, prefix)
    try:
        run_federated(config_for(out, transport__broker=mosquitto, transport__prefix=prefix, **RUN),
                      say=lambda s: None)
    finally:
        devices.close()
    return out


@pytest.fixture
def deployment(tmp_path, request, monkeypatch):
    if mosquitto_binary() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    d = Deployment(tmp_path, aggregator_a=getattr(request, "param", False)).start()
    monkeypatch.setenv(PASSWORD_ENV, (d.out / "coordinator" / "password").read_text().strip())
    yield d
    d.stop()


def _run_on_sites(deployment: Deployment, out: Path, on_progress=None) -> dict[str, int]:
    config = deployment.run_config(out)
    devices = Devices({d: deployment.settings(d) for d in DEVICES})
    aggregator = Aggregator(deployment, config) if config.workers.count else None
    try:
        run_federated(config, say=lambda s: None, on_progress=on_progress)
    finally:
        stats = aggregator.close() if aggregator is not None else {}
        devices.close()
    return stats


def _same_models(a: Path, b: Path) -> None:
    for round in (1, 2):
        name = f"round_{round:04d}.safetensors"
        ca, _ = load_checkpoint(a / "checkpoints" / name)
        cb, _ = load_checkpoint(b / "checkpoints" / name)
        for key in ca.params:
            assert torch.allclose(ca.params[key], cb.params[key], rtol=1e-5, atol=1e-6), (round, key)


@pytest.mark.parametrize("deployment", [False, True], ids=["results-up-the-bridge", "site-aggregator"],
                         indirect=True)
def test_a_run_over_two_bridged_sites_gives_the_flat_runs_model(deployment, flat_run, tmp_path):
    """Two site brokers bridged to the centre, a device on the centre: every round's model equals the flat
    run's. With site A's aggregator its devices' results stay on the site (chunked, reassembled by the lone
    aggregator) and the coordinator takes site B's and the central device's results directly."""
    stats = _run_on_sites(deployment, tmp_path / "sites")
    _same_models(flat_run, tmp_path / "sites")
    for row in read_metrics(tmp_path / "sites")[1:]:
        assert row["selected"] == row["returned"] == len(DEVICES) and "worker_lost" not in row
    if deployment.sites[0].aggregator:
        # a-1's and a-2's results, two rounds; at least one partial a round (a grant read after the flush
        # goes up in a partial of its own)
        assert stats["folded"] == 2 * 2 and stats["partials"] >= 2 and stats["unusable"] == 0, stats


@pytest.mark.parametrize("deployment", [True], ids=["site-aggregator"], indirect=True)
def test_a_site_uplink_cut_mid_round_loses_and_doubles_nothing(deployment, flat_run, tmp_path):
    """Site A's uplink is cut as round 1's tasks go out and restored 2 s later: the central broker queues
    the tasks, verdicts and manifest for the bridge's session, the site broker queues the claims and the
    partial; the round completes within its deadline with every device counted once."""
    link, cut = deployment.links["site-a"], threading.Event()

    def on_progress(info: dict) -> None:
        if info.get("kind") == "exchange" and info["round"] == 1 and not cut.is_set():
            cut.set()
            link.cut()
            threading.Timer(2.0, link.restore).start()

    _run_on_sites(deployment, tmp_path / "cut", on_progress)
    assert cut.is_set() and link.connections >= 2   # the bridge came back over a new connection
    rows = read_metrics(tmp_path / "cut")
    assert rows[1]["seconds"] > 2.0 and rows[1]["seconds"] < RUN["clients__round_timeout"]
    for row in rows[1:]:
        assert row["selected"] == row["returned"] == len(DEVICES) and "worker_lost" not in row
        assert row["late"] == row["rejected"] == 0
    _same_models(flat_run, tmp_path / "cut")


def _client(deployment: Deployment, user: str, password: str) -> tuple[mqtt.Client, list, dict]:
    """A raw MQTT 5 client on the central broker, to read the broker's reason codes."""
    got, codes = [], {}
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=user, protocol=mqtt.MQTTv5)
    c.username_pw_set(user, password)
    c.tls_set(ca_certs=str(deployment.out / "ca.crt"))
    c.on_message = lambda cl, u, m: got.append(m.topic)
    c.on_subscribe = lambda cl, u, mid, reasons, p: codes.__setitem__(mid, [r.value for r in reasons])
    c.on_publish = lambda cl, u, mid, reason, p: codes.__setitem__(mid, reason.value)
    c.connect("127.0.0.1", deployment.centre_port)
    c.loop_start()
    return c, got, codes


def _wait_for(codes: dict, mid: int) -> object:
    deadline = time.monotonic() + 5
    while mid not in codes and time.monotonic() < deadline:
        time.sleep(0.02)
    return codes.get(mid)


def test_a_site_bridge_user_can_carry_only_its_own_sites_topics(deployment):
    """The provisioned bridge of site A carries a-1's presence up and its task down (the site broker's own
    ACL does not stop the bridge); logged in as site B's bridge, the central broker refuses a-1's topics
    and the central device's (publishes answered with MQTT 5 reason 0x87, nothing delivered on subscriptions)
    and allows b-1's."""
    centre = MqttTransport(deployment.settings("coordinator"), "coordinator").connect()
    a1 = MqttTransport(deployment.settings("a-1"), "a-1").connect()
    try:
        centre.subscribe("fedge/clients/+/presence")
        a1.subscribe("fedge/clients/a-1/task")
        a1.publish("fedge/clients/a-1/presence", b"a-1 online", retain=True)
        got = centre.get(5.0)
        assert got is not None and (got.topic, got.payload) == ("fedge/clients/a-1/presence", b"a-1 online")
        centre.publish("fedge/clients/a-1/task", b"task for a-1")
        got = a1.get(5.0)
        assert got is not None and got.payload == b"task for a-1"

        deployment.brokers["site-b"].stop()   # its bridge would be knocked off by our login as bridge-site-b
        password = [line.split()[1] for line in (deployment.done.sites["site-b"] / "fedge.conf").read_text()
                    .splitlines() if line.startswith("remote_password ")][0]
        spy, seen, codes = _client(deployment, "bridge-site-b", password)
        try:
            _, mid = spy.subscribe([("fedge/clients/a-1/task", 1), ("fedge/clients/c-1/status", 1),
                                    ("fedge/clients/b-1/task", 1)])
            # Mosquitto 2.0.11 grants a subscription and checks read rights on each delivery instead
            assert _wait_for(codes, mid) is not None
            for topic in ("fedge/clients/a-1/presence", "fedge/clients/a-1/result", "fedge/coordinator/model"):
                info = spy.publish(topic, b"forged", qos=1)
                assert _wait_for(codes, info.mid) == 0x87, topic
            info = spy.publish("fedge/clients/b-1/presence", b"b-1 online", qos=1)
            assert _wait_for(codes, info.mid) == 0
            centre.publish("fedge/clients/a-1/task", b"not for site B")
            centre.publish("fedge/clients/c-1/status", b"not for site B")
            centre.publish("fedge/clients/b-1/task", b"for b-1")
            deadline = time.monotonic() + 5
            while "fedge/clients/b-1/task" not in seen and time.monotonic() < deadline:
                time.sleep(0.02)
            # Mosquitto passes one connection's publishes on in the order it read them: a-1's task and c-1's
            # status, published before b-1's task, would have come before it.
            assert seen == ["fedge/clients/b-1/task"]
            arrived = []
            while (msg := centre.get(1.0)) is not None:
                arrived.append((msg.topic, msg.payload))
            assert arrived == [("fedge/clients/b-1/presence", b"b-1 online")]
        finally:
            spy.loop_stop()
            spy.disconnect()
    finally:
        centre.close()
        a1.close()


def test_site_files_are_secret_and_a_site_device_rotates_in_its_sites_password_file(tmp_path):
    """The bridge's password makes a site's fedge.conf a secret; a site device's password lives in its
    site's password file; a site device that was never provisioned is refused before anything is written."""
    from coordinator.ops.provision import ProvisionError, rotate_password

    sites = [Site("site-a", "a.lan", ("a-1", "a-2"), True)]
    done = provision(tmp_path / "d", hosts=["centre.lan"], devices=DEVICES, sites=sites)
    site = done.sites["site-a"]
    for secret in ("fedge.conf", "fedge.passwd", "server.key", "aggregator.toml"):
        assert (site / secret).stat().st_mode & 0o777 == 0o600, secret
    assert read_bundle(done.bundles["a-1"]).broker == "mqtts://a.lan:8883"
    assert read_bundle(done.bundles["c-1"]).broker == "mqtts://centre.lan:8883"
    central = (done.out_dir / "broker" / "fedge.passwd").read_text()
    assert "bridge-site-a:" in central and "a-1:" not in central and "agg-site-a:" not in central
    before = (site / "fedge.passwd").read_text()
    assert rotate_password(done.out_dir, "a-1") == done.bundles["a-1"]
    assert (site / "fedge.passwd").read_text() != before
    with pytest.raises(ProvisionError, match="provision the deployment again"):
        rotate_password(done.out_dir, "bridge-site-a")
    with pytest.raises(ProvisionError, match=r"devices \['a-3'\] are not provisioned"):
        provision(tmp_path / "e", hosts=["centre.lan"], devices=DEVICES,
                  sites=[Site("site-a", "a.lan", ("a-1", "a-3"))])
    assert not (tmp_path / "e").exists()
