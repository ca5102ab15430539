"""Tests for coordinator.ops.broker: a real amqtt broker exercised with real paho clients.

Everything runs on loopback; every wait is bounded so a broken broker makes a
test fail quickly instead of hanging.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import stat
import threading
import time
import uuid
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from coordinator.ops.broker import BrokerEndpoint, BrokerError, EmbeddedBroker, free_port

pytestmark = pytest.mark.timeout(10)

WAIT = 5.0  # upper bound for any single network round trip in these tests


class Peer:
    """A paho 3.1.1 client with blocking helpers, so tests read top to bottom."""

    def __init__(
        self,
        endpoint: BrokerEndpoint,
        *,
        client_id: str = "",
        clean_session: bool = True,
        credentials: tuple[str | None, str | None] | None = None,
        use_credentials: bool = True,
    ) -> None:
        self.endpoint = endpoint
        self.client = mqtt.Client(
            callback_api_version=CallbackAPIVersion.VERSION2,
            client_id=client_id,
            clean_session=clean_session,
            protocol=mqtt.MQTTv311,
        )
        # paho's background thread sleeps up to reconnect_delay after losing the
        # connection, and loop_stop() waits for that sleep; keep it short.
        self.client.reconnect_delay_set(min_delay=0.1, max_delay=0.2)
        if use_credentials:
            user, pw = credentials if credentials is not None else (endpoint.username, endpoint.password)
            self.client.username_pw_set(user, pw)
        self.messages: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.connack: queue.Queue[tuple[object, bool]] = queue.Queue()
        self.subacks: queue.Queue[list[object]] = queue.Queue()
        self.disconnected = threading.Event()
        self.client.on_connect = self._on_connect
        self.client.on_message = lambda _c, _u, msg: self.messages.put(msg)
        self.client.on_subscribe = lambda _c, _u, _mid, codes, _p: self.subacks.put(list(codes))
        self.client.on_disconnect = lambda *_args: self.disconnected.set()

    def _on_connect(self, _client, _userdata, flags, reason_code, _props) -> None:
        self.connack.put((reason_code, bool(flags.session_present)))

    def connect(self) -> tuple[object, bool]:
        """Connect and return (reason_code, session_present) from the CONNACK."""
        self.client.connect(self.endpoint.host, self.endpoint.port, keepalive=30)
        self.client.loop_start()
        return self.connack.get(timeout=WAIT)

    def subscribe(self, topic: str, qos: int = 1) -> None:
        self.client.subscribe(topic, qos)
        codes = self.subacks.get(timeout=WAIT)
        assert not any(code.is_failure for code in codes), codes

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> None:
        info = self.client.publish(topic, payload, qos=qos, retain=retain)
        info.wait_for_publish(timeout=WAIT)
        assert info.is_published(), f"no PUBACK for {topic}"

    def receive(self, timeout: float = WAIT) -> mqtt.MQTTMessage:
        return self.messages.get(timeout=timeout)

    def close(self) -> None:
        """Clean DISCONNECT (no last will) and stop the network thread."""
        try:
            self.client.disconnect()
            self.disconnected.wait(WAIT)
        finally:
            self.client.loop_stop()


@pytest.fixture
def broker(tmp_path: Path):
    b = EmbeddedBroker(workdir=tmp_path)
    b.start()
    yield b
    b.stop()


@pytest.fixture
def peers(broker: EmbeddedBroker):
    """Factory for connected clients that are all shut down after the test."""
    created: list[Peer] = []

    def make(**kwargs) -> Peer:
        peer = Peer(broker.endpoint, **kwargs)
        created.append(peer)
        return peer

    yield make
    for peer in created:
        try:
            peer.close()
        except Exception:  # already closed or never connected
            pass


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# ---------------------------------------------------------------- lifecycle


def test_start_stop_on_loopback_and_idempotent_stop(tmp_path: Path) -> None:
    b = EmbeddedBroker(workdir=tmp_path)
    assert b.endpoint is None and not b.running
    ep = b.start()
    try:
        assert b.running
        assert ep.host == "127.0.0.1"
        assert ep.protocol == "3.1.1"
        assert ep.url == f"mqtt://127.0.0.1:{ep.port}"
        assert ep.username and ep.password
        assert ep.password not in repr(ep) and ep.password not in ep.url
        assert b.start() is ep  # starting a running broker is a no-op
        with socket.create_connection((ep.host, ep.port), timeout=WAIT):
            pass  # the listener accepts TCP connections
    finally:
        b.stop()
    assert not b.running and b.endpoint is None
    b.stop()  # second stop is harmless
    with pytest.raises(OSError):
        socket.create_connection((ep.host, ep.port), timeout=1).close()


def test_stop_without_start_is_harmless() -> None:
    EmbeddedBroker().stop()


def test_context_manager_and_private_tempdir() -> None:
    with EmbeddedBroker() as b:
        ep = b.endpoint
        assert ep is not None and b.running
        password_file = b._password_file
        assert password_file is not None and password_file.exists()
        tmpdir = password_file.parent
        assert stat.S_IMODE(tmpdir.stat().st_mode) == 0o700
        assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
        # amqtt's format: user:argon2-hash, and the plaintext is not in it
        content = password_file.read_text()
        assert content.startswith(f"{ep.username}:$argon2id$")
        assert ep.password not in content
    assert not b.running
    assert not tmpdir.exists()


def test_workdir_password_file_removed_on_stop(tmp_path: Path) -> None:
    b = EmbeddedBroker(workdir=tmp_path / "sub")
    b.start()
    files = list((tmp_path / "sub").iterdir())
    assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o600
    b.stop()
    assert list((tmp_path / "sub").iterdir()) == []
    assert (tmp_path / "sub").exists()  # the caller's directory is left alone


def test_restart_gets_new_credentials(tmp_path: Path) -> None:
    b = EmbeddedBroker(workdir=tmp_path)
    first = b.start()
    b.stop()
    second = b.start()
    try:
        assert second.password != first.password
        peer = Peer(second)
        rc, _ = peer.connect()
        assert not rc.is_failure
        peer.close()
    finally:
        b.stop()


def test_explicit_port_in_use_raises_broker_error(tmp_path: Path) -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        b = EmbeddedBroker(port=port, workdir=tmp_path)
        with pytest.raises(BrokerError, match=str(port)):
            b.start(timeout=5)
        assert not b.running
    assert list(tmp_path.iterdir()) == []  # no password file left behind


def test_start_timeout_raises_broker_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def never_ready(self, port, ready, outcome):  # broker that hangs while starting
        import asyncio

        await asyncio.sleep(60)

    monkeypatch.setattr(EmbeddedBroker, "_serve", never_ready)
    b = EmbeddedBroker(workdir=tmp_path)
    t0 = time.monotonic()
    with pytest.raises(BrokerError, match="did not start"):
        b.start(timeout=0.3)
    assert time.monotonic() - t0 < 3
    assert not b.running
    assert list(tmp_path.iterdir()) == []


def test_non_loopback_host_rejected() -> None:
    with pytest.raises(ValueError, match="loopback"):
        EmbeddedBroker(host="0.0.0.0")


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# ----------------------------------------------------------- authentication


def test_qos1_roundtrip_with_generated_credentials(peers) -> None:
    topic = unique("fedge/test/rt")
    sub = peers()
    rc, _ = sub.connect()
    assert not rc.is_failure, rc
    sub.subscribe(topic, qos=1)
    pub = peers()
    assert not pub.connect()[0].is_failure
    pub.publish(topic, b"hello", qos=1)
    msg = sub.receive()
    assert (msg.topic, msg.payload, msg.qos) == (topic, b"hello", 1)


def test_wrong_password_refused(broker: EmbeddedBroker, peers) -> None:
    peer = peers(credentials=(broker.endpoint.username, "not-the-password"))
    rc, _ = peer.connect()
    assert rc.is_failure, rc


def test_unknown_user_refused(peers) -> None:
    peer = peers(credentials=("someone-else", "whatever"))
    rc, _ = peer.connect()
    assert rc.is_failure, rc


def test_anonymous_refused(peers) -> None:
    peer = peers(use_credentials=False)
    rc, _ = peer.connect()
    assert rc.is_failure, rc


def test_mqtt5_client_is_not_accepted(broker: EmbeddedBroker) -> None:
    # Documents the limitation: amqtt speaks 3.1.1 only.  A v5 CONNECT without
    # credentials is refused; with credentials amqtt misparses it and never
    # answers, so the client would hang until its keepalive runs out.
    ep = broker.endpoint
    for with_credentials in (False, True):
        client = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        if with_credentials:
            client.username_pw_set(ep.username, ep.password)
        results: queue.Queue[object] = queue.Queue()
        client.on_connect = lambda _c, _u, _f, rc, _p, q=results: q.put(rc)
        try:
            client.connect(ep.host, ep.port, keepalive=30)
            client.loop_start()
            try:
                outcome = results.get(timeout=1.0)
            except queue.Empty:
                outcome = None
            assert outcome is None or outcome.is_failure, (with_credentials, outcome)
            if not with_credentials:
                assert outcome is not None  # an explicit refusal
        finally:
            client.loop_stop()


# ------------------------------------------------------- MQTT features used


def test_retained_message_reaches_late_subscriber(peers) -> None:
    topic = unique("fedge/test/retained")
    pub = peers()
    pub.connect()
    pub.publish(topic, b"model-v1", qos=1, retain=True)
    pub.close()

    late = peers()
    late.connect()
    late.subscribe(topic, qos=1)
    msg = late.receive()
    assert msg.payload == b"model-v1"
    assert msg.retain


def test_last_will_on_dropped_socket(broker: EmbeddedBroker, peers) -> None:
    will_topic = unique("fedge/test/status")
    watcher = peers()
    watcher.connect()
    watcher.subscribe(will_topic, qos=1)

    ep = broker.endpoint
    doomed = mqtt.Client(
        callback_api_version=CallbackAPIVersion.VERSION2,
        client_id=unique("doomed"),
        protocol=mqtt.MQTTv311,
    )
    doomed.username_pw_set(ep.username, ep.password)
    doomed.will_set(will_topic, b"offline", qos=1)
    connected = threading.Event()
    doomed.on_connect = lambda _c, _u, _f, rc, _p: (not rc.is_failure) and connected.set()
    # Drive the network loop by hand (no background thread) so we can kill the
    # socket while nothing else touches it: like a device losing power.
    doomed.connect(ep.host, ep.port, keepalive=30)
    deadline = time.monotonic() + WAIT
    while not connected.is_set() and time.monotonic() < deadline:
        doomed.loop(timeout=0.05)
    assert connected.is_set()
    assert watcher.messages.empty()

    sock = doomed.socket()
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()

    msg = watcher.receive()
    assert (msg.topic, msg.payload) == (will_topic, b"offline")


def test_clean_disconnect_sends_no_will(broker: EmbeddedBroker, peers) -> None:
    will_topic = unique("fedge/test/status")
    watcher = peers()
    watcher.connect()
    watcher.subscribe(will_topic, qos=1)
    polite = peers(client_id=unique("polite"))
    polite.client.will_set(will_topic, b"offline", qos=1)
    polite.connect()
    polite.close()
    with pytest.raises(queue.Empty):
        watcher.receive(timeout=0.5)


def test_persistent_session_gets_messages_sent_while_offline(peers, caplog, wait_until) -> None:
    topic = unique("fedge/test/persist")
    client_id = unique("edge-device")

    caplog.set_level(logging.DEBUG, logger="amqtt.broker")
    sub = peers(client_id=client_id, clean_session=False)
    rc, _ = sub.connect()
    assert not rc.is_failure
    sub.subscribe(topic, qos=1)
    sub.close()
    # amqtt marks the session offline some time after it reads DISCONNECT, then logs "<id> Client disconnected"
    # (DEBUG): until then the publishes below would go to the dying socket instead of the session's queue.
    wait_until(lambda: f"{client_id} Client disconnected" in caplog.messages, "the broker never ended the session")

    pub = peers()
    pub.connect()
    for i in range(3):
        pub.publish(topic, f"update-{i}".encode(), qos=1)

    again = peers(client_id=client_id, clean_session=False)
    rc, session_present = again.connect()
    assert not rc.is_failure
    assert session_present  # the broker kept the subscription; we do not resubscribe
    got = sorted(again.receive().payload for _ in range(3))
    assert got == [b"update-0", b"update-1", b"update-2"]
    with pytest.raises(queue.Empty):
        again.receive(timeout=0.3)  # exactly three, no duplicates


def test_two_megabyte_payload(peers) -> None:
    topic = unique("fedge/test/big")
    payload = os.urandom(2 * 1024 * 1024)
    sub = peers()
    sub.connect()
    sub.subscribe(topic, qos=1)
    pub = peers()
    pub.connect()
    pub.publish(topic, payload, qos=1)
    msg = sub.receive()
    assert msg.payload == payload


def test_stop_with_connected_clients_is_prompt(tmp_path: Path) -> None:
    b = EmbeddedBroker(workdir=tmp_path)
    ep = b.start()
    peer = Peer(ep)
    peer.connect()
    peer.subscribe(unique("fedge/test/x"))
    try:
        t0 = time.monotonic()
        b.stop(timeout=5)
        assert time.monotonic() - t0 < 5
        assert peer.disconnected.wait(WAIT)  # the client notices the broker went away
    finally:
        peer.close()


def _login(endpoint: BrokerEndpoint, user: str, password: str, inbox: "queue.Queue[tuple[str, bytes]]") -> mqtt.Client:
    """A logged-in client whose messages go to ``inbox``; subscribe with :func:`_subscribe`."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"{user}-{uuid.uuid4().hex[:6]}",
                         protocol=mqtt.MQTTv311)
    client.username_pw_set(user, password)
    client.user_data_set(queue.Queue())   # the SUBACKs
    client.on_message = lambda c, u, m: inbox.put((m.topic, m.payload))
    client.on_subscribe = lambda c, subacks, mid, codes, p: subacks.put(mid)
    client.connect(endpoint.host, endpoint.port)
    client.loop_start()
    return client


