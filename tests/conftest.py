"""Shared fixtures: a real Mosquitto on a free loopback port, started and stopped by PID."""

from __future__ import annotations

import os
import time

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


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread, as a device client runs: small models on a busy 2-core machine
    train faster on one thread than on two fighting over it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
