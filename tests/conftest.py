"""Shared fixtures: a real Mosquitto on a free loopback port, started and stopped by PID."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from coordinator.broker import free_port


def _mosquitto_binary() -> str | None:
    return shutil.which("mosquitto") or next((p for p in ("/usr/sbin/mosquitto",) if os.access(p, os.X_OK)), None)


@pytest.fixture(scope="session")
def mosquitto(tmp_path_factory: pytest.TempPathFactory) -> str:
    """URL of a Mosquitto broker that lives for the whole test session."""
    binary = _mosquitto_binary()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("mosquitto is not installed; `make test` installs it with apt when run as root")
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    workdir = tmp_path_factory.mktemp("mosquitto")
    port = free_port()
    conf = workdir / "mosquitto.conf"
    conf.write_text(
        f"listener {port} 127.0.0.1\n"
        "allow_anonymous true\n"
        "persistence false\n"
        "max_queued_messages 100000\n"   # the default 1000 silently drops QoS 1 messages
        "log_dest stderr\n"
        "log_type error\nlog_type warning\n",
        encoding="utf-8")
    if os.geteuid() == 0:
        conf.write_text(conf.read_text() + "user root\n", encoding="utf-8")
    log = open(workdir / "mosquitto.log", "wb")
    proc = subprocess.Popen([binary, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"mosquitto did not start: {(workdir / 'mosquitto.log').read_text()}")
            time.sleep(0.05)
    yield f"mqtt://127.0.0.1:{port}"
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    """A topic prefix of its own for each test, so retained messages never leak between tests."""
    return "t" + str(abs(hash(request.node.nodeid)) % 10**8) + "-" + str(time.monotonic_ns() % 10**6)
