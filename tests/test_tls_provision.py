"""A provisioned deployment on a real Mosquitto over TLS: who may log in, who may touch which topics,
what a device with the wrong CA or host name is told, and a whole run with device bundles.

The broker runs the configuration ``fedge-coordinator provision`` wrote, on a free loopback
port, plus three lines for a test machine: logs on stderr, and ``user root`` when the tests
run as root (Mosquitto would otherwise drop to the user ``mosquitto``, which cannot read
pytest's private temporary directories).
"""

from __future__ import annotations

import getpass
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from coordinator.ops.broker import free_port
from coordinator.ui.cli import main as coordinator_main
from coordinator.config import ConfigError, load_config
from coordinator.ops.mosquitto import LocalMosquitto, mosquitto_binary
from coordinator.ops.provision import COORDINATOR_USER, password_line, provision, rotate_password
from coordinator.runtime.run import run_federated
from edge_client.bundle import read_bundle
from edge_client.device_protocol import presence_payload
from edge_client.wire.bodies import PresenceBody
from edge_client.wire.transport import (BrokerSettings, BrokerUrlError, MqttTransport, TlsError, TransportError,
                                        parse_broker_address)

PREFIX = "fedge"
ENV = {k: v for k, v in os.environ.items() if not k.startswith("FEDGE_")} | {"OMP_WAIT_POLICY": "PASSIVE"}


class ProvisionedBroker:
    """A provisioning directory and a Mosquitto started from its fedge.conf, stopped by PID."""

    def __init__(self, root: Path, devices: int = 3, workers: int = 2) -> None:
        self.port = free_port()
        self.root = root
        self.out = root / "deploy"
        self.done = provision(self.out, hosts=["127.0.0.1"], devices=[f"device-{i:03d}" for i in range(1, devices + 1)],
                              port=self.port, prefix=PREFIX, broker_dir=str(root / "deploy" / "broker"),
                              listen="127.0.0.1", workers=workers)
        self.url = f"mqtts://127.0.0.1:{self.port}"
        self.ca = str(self.out / "ca.crt")
        self.mosquitto = LocalMosquitto(workdir=root, config=self.done.broker_conf.read_text(), port=self.port)

    def start(self) -> None:
        self.mosquitto.start()

    def stop(self) -> None:
        self.mosquitto.stop()

    def password(self, user: str) -> str:
        if user == COORDINATOR_USER:
            return (self.out / "coordinator" / "password").read_text().strip()
        if user in self.done.workers:
            return self.done.workers[user].read_text().strip()
        return read_bundle(self.out / "devices" / f"{user}.toml").password

    def transport(self, user: str, *, password: str | None = None, protocol: str = "5") -> MqttTransport:
        settings = BrokerSettings(url=self.url, username=user, password=password or self.password(user),
                                  protocol=protocol, ca_file=self.ca, connect_timeout=5)
        return MqttTransport(settings, user).connect()


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> ProvisionedBroker:
    if mosquitto_binary() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    deployment = ProvisionedBroker(tmp_path_factory.mktemp("tls"))
    deployment.start()
    yield deployment
    deployment.stop()


@pytest.fixture
def own_broker(tmp_path: Path) -> ProvisionedBroker:
    """A deployment of its own, for tests that leave sessions behind: with use_username_as_clientid the
    broker keeps each user's persistent session (subscriptions included) for that user's next login."""
    if mosquitto_binary() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    deployment = ProvisionedBroker(tmp_path)
    deployment.start()
    yield deployment
    deployment.stop()


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("data") / "tiny.npz"
    np.savez(path, x=np.zeros((8, 1, 8, 8), np.float32), y=np.arange(8) % 2)
    return f"npz:{path}"


def _drain(transport: MqttTransport, seconds: float) -> list[str]:
    topics, deadline = [], time.monotonic() + seconds
    while (msg := transport.get(max(0.0, deadline - time.monotonic()))) is not None:
        topics.append(msg.topic)
    return topics


# -- files ---------------------------------------------------------------------------------------------