def _subscribe(client: mqtt.Client, topic_filter: str) -> None:
    """Subscribe, and return once the broker acknowledged it: a message published after this is ours."""
    _, mid = client.subscribe(topic_filter, qos=1)
    assert client.user_data_get().get(timeout=WAIT) == mid, f"no SUBACK for {topic_filter}"


def test_each_spawned_device_may_use_only_its_own_topics(tmp_path: Path) -> None:
    with EmbeddedBroker(workdir=tmp_path, devices=["sim-000", "sim-001"], prefix="p") as broker:
        ep = broker.endpoint
        assert ep is not None and set(ep.devices) == {"sim-000", "sim-001"} and "devices" not in repr(ep)
        seen: queue.Queue[tuple[str, bytes]] = queue.Queue()
        stolen: queue.Queue[tuple[str, bytes]] = queue.Queue()
        coordinator = _login(ep, ep.username, ep.password, seen)
        device = _login(ep, "sim-000", ep.devices["sim-000"], stolen)
        try:
            _subscribe(coordinator, "p/clients/+/result")
            _subscribe(device, "p/clients/sim-001/task")     # another device's tasks: granted, never delivered
            _subscribe(device, "p/clients/sim-000/task")
            device.publish("p/clients/sim-001/result", b"forged", qos=1).wait_for_publish(5)
            device.publish("p/clients/sim-000/result", b"mine", qos=1).wait_for_publish(5)
            coordinator.publish("p/clients/sim-001/task", b"for 1", qos=1).wait_for_publish(5)
            coordinator.publish("p/clients/sim-000/task", b"for 0", qos=1).wait_for_publish(5)
            assert seen.get(timeout=5) == ("p/clients/sim-000/result", b"mine")
            assert stolen.get(timeout=5) == ("p/clients/sim-000/task", b"for 0")
            # The forged result and the other's task were acknowledged before the messages just received were
            # sent, and the broker passes messages on in the order it took them: had they been delivered, they
            # would have come first.
            assert seen.empty() and stolen.empty()              # the forged result and the other's task: nowhere
        finally:
            for client in (coordinator, device):
                client.loop_stop()
                client.disconnect()


