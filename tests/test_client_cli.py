"""``fedge-client run`` as a process on a device: how it stops and how it fails.

Every way out (SIGTERM, SIGINT, a crash) leaves the device offline on the broker, stop
signals are handled without locks however many arrive, and a missing dependency or a
Ctrl-C while the broker is down is one line, not a traceback.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from edge_client.wire.protocol import Topics, decode
from edge_client.wire.transport import parse_broker_url

# Runs the CLI with a second SIGTERM raised inside the first one's handler, at every line it
# executes: what a process-group signal landing mid-handler does, made certain instead of rare.
SIGNAL_INSIDE_HANDLER = """
import os, signal, sys
real_signal = signal.signal
depth = 0

def tracer(frame, event, arg):
    if event == "line" and depth == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    return tracer

def wrap(handler):
    def wrapped(signum, frame):
        global depth
        depth += 1
        if depth == 1:
            sys.settrace(tracer)
        try:
            handler(signum, frame)
        finally:
            if depth == 1:
                sys.settrace(None)
            depth -= 1
    return wrapped

signal.signal = lambda signum, handler: real_signal(
    signum, wrap(handler) if signum == signal.SIGTERM and callable(handler) else handler)
from edge_client.cli import main
sys.exit(main(sys.argv[1:]))
"""

# Runs the CLI as if torch were not installed.
WITHOUT_TORCH = """
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoTorch())
from edge_client.cli import main
sys.exit(main(sys.argv[1:]))
"""

# Runs the CLI with a client loop that crashes once the device is online.
CRASH_WHEN_ONLINE = """
import sys
from edge_client.client import EdgeClient

def step(self, timeout):
    raise RuntimeError("a bug in the task loop")

