"""Shared fixtures: a real Mosquitto on a free loopback port, started and stopped by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch

from coordinator.mosquitto import LocalMosquitto, mosquitto_binary


@pytest.fixture(scope="session")
def mosquitto(tmp_path_factory: pytest.TempPathFactory) -> str:
    """URL of a Mosquitto broker that lives for the whole test session."""
    if mosquitto_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("mosquitto is not installed; `make test` installs it with apt when run as root")
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    broker = LocalMosquitto(workdir=tmp_path_factory.mktemp("mosquitto"))
    broker.start()
    yield broker.url
    broker.stop()


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    """A topic prefix of its own for each test, so retained messages never leak between tests."""
    return "t" + str(abs(hash(request.node.nodeid)) % 10**8) + "-" + str(time.monotonic_ns() % 10**6)


def _kill_after_checkpoint(proc: subprocess.Popen, out: Path, round: int, timeout: float = 180.0) -> None:
    """SIGKILL a coordinator process once round ``round`` of its run in ``out`` is checkpointed, and
    wait for its spawned clients, which leave when their parent is gone."""
    deadline = time.monotonic() + timeout
    while not (out / "checkpoints" / f"round_{round:04d}.safetensors").exists():
        assert proc.poll() is None and time.monotonic() < deadline, f"coordinator ended before round {round}"
        time.sleep(0.05)
    children = psutil.Process(proc.pid).children()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    psutil.wait_procs(children, timeout=30)


@pytest.fixture
def kill_after_checkpoint() -> Callable[..., None]:
    """``kill(proc, out, round)``: a coordinator killed hard right after a checkpoint, for resume tests."""
    return _kill_after_checkpoint


def _announce_running(transport, run_id: str = "r", prefix: str = "fedge") -> None:
    """What a coordinator publishes before its tasks: the retained status naming its running run
    (devices run only that run's tasks)."""
    from edge_client.wire.protocol import Topics, encode

    payload = encode("status", run_id=run_id, round=1, task_id="", sender="coordinator", body={"state": "running"})
    transport.publish(Topics(prefix).coordinator_status, payload, retain=True)


@pytest.fixture
def announce_running() -> Callable[..., None]:
    """``announce(transport, run_id="r")`` for tests that play the coordinator by hand."""
    return _announce_running


class ClientThread:
    """A device client looping on a thread of its own, for tests that play the coordinator by hand."""

    def __init__(self, client) -> None:   # client: edge_client.client.EdgeClient
        self.client = client
        self._stop = threading.Event()
        self._thread = threading.Thread(target=client.run, args=(self._stop,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def client_thread() -> Callable[..., ClientThread]:
    """``client_thread(client)`` starts the client's loop; every one started is stopped after the test."""
    started: list[ClientThread] = []

    def start(client) -> ClientThread:
        started.append(ClientThread(client))
        return started[-1]

    yield start
    for running in started:
        running.stop()


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread, as a device client runs: small models on a busy 2-core machine
    train faster on one thread than on two fighting over it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