def test_secrets_are_0600_and_the_broker_files_are_consistent(broker):
    out = broker.out
    for secret in [out / "ca.key", out / "broker" / "server.key", out / "broker" / "fedge.passwd",
                   out / "coordinator" / "password", *sorted((out / "devices").glob("*.toml")),
                   *sorted((out / "workers").glob("*.password"))]:
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    conf = (out / "broker" / "fedge.conf").read_text()
    for line in ("allow_anonymous false", "use_username_as_clientid true", "max_queued_messages 100000",
                 f"listener {broker.port} 127.0.0.1", "tls_version tlsv1.2"):
        assert line in conf
    bundle = read_bundle(out / "devices" / "device-002.toml")
    assert (bundle.broker, bundle.client_id, bundle.username, bundle.prefix) == (
        broker.url, "device-002", "device-002", PREFIX)
    assert bundle.ca_cert == (out / "ca.crt").read_text() and len(bundle.password) >= 24
    users = [line.split(":")[0] for line in (out / "broker" / "fedge.passwd").read_text().splitlines()]
    assert users == [COORDINATOR_USER, "monitor", "device-001", "device-002", "device-003", "worker-1", "worker-2"]
    snippet = load_config(out / "coordinator" / "coordinator.toml").transport
    assert (snippet.broker, snippet.username, snippet.ca_file) == (broker.url, COORDINATOR_USER, broker.ca)


def test_the_password_file_line_is_mosquittos_pbkdf2_format():
    line = password_line("alice", "secret", salt=bytes(range(12)))
    assert line.startswith("alice:$7$101$AAECAwQFBgcICQoL$") and len(line.split("$")[-1]) == 88


def test_provision_refuses_a_used_directory_and_bad_names(tmp_path, capsys):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    assert coordinator_main(["provision", "--devices", "1", "--broker-host", "h", "--out", str(tmp_path / "used")]) == 2
    assert "is not empty" in capsys.readouterr().err
    names = tmp_path / "names.txt"
    names.write_text("pi-01\n# a comment\npi 02\n")
    assert coordinator_main(["provision", "--names", str(names), "--broker-host", "h", "--out", str(tmp_path / "n")]) == 2
    assert "bad device ids ['pi 02']" in capsys.readouterr().err


# -- who may log in, who may touch what ----------------------------------------------------------------

def test_anonymous_and_wrong_password_logins_are_refused(broker):
    for settings in (BrokerSettings(url=broker.url, ca_file=broker.ca, protocol="5", connect_timeout=5),
                     BrokerSettings(url=broker.url, ca_file=broker.ca, username="device-001", password="wrong",
                                    protocol="3.1.1", connect_timeout=5)):
        with pytest.raises(TransportError) as refused:
            MqttTransport(settings, "device-001").connect()
        assert not isinstance(refused.value, TlsError)
        assert "refused" in str(refused.value)


def test_a_device_reaches_only_its_own_topics(own_broker):
    broker = own_broker
    coordinator = broker.transport(COORDINATOR_USER)
    one, two = broker.transport("device-001"), broker.transport("device-002")
    try:
        coordinator.subscribe(f"{PREFIX}/#")
        one.subscribe(f"{PREFIX}/clients/device-002/#")   # another device's tasks
        one.subscribe(f"{PREFIX}/clients/device-001/task")
        two.subscribe(f"{PREFIX}/clients/device-002/task")
        coordinator.publish(f"{PREFIX}/clients/device-002/task", b"for two")
        coordinator.publish(f"{PREFIX}/clients/device-001/task", b"for one")
        forbidden = [f"{PREFIX}/clients/device-002/result", f"{PREFIX}/clients/device-002/presence",
                     f"{PREFIX}/clients/device-001/task", f"{PREFIX}/clients/device-001/status",
                     f"{PREFIX}/coordinator/status", f"{PREFIX}/coordinator/model"]
        for topic in forbidden:
            one.publish(topic, b"forged")
        one.publish(f"{PREFIX}/clients/device-001/result", b"mine")
        got_one, got_two, got_coordinator = _drain(one, 1.5), _drain(two, 0.2), _drain(coordinator, 0.2)
        assert got_one == [f"{PREFIX}/clients/device-001/task"]
        assert got_two == [f"{PREFIX}/clients/device-002/task"]
        from_one = [t for t in got_coordinator if t not in (f"{PREFIX}/clients/device-002/task",
                                                            f"{PREFIX}/clients/device-001/task")]
        assert from_one == [f"{PREFIX}/clients/device-001/result"]
        assert one.denied == set(forbidden)   # MQTT 5: each refused publish got PUBACK 135
    finally:
        for t in (coordinator, one, two):
            t.close()