EdgeClient.step = step
from edge_client.cli import main
sys.exit(main(sys.argv[1:]))
"""

ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("data") / "tiny.npz"
    np.savez(path, x=np.zeros((8, 1, 8, 8), np.float32), y=np.arange(8) % 2,
             x_test=np.zeros((2, 1, 8, 8), np.float32), y_test=np.arange(2))
    return f"npz:{path}"


def _client(broker: str, prefix: str, client_id: str, data: str, state_dir: Path, *,
            wrapper: str | None = None) -> subprocess.Popen:
    head = [sys.executable, "-c", wrapper] if wrapper else [sys.executable, "-m", "edge_client.cli"]
    args = ["run", "--broker", broker, "--client-id", client_id, "--data", data, "--prefix", prefix,
            "--state-dir", str(state_dir / client_id), "--torch-threads", "1"]
    return subprocess.Popen(head + args, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


class _Presence:
    """The latest (retained) presence state of every client under ``prefix``, as the broker passes it on."""

    def __init__(self, broker: str, prefix: str) -> None:
        self.topics = Topics(prefix)
        self.states: dict[str, str] = {}
        self.history: dict[str, list[str]] = {}
        self._changed = threading.Condition()
        self._client = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2)
        self._client.on_message = self._on_message
        self._client.on_connect = lambda c, *_: c.subscribe(self.topics.all_clients("presence"), qos=1)
        self._client.connect(*parse_broker_url(broker))
        self._client.loop_start()

    def _on_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        state = decode(bytes(msg.payload)).body["state"]
        with self._changed:
            client_id = self.topics.client_of(msg.topic)
            self.states[client_id] = state
            self.history.setdefault(client_id, []).append(state)
            self._changed.notify_all()

    def wait(self, client_ids: list[str], state: str, timeout: float) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: all(self.states.get(c) == state for c in client_ids), timeout), \
                f"not all {state}: {self.states}"

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()


def _retained_states(broker: str, prefix: str, client_ids: list[str]) -> dict[str, str]:
    """What a coordinator starting now would read: the retained presence of each client."""
    presence = _Presence(broker, prefix)
    try:
        deadline = time.monotonic() + 10
        while set(presence.states) < set(client_ids) and time.monotonic() < deadline:
            time.sleep(0.05)
        return dict(presence.states)
    finally:
        presence.close()


def _wait_exit(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"fedge-client still running {timeout} s after being asked to stop:\n{err}")
    return proc.returncode, err


def _busy_wait(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def test_two_sigterms_stop_every_client_promptly_and_leave_it_offline(mosquitto, prefix, tiny_data, tmp_path):
    ids = [f"dev-{i}" for i in range(10)]
    presence = _Presence(mosquitto, prefix)
    procs = [_client(mosquitto, prefix, cid, tiny_data, tmp_path, wrapper=SIGNAL_INSIDE_HANDLER) for cid in ids]
    try:
        presence.wait(ids, "online", timeout=90)
        rng = random.Random(0)
        for start in range(0, len(procs), 2):   # two at a time: exiting torch processes share 2 cores
            batch = list(zip(ids, procs))[start:start + 2]
            for _, proc in batch:   # a pair, as `timeout`, systemd or a shell signalling the process group
                os.kill(proc.pid, signal.SIGTERM)
                _busy_wait(rng.uniform(0, 50e-6))
                os.kill(proc.pid, signal.SIGTERM)
            for cid, proc in batch:
                code, err = _wait_exit(proc, timeout=15)
                assert code == 0, f"{cid} exited {code}:\n{err}"
                assert "Traceback" not in err, err
                assert _stop_lines(err) == ["stopping: finishing the task at hand", "stopped"], err
        presence.wait(ids, "offline", timeout=10)
    finally:
        presence.close()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_ctrl_c_leaves_the_device_offline(mosquitto, prefix, tiny_data, tmp_path):
    presence = _Presence(mosquitto, prefix)
    proc = _client(mosquitto, prefix, "pi-01", tiny_data, tmp_path)
    try:
        presence.wait(["pi-01"], "online", timeout=60)
    finally:
        presence.close()
    proc.send_signal(signal.SIGINT)
    code, err = _wait_exit(proc, timeout=10)
    assert code == 0 and "Traceback" not in err, err
    assert _retained_states(mosquitto, prefix, ["pi-01"]) == {"pi-01": "offline"}
    # Without -v a person at the device still sees it connect and come online, and stop.
    assert "connected to mqtt://" in err and "client pi-01 online with" in err, err
    assert _stop_lines(err) == ["stopping: finishing the task at hand", "stopped"], err


def _stop_lines(err: str) -> list[str]:
    """What a client logged at WARNING about stopping, in order."""
    return [line.split(" WARNING ", 1)[1] for line in err.splitlines()
            if " fedge.client WARNING stop" in line]


def test_a_crash_leaves_the_device_offline(mosquitto, prefix, tiny_data, tmp_path):
    presence = _Presence(mosquitto, prefix)
    proc = _client(mosquitto, prefix, "pi-02", tiny_data, tmp_path, wrapper=CRASH_WHEN_ONLINE)
    try:
        code, err = _wait_exit(proc, timeout=60)
    finally:
        presence.close()
    assert code != 0 and "a bug in the task loop" in err   # a crash keeps its traceback
    assert "online" in presence.history.get("pi-02", [])   # it did get online before crashing
    assert _retained_states(mosquitto, prefix, ["pi-02"]) == {"pi-02": "offline"}


def test_missing_torch_is_one_line_naming_the_extra(tmp_path):
    out = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, "run", "--client-id", "pi-01", "--data", "digits",
                          "--state-dir", str(tmp_path)], env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "torch" in lines[0] and "fedge[client]" in lines[0], out.stderr


def test_ctrl_c_while_the_broker_is_down_is_one_line(tiny_data, tmp_path):
    with socket.socket() as sock:   # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = _client(f"mqtt://127.0.0.1:{port}", "fedge", "pi-01", tiny_data, tmp_path)
    first = proc.stderr.readline()   # the client is in its retry loop once it says so (its handler set before)
    assert "retrying" in first, first
    proc.send_signal(signal.SIGINT)
    code, err = _wait_exit(proc, timeout=10)
    assert code == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines() == [f"fedge-client: stopped before connecting to mqtt://127.0.0.1:{port}"]


def test_a_malformed_broker_url_is_one_line_and_exit_2(tiny_data, tmp_path):
    out = subprocess.run([sys.executable, "-m", "edge_client.cli", "run", "--broker", "127.0.0.1:1883",
                          "--client-id", "pi-09", "--data", "digits"], env=ENV, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "fedge-client: broker URL '127.0.0.1:1883' must look like mqtt://HOST:PORT (e.g. mqtt://127.0.0.1:1883): "
        "the mqtt:// scheme is missing"]
