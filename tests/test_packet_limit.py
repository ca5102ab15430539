"""A device whose max_message_bytes is over the broker's packet limit, on MQTT 3.1.1 (which hides the limit)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from coordinator.config import load_config
from coordinator.runtime.engine import RunError
from coordinator.ops.mosquitto import LocalMosquitto
from coordinator.runtime.run import run_federated


def test_an_oversize_device_answers_with_the_setting_to_lower_and_the_run_says_so(tmp_path):
    broker = LocalMosquitto(workdir=tmp_path / "broker", extra_config="max_packet_size 60000\n")
    url = broker.start()
    client = subprocess.Popen(
        [sys.executable, "-m", "edge_client.cli", "run", "--broker", url, "--client-id", "pi-big", "--data", "digits",
         "--partition", "iid", "--partition-index", "0", "--num-partitions", "1", "--seed", "0",
         "--state-dir", str(tmp_path / "pi"), "--prefix", "lim", "--mqtt-protocol", "3.1.1",
         "--torch-threads", "1", "--max-message-bytes", "262144", "--exit-after-run"],
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sets = {"run.rounds": 1, "run.out": str(tmp_path / "run"), "model.name": "cnn", "data.eval": "digits",
            "clients.expected": 1, "clients.round_timeout": 40.0, "clients.max_attempts": 1,
            "transport.broker": url, "transport.prefix": "lim", "transport.protocol": "3.1.1",
            "transport.max_message_bytes": 32768, "export.enabled": False}
    try:
        with pytest.raises(RunError, match=r"the clients said: pi-big: .*over the broker's packet limit.*"
                                           r"set max_message_bytes .* to the broker's limit"):
            run_federated(load_config(None, [(*k.split(".", 1), v) for k, v in sets.items()]), say=lambda s: None)
    finally:
        client.terminate()
        client.wait(30)
        broker.stop()