# -- TLS failures are one line, at once --------------------------------------------------------------

def _client_once(broker: ProvisionedBroker, data: str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    bundle = broker.out / "devices" / "device-003.toml"
    cmd = [sys.executable, "-m", "edge_client.cli", "run", "--bundle", str(bundle), "--data", data,
           "--state-dir", str(tmp_path / "state"), "--torch-threads", "1", *extra]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=60)


def test_a_client_with_another_ca_stops_with_one_line(broker, tiny_data, tmp_path):
    other = provision(tmp_path / "other", hosts=["127.0.0.1"], devices=["x"], port=broker.port)
    started = time.monotonic()
    done = _client_once(broker, tiny_data, tmp_path, "--ca-file", str(other.out_dir / "ca.crt"))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not signed by the CA in" in lines[0] and "--ca-file" in lines[0], done.stderr
    assert time.monotonic() - started < 30   # no retry loop


def test_a_wrong_host_name_and_a_missing_ca_file_are_one_line(broker, tiny_data, tmp_path):
    done = _client_once(broker, tiny_data, tmp_path, "--broker", f"mqtts://localhost:{broker.port}")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "does not name 'localhost'" in lines[0], done.stderr
    done = _client_once(broker, tiny_data, tmp_path, "--ca-file", str(tmp_path / "missing.crt"))
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"fedge-client: CA file {tmp_path / 'missing.crt'} does not exist: give the path of a PEM file"]


def test_mqtt_at_the_tls_port_is_told_to_use_mqtts(broker, tiny_data, tmp_path):
    plain_url = f"mqtt://127.0.0.1:{broker.port}"
    with pytest.raises(TlsError, match=f"^{plain_url}: the broker answered with TLS; use mqtts://127.0.0.1:"
                                       f"{broker.port} "):
        MqttTransport(BrokerSettings(url=plain_url, connect_timeout=5), "device-001").connect()
    started = time.monotonic()   # the device stops at once instead of retrying a login that is not the problem
    done = _client_once(broker, tiny_data, tmp_path, "--broker", plain_url)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and f"use mqtts://127.0.0.1:{broker.port}" in lines[0], done.stderr
    assert time.monotonic() - started < 30


def test_mqtts_at_a_plain_port_is_told_to_use_mqtt(broker, mosquitto, tiny_data, tmp_path):
    port = parse_broker_address(mosquitto).port
    tls_url = f"mqtts://127.0.0.1:{port}"
    with pytest.raises(TlsError, match=f"^{tls_url}: the port speaks plain MQTT, not TLS; use mqtt://127.0.0.1:{port},"):
        MqttTransport(BrokerSettings(url=tls_url, ca_file=broker.ca, connect_timeout=5), "device-001").connect()
    done = _client_once(broker, tiny_data, tmp_path, "--broker", tls_url)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and f"use mqtt://127.0.0.1:{port}" in lines[0], done.stderr