# Persistent sessions reconnecting all at once while each subscribes a new filter that a retained
# message matches: what a fleet coming back after a broker hiccup does. amqtt 0.12.1 sends a
# reconnecting session its retained messages while looping over the subscription table, and a
# subscription arriving meanwhile used to kill that loop (a traceback on stderr, a dead session).
RECONNECT_STORM = """
import sys, threading
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from coordinator.ops.broker import EmbeddedBroker

N, ROUNDS = int(sys.argv[1]), int(sys.argv[2])
ok = []
with EmbeddedBroker() as broker:
    ep = broker.endpoint

    def session(cid: str, topic: str, barrier: threading.Barrier) -> None:
        client = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=cid, clean_session=False,
                             protocol=mqtt.MQTTv311)
        client.username_pw_set(ep.username, ep.password)
        subscribed = threading.Event()
        client.on_subscribe = lambda *args: subscribed.set()
        barrier.wait()
        client.connect(ep.host, ep.port)
        client.loop_start()
        client.subscribe(topic, 1)
        client.publish(f"fedge/clients/{cid}/presence", b"online", qos=1, retain=True)
        ok.append(subscribed.wait(10))
        client.disconnect()
        client.loop_stop()

    seed = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
    seed.username_pw_set(ep.username, ep.password)
    seed.connect(ep.host, ep.port)
    seed.loop_start()
    for k in range(N * ROUNDS):   # a retained message for every filter the sessions will subscribe to
        seed.publish(f"fedge/t/{k}", b"state", qos=1, retain=True).wait_for_publish(10)
    seed.disconnect()
    seed.loop_stop()
    for round in range(ROUNDS):
        barrier = threading.Barrier(N)
        threads = [threading.Thread(target=session, args=(f"dev-{i}", f"fedge/t/{round * N + i}", barrier))
                   for i in range(N)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
print(f"{sum(ok)} of {N * ROUNDS} sessions subscribed")
"""


