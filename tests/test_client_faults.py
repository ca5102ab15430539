"""A device killed while its chunked result is on the wire, restarted with the same id and state directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from coordinator.config import load_config
from coordinator.runtime.run import run_federated


def _client_cmd(broker: str, prefix: str, index: int, state_dir: Path) -> list[str]:
    return [sys.executable, "-m", "edge_client.cli", "run", "--broker", broker, "--client-id", f"dev-{index}",
            "--data", "digits", "--partition", "iid", "--partition-index", str(index), "--num-partitions", "2",
            "--seed", "0", "--state-dir", str(state_dir), "--prefix", prefix, "--torch-threads", "1",
            "--max-message-bytes", "8192", "--exit-after-run"]


def test_a_device_killed_mid_upload_and_restarted_loses_no_round(tmp_path, mosquitto, prefix):
    host, port = mosquitto.removeprefix("mqtt://").split(":")
    sets = {"run.rounds": 3, "run.out": str(tmp_path / "run"), "model.name": "cnn", "data.eval": "digits",
            "clients.expected": 2, "clients.spawn": 0, "clients.round_timeout": 15.0,
            "transport.broker": mosquitto, "transport.prefix": prefix, "transport.max_message_bytes": 8192,
            "export.enabled": False}
    config = load_config(None, [(*k.split(".", 1), v) for k, v in sets.items()])
    states = [tmp_path / f"dev-{i}" for i in range(2)]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    procs = [subprocess.Popen(_client_cmd(mosquitto, prefix, i, states[i]), env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for i in range(2)]
    killed = threading.Event()

    def on_chunk(client, userdata, message):   # the first chunk of dev-0's round-2 result: kill it there
        if not killed.is_set() and seen_rounds[0] >= 1:
            procs[0].send_signal(signal.SIGKILL)
            killed.set()

    seen_rounds = [0]
    watcher = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"watch-{uuid.uuid4().hex[:8]}")
    watcher.on_message = on_chunk
    watcher.connect(host, int(port))
    watcher.subscribe(f"{prefix}/clients/dev-0/result")
    watcher.loop_start()
    outcome: dict = {}
    coordinator = threading.Thread(target=lambda: outcome.update(result=run_federated(config, say=lambda s: None)),
                                   daemon=True)
    coordinator.start()
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert time.monotonic() < deadline and coordinator.is_alive(), "round 1 never finished"
            time.sleep(0.05)
        seen_rounds[0] = 1
        assert killed.wait(60), "dev-0 never sent its round-2 result"
        procs[0].wait()
        procs[0] = subprocess.Popen(_client_cmd(mosquitto, prefix, 0, states[0]), env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        coordinator.join(180)
        assert "result" in outcome, "the run did not finish"
    finally:
        watcher.loop_stop()
        watcher.disconnect()
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
            proc.wait(30)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    assert all(r["returned"] == 2 for r in rows[1:])          # the restarted device answered its retried task
    assert rows[2]["attempts"] >= 1 and rows[-1]["test_accuracy"] > rows[0]["test_accuracy"] + 0.2