def test_a_login_without_the_password_names_the_user_and_the_empty_variable(broker, tmp_path, monkeypatch, capsys):
    settings = BrokerSettings(url=broker.url, ca_file=broker.ca, username="device-001", connect_timeout=5)
    with pytest.raises(TransportError) as refused:
        MqttTransport(settings, "device-001").connect()
    assert str(refused.value) == ("the broker refused user 'device-001': not authorized, and FEDGE_MQTT_PASSWORD "
                                  "is empty; export the user's password")
    wrong = BrokerSettings(url=broker.url, ca_file=broker.ca, username="device-001", password="wrong",
                           connect_timeout=5, password_source="the bundle d.toml")
    with pytest.raises(TransportError, match="refused user 'device-001': not authorized; check the password in "
                                             "the bundle d.toml"):
        MqttTransport(wrong, "device-001").connect()
    device = subprocess.Popen([sys.executable, "-m", "edge_client.cli", "run", "--broker", broker.url, "--ca-file",
                               broker.ca, "--username", "device-001", "--client-id", "device-001", "--data", "digits",
                               "--state-dir", str(tmp_path / "state")], env=ENV, stderr=subprocess.PIPE, text=True)
    try:   # a device retries (the password may yet be set on the broker), saying why each time
        first = device.stderr.readline()
    finally:
        device.terminate()
        device.communicate(timeout=30)
    assert "the broker refused user 'device-001': not authorized, and FEDGE_MQTT_PASSWORD is empty; export the " \
           "user's password; retrying in 1 s" in first, first
    monkeypatch.delenv("FEDGE_MQTT_PASSWORD", raising=False)   # the coordinator, resuming without its password
    out = tmp_path / "run"
    code = coordinator_main(["run", "--broker", broker.url, "--set", f"transport.ca_file={broker.ca}",
                             "--set", "transport.username=coordinator", "--data", "digits", "--out", str(out)])
    said = capsys.readouterr().out
    assert code == 2 and "the broker refused user 'coordinator': not authorized, and FEDGE_MQTT_PASSWORD is " \
                         "empty; export the user's password" in " ".join(said.split()), said


def test_tls_and_plain_urls_are_parsed_by_one_parser():
    assert parse_broker_address("mqtts://broker.lan").port == 8883 and parse_broker_address("mqtts://h:1").tls
    assert not parse_broker_address("mqtt://h").tls
    with pytest.raises(BrokerUrlError, match="plain MQTT: use mqtts://h:PORT"):
        BrokerSettings(url="mqtt://h:1883", ca_file="ca.crt")
    with pytest.raises(ConfigError, match="transport.ca_file need a TLS broker"):
        load_config(None, [("transport", "broker", "mqtt://h:1883"), ("transport", "ca_file", "ca.crt")])


def test_the_coordinator_names_an_unknown_ca_in_one_line(broker, tmp_path, capsys):
    other = provision(tmp_path / "other", hosts=["127.0.0.1"], devices=["x"], port=broker.port)
    out = tmp_path / "run"
    code = coordinator_main(["run", "--broker", broker.url, "--set", f"transport.ca_file={other.out_dir / 'ca.crt'}",
                             "--set", "transport.username=coordinator", "--out", str(out)])
    assert code == 2
    assert "is not signed by the CA in" in capsys.readouterr().out


# -- runs over TLS with bundles --------------------------------------------------------------------------

def _device(broker: ProvisionedBroker, device: str, index: int, tmp_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "edge_client.cli", "run", "--bundle", str(broker.out / "devices" / f"{device}.toml"),
           "--data", "digits", "--partition", "iid", "--partition-index", str(index), "--num-partitions", "2",
           "--state-dir", str(tmp_path / device), "--torch-threads", "1", "--exit-after-run"]
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _run_config(broker: ProvisionedBroker, out: Path, **sets):
    base = {"run__rounds": 2, "run__out": str(out), "model__name": "cnn", "data__eval": "digits",
            "clients__expected": 2, "clients__round_timeout": 60.0, "clients__presence_timeout": 60.0,
            "transport__broker": broker.url, "transport__username": COORDINATOR_USER,
            "transport__ca_file": broker.ca, "transport__prefix": PREFIX, "export__enabled": False}
    base.update(sets)
    return load_config(None, [(*key.split("__", 1), value) for key, value in base.items()])