@pytest.mark.timeout(60)
def test_simultaneous_reconnects_and_subscriptions_leave_no_traceback(tmp_path: Path) -> None:
    import subprocess
    import sys

    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", RECONNECT_STORM, "12", "3"], capture_output=True, text=True,
                              timeout=50, cwd=Path(__file__).resolve().parents[1])
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr and "never retrieved" not in done.stderr, done.stderr
        assert done.stdout.strip() == "36 of 36 sessions subscribed", done.stdout + done.stderr


# A subscriber that acknowledges on take (as the coordinator does) and is busy for longer than the 5 s amqtt
# gives a PUBACK: amqtt logged a warning per message, another for each late PUBACK, and at its shutdown an
# ERROR with a traceback for each, on a console that shows warnings (as fedge-coordinator's does).
SLOW_TAKER = """
import logging, threading, time
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from coordinator.ops.broker import EmbeddedBroker

logging.basicConfig(level=logging.WARNING)
with EmbeddedBroker() as broker:
    ep = broker.endpoint

    def login(cid: str, manual_ack: bool) -> mqtt.Client:
        client = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=cid, clean_session=False,
                             protocol=mqtt.MQTTv311, manual_ack=manual_ack)
        client.username_pw_set(ep.username, ep.password)
        client.connect(ep.host, ep.port)
        client.loop_start()
        return client

    taken = []
    taker = login("taker", manual_ack=True)
    taker.on_message = lambda client, userdata, msg: taken.append(msg.mid)
    subscribed = threading.Event()
    taker.on_subscribe = lambda *args: subscribed.set()
    taker.subscribe("t/#", 1)
    assert subscribed.wait(5), "no SUBACK"
    sender = login("sender", manual_ack=False)
    for k in range(3):
        sender.publish(f"t/{k}", b"x", qos=1).wait_for_publish(5)
    time.sleep(6.0)         # busy past amqtt's 5 s
    for mid in list(taken):
        taker.ack(mid, 1)   # taken at last; the acknowledgements leave before the DISCONNECT below
    for client in (sender, taker):
        client.disconnect()
        client.loop_stop()
print(f"{len(taken)} delivered")
"""


@pytest.mark.timeout(40)
def test_a_slow_acknowledgement_and_the_shutdown_after_it_stay_off_the_console() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SLOW_TAKER], capture_output=True, text=True, timeout=35,
                          cwd=Path(__file__).resolve().parents[1], env={k: v for k, v in os.environ.items()
                                                                      if k != "FEDGE_BROKER_DEBUG"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "3 delivered", done.stdout + done.stderr
    assert done.stderr == "", done.stderr