def test_a_run_over_tls_with_two_device_bundles(broker, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDGE_MQTT_PASSWORD", broker.password(COORDINATOR_USER))
    devices = [_device(broker, f"device-00{i + 1}", i, tmp_path) for i in range(2)]
    try:
        result = run_federated(_run_config(broker, tmp_path / "run"), say=lambda s: None)
        for proc in devices:
            _, err = proc.communicate(timeout=30)
            assert proc.returncode == 0, err
    finally:
        for proc in devices:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    rows = [json.loads(line) for line in (result.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert all((r["selected"], r["returned"], r["rejected"]) == (2, 2, 0) for r in rows[1:])
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"] + 0.2
    assert sorted(p.stem for p in (result.out_dir / "clients").glob("*.json")) == ["device-001", "device-002"]


def test_spawned_clients_log_in_with_the_provisioned_bundles(broker, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDGE_MQTT_PASSWORD", broker.password(COORDINATOR_USER))
    config = _run_config(broker, tmp_path / "run", run__rounds=1, model__name="mlp", clients__spawn=2,
                         transport__provision_dir=str(broker.out))
    result = run_federated(config, say=lambda s: None)
    assert result.summary["rounds"] == 1
    assert sorted(p.stem for p in (result.out_dir / "clients").glob("*.json")) == ["device-001", "device-002"]
    with pytest.raises(ConfigError, match="has 3 device bundles but 4 clients"):
        run_federated(_run_config(broker, tmp_path / "more", clients__spawn=4, clients__expected=4,
                                  transport__provision_dir=str(broker.out)), say=lambda s: None)


def test_a_rotated_password_locks_out_the_old_one(tmp_path):
    if mosquitto_binary() is None:
        pytest.skip("mosquitto is not installed")
    deployment = ProvisionedBroker(tmp_path, devices=1)
    old = deployment.password("device-001")
    rotate_password(deployment.out, "device-001")
    assert deployment.password("device-001") != old
    assert stat.S_IMODE((deployment.out / "devices" / "device-001.toml").stat().st_mode) == 0o600
    monitor_file = deployment.out / "monitor" / "password"
    old_monitor = monitor_file.read_text().strip()
    assert rotate_password(deployment.out, "monitor") == monitor_file
    assert monitor_file.read_text().strip() != old_monitor and stat.S_IMODE(monitor_file.stat().st_mode) == 0o600
    deployment.start()
    try:
        deployment.transport("device-001").close()
        deployment.transport("monitor", password=monitor_file.read_text().strip()).close()
        with pytest.raises(TransportError, match="refused"):
            deployment.transport("device-001", password=old)
        with pytest.raises(TransportError, match="refused"):
            deployment.transport("monitor", password=old_monitor)
    finally:
        deployment.stop()


def test_provisioned_aggregation_workers_take_the_results_over_tls(own_broker, tmp_path, monkeypatch):
    """Each provisioned worker logs in as its own user, reads every result through the shared
    subscription and publishes only under its own topics; the run gets every result through them.
    (A broker of its own: the module's has device sessions and retained presences of earlier runs.)"""
    broker = own_broker
    monkeypatch.setenv("FEDGE_MQTT_PASSWORD", broker.password(COORDINATOR_USER))
    workers = []
    for name in broker.done.workers:
        env = ENV | {"FEDGE_WORKER_PASSWORD": broker.password(name)}
        workers.append(subprocess.Popen(
            [sys.executable, "-m", "coordinator.ui.cli", "worker", "--id", name, "--exit-after-run", "--broker", broker.url,
             "--set", f"transport.ca_file={broker.ca}", "--set", f"transport.prefix={PREFIX}",
             "--set", f"transport.username={name}", "--set", "transport.password_env=FEDGE_WORKER_PASSWORD"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    devices = [_device(broker, f"device-00{i + 1}", i, tmp_path) for i in range(2)]
    try:
        result = run_federated(_run_config(broker, tmp_path / "run", workers__count=2), say=lambda s: None)
        outputs = [w.communicate(timeout=60)[0] for w in workers]
    finally:
        for proc in devices + workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [w.returncode for w in workers] == [0, 0], outputs
    assert "denied" not in "".join(outputs), outputs
    rows = [json.loads(line) for line in (result.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert all((r["selected"], r["returned"], r["rejected"]) == (2, 2, 0) for r in rows[1:])
    assert "worker_lost" not in rows[-1]


# -- the read-only monitor user and what provision says to do next -------------------------------------

def test_the_acl_names_the_broker_dir_it_was_given(tmp_path):
    done = provision(tmp_path / "d", hosts=["h"], devices=["pi-01"], broker_dir="/srv/mq/fedge/")
    acl = (done.out_dir / "broker" / "fedge.acl").read_text()
    assert "/srv/mq/fedge/fedge.passwd" in acl and "/etc/mosquitto" not in acl
    assert "\nuser monitor\ntopic read fedge/#\n" in acl


def test_a_broker_run_from_the_provisioning_directory_keeps_the_user_who_provisioned_it(tmp_path):
    in_place = provision(tmp_path / "d", hosts=["h"], devices=["pi-01"], broker_dir=str(tmp_path / "d" / "broker"))
    conf = (in_place.out_dir / "broker" / "fedge.conf").read_text()
    assert f"\nuser {getpass.getuser()}\n" in conf   # as root, not the `mosquitto` user that cannot read 0600 files
    installed = provision(tmp_path / "e", hosts=["h"], devices=["pi-01"])
    assert "\nuser " not in (installed.out_dir / "broker" / "fedge.conf").read_text()   # systemd's broker: its own


def test_the_monitor_user_reads_everything_and_writes_nothing(own_broker):
    broker = own_broker
    monitor_password = (broker.out / "monitor" / "password").read_text().strip()
    assert stat.S_IMODE((broker.out / "monitor" / "password").stat().st_mode) == 0o600
    monitor = broker.transport("monitor", password=monitor_password)
    device = broker.transport("device-001")
    try:
        monitor.subscribe(f"{PREFIX}/#")
        device.publish(f"{PREFIX}/clients/device-001/result", b"an update")
        forged = [f"{PREFIX}/clients/device-001/task", f"{PREFIX}/coordinator/status"]
        for topic in forged:
            monitor.publish(topic, b"forged")
        assert _drain(monitor, 1.0) == [f"{PREFIX}/clients/device-001/result"]
        assert monitor.denied == set(forged)
    finally:
        monitor.close()
        device.close()
    with pytest.raises(Exception, match="monitor"):
        provision(broker.root / "again", hosts=["h"], devices=["monitor"])


def test_provision_prints_the_commands_that_follow_and_status_works_as_printed(tmp_path, capsys, monkeypatch):
    if mosquitto_binary() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    out, port = tmp_path / "deploy", free_port()
    assert coordinator_main(["provision", "--devices", "2", "--broker-host", "127.0.0.1", "--port", str(port),
                             "--listen", "127.0.0.1", "--broker-dir", str(out / "broker"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    commands = [line.strip() for line in printed.splitlines() if line.startswith("    ")]
    assert commands[0].startswith(f"mosquitto -c {out / 'broker' / 'fedge.conf'}")
    assert any(c.startswith(f"fedge-client run --bundle {out / 'devices' / 'device-001.toml'}") for c in commands)
    assert f'export FEDGE_MQTT_PASSWORD="$(cat {out / "coordinator" / "password"})"' in commands
    assert any(c.startswith(f"fedge-coordinator run --config {out / 'coordinator' / 'coordinator.toml'} --clients 2")
               for c in commands)
    status = next(c for c in commands if "fedge-coordinator status" in c)
    # the broker started as printed (the test adds its log and user lines), a device online on it
    mosquitto = LocalMosquitto(workdir=tmp_path / "mq", config=(out / "broker" / "fedge.conf").read_text(), port=port)
    mosquitto.start()
    settings = BrokerSettings(url=f"mqtts://127.0.0.1:{port}", username="device-002",
                              password=read_bundle(out / "devices" / "device-002.toml").password, protocol="5",
                              ca_file=str(out / "ca.crt"), connect_timeout=5)
    device = MqttTransport(settings, "device-002").connect()
    try:
        device.publish(f"{PREFIX}/clients/device-002/presence",
                       presence_payload("device-002", PresenceBody("online", num_samples=8)), retain=True)
        device.subscribe(f"{PREFIX}/clients/device-002/presence")   # its echo: the broker holds it retained
        assert device.get(5.0) is not None, "the presence never reached the broker"
        monkeypatch.setenv("FEDGE_MQTT_PASSWORD", (out / "monitor" / "password").read_text().strip())
        argv = status.split(" fedge-coordinator ", 1)[1].split()
        argv = argv[:argv.index("--run-dir")] + ["--json"]   # no run yet
        assert coordinator_main(argv) == 0
        seen = json.loads(capsys.readouterr().out)
    finally:
        device.close()
        mosquitto.stop()
    assert "device-002" in json.dumps(seen) and "online" in json.dumps(seen)
