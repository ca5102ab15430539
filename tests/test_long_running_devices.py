"""Coordinators against devices that outlive them: long-running `fedge-client run` processes over a
real Mosquitto, as on a real fleet (spawned clients die with their coordinator and hide these faults)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

DEVICES = ("dev-a", "dev-b", "dev-c")


class Fleet:
    """Device processes started once, killed only at the end of the test."""

    def __init__(self, broker: str, prefix: str, logs: Path) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        logs.mkdir(parents=True, exist_ok=True)
        for i, device in enumerate(DEVICES):
            cmd = [sys.executable, "-m", "edge_client.cli", "run", "--broker", broker, "--client-id", device,
                   "--data", "digits", "--partition", "iid", "--partition-index", str(i),
                   "--num-partitions", str(len(DEVICES)), "--seed", "7", "--prefix", prefix,
                   "--state-dir", str(logs / device), "--torch-threads", "1", "-v"]
            with open(logs / f"{device}.log", "wb") as log:
                self.procs[device] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.logs = logs

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def log(self, device: str) -> str:
        return (self.logs / f"{device}.log").read_text(errors="replace")


@pytest.fixture
def fleet(tmp_path, mosquitto, prefix):
    devices = Fleet(mosquitto, prefix, tmp_path / "devices")
    yield devices
    devices.stop()


def coordinator_cmd(out: Path, broker: str, prefix: str, rounds: int, *extra: str) -> list[str]:
    """A coordinator for the fleet: it spawns nobody and waits for the three devices."""
    return [sys.executable, "-m", "coordinator.ui.cli", "run", "--data", "digits", "--model", "cnn",
            "--rounds", str(rounds), "--clients", str(len(DEVICES)), "--broker", broker, "--seed", "7",
            "--out", str(out), "--set", f"transport.prefix={prefix}", "--set", "train.epochs=1",
            "--set", "export.enabled=false", *extra]


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, f"the coordinator ended before {path.name}"
        time.sleep(0.05)


def test_a_resumed_run_goes_on_with_the_devices_that_saw_later_rounds(tmp_path, mosquitto, prefix, fleet):
    """Killed while round 4 trains and round 3's evaluation runs beside it, the coordinator resumes from
    round 2's checkpoint: the devices, which saw round 4, must run round 3 again, at once."""
    out, timeout = tmp_path / "run", 40.0
    cmd = coordinator_cmd(out, mosquitto, prefix, 6, "--set", f"clients.round_timeout={timeout}",
                          "--set", "train.epochs=5")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with StatusWatch(mosquitto, prefix, kill_at=(4, proc.pid)) as watch:
        deadline = time.monotonic() + 180
        while watch.round < 4:
            assert proc.poll() is None and time.monotonic() < deadline, "the coordinator never reached round 4"
            time.sleep(0.02)
    proc.wait()
    assert not (out / "checkpoints" / "round_0004.safetensors").exists()
    (out / "checkpoints" / "round_0003.safetensors").unlink(missing_ok=True)   # round 3's evaluation unfinished
    started = time.monotonic()
    resumed = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=600)
    took = time.monotonic() - started
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert fleet.alive(), "a device died"
    table = rows(out)
    assert [r["round"] for r in table] == list(range(7))
    for row in table[2:]:
        assert (row["attempts"], row["returned"]) == (1, 3), row
        assert row["seconds"] < timeout / 2, row   # no attempt waited its timeout
    assert took < 3 * timeout, took
    log = (out / "coordinator.log").read_text()
    assert "was not given to this client" not in log
    # each result of a task the killed coordinator gave is counted (and logged) once at most
    late_lines = [line for line in log.splitlines() if "late result" in line]
    assert len(late_lines) == len({line.split("task ")[1].split()[0] for line in late_lines}), late_lines
    assert sum(r["late"] for r in table[2:]) == len(late_lines)


class StatusWatch:
    """The newest running round the coordinator announced, as devices see it; ``kill_at=(round, pid)``:
    SIGKILL that process the moment the round is announced."""

    def __init__(self, broker: str, prefix: str, kill_at: tuple[int, int] | None = None) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        from edge_client.wire.protocol import decode

        self.round = 0
        host, port = broker.removeprefix("mqtt://").split(":")
        self.client = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)

        def on_message(client, userdata, message) -> None:
            self.round = max(self.round, decode(message.payload).round)
            if kill_at is not None and self.round >= kill_at[0]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(kill_at[1], signal.SIGKILL)

        self.client.on_message = on_message
        self.client.on_connect = lambda c, u, f, r, p: c.subscribe(f"{prefix}/coordinator/status", qos=1)
        self.client.connect(host, int(port))

    def __enter__(self) -> "StatusWatch":
        self.client.loop_start()
        return self

    def __exit__(self, *exc) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def retained_status(broker: str, prefix: str) -> dict:
    """The run status the broker holds for devices that connect later."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    from edge_client.wire.protocol import decode

    got: list[bytes] = []
    host, port = broker.removeprefix("mqtt://").split(":")
    watcher = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    watcher.on_message = lambda c, u, m: got.append(m.payload)
    watcher.on_connect = lambda c, u, f, r, p: c.subscribe(f"{prefix}/coordinator/status", qos=1)
    watcher.connect(host, int(port))
    watcher.loop_start()
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    watcher.loop_stop()
    watcher.disconnect()
    assert got, "no retained run status"
    msg = decode(got[-1])
    return {"run_id": msg.run_id, "round": msg.round, **msg.body}


def forged_result(run_id: str, task_id: str) -> bytes:
    """A well-formed result of another run, as a device that trained a dead run's task sends it."""
    import torch

    from edge_client.wire.protocol import ResultBody, encode

    return encode("result", run_id=run_id, round=3, task_id=task_id, sender="dev-a",
                  body=ResultBody(num_samples=100).to_body(), tensors={"w": torch.zeros(50_000)})


def test_sigterm_stops_the_run_cleanly_and_a_next_run_counts_only_its_own_results(tmp_path, mosquitto, prefix,
                                                                                 fleet):
    out = tmp_path / "first"
    proc = subprocess.Popen(coordinator_cmd(out, mosquitto, prefix, 30), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for(out / "checkpoints" / "round_0002.safetensors", proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stdout + stderr
    assert f"fedge-coordinator run --resume --out {out}" in stdout.replace("\n", "")
    assert "stopped by SIGTERM" in (out / "coordinator.log").read_text()
    status = retained_status(mosquitto, prefix)
    assert status["state"] == "stopped"
    first_run = status["run_id"]

    # A device that trained the dead run's task sends its result while the next run goes.
    import paho.mqtt.publish as publish

    host, port = mosquitto.removeprefix("mqtt://").split(":")
    second = tmp_path / "second"
    proc = subprocess.Popen(coordinator_cmd(second, mosquitto, prefix, 2), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while retained_status(mosquitto, prefix)["run_id"] == first_run:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    for i in range(3):
        publish.single(f"{prefix}/clients/dev-a/result", forged_result(first_run, f"old{i}"), qos=1,
                       hostname=host, port=int(port))
    assert proc.wait(timeout=300) == 0
    assert fleet.alive()
    for row in rows(second)[1:]:
        assert (row["late"], row["rejected"], row["unexpected"]) == (0, 0, 0), row
        per_client = row["bytes_per_client"]
        assert per_client["dev-a"]["up"] < 1.5 * per_client["dev-b"]["up"], per_client


def test_a_device_that_announces_itself_and_vanishes_cannot_end_the_run(tmp_path, mosquitto, prefix, fleet):
    """An authorised device publishes a retained online presence with a huge sample count, then leaves
    cleanly (no will): it is never seen offline, and every task it is given waits out the timeout."""
    import paho.mqtt.publish as publish

    from edge_client.client import presence_payload
    from edge_client.wire.protocol import PresenceBody

    host, port = mosquitto.removeprefix("mqtt://").split(":")
    liar = presence_payload("liar", PresenceBody("online", num_samples=1_000_000_000, input_shape=(1, 8, 8),
                                                 num_classes=10))
    publish.single(f"{prefix}/clients/liar/presence", liar, qos=1, retain=True, hostname=host, port=int(port))
    out, timeout, rounds = tmp_path / "run", 6.0, 8
    done = subprocess.run(coordinator_cmd(out, mosquitto, prefix, rounds, "--set", f"clients.round_timeout={timeout}",
                                          "--set", "clients.per_round=3", "--set", "clients.expected=4"),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    table = rows(out)
    assert [r["round"] for r in table] == list(range(rounds + 1))
    assert all(r["returned"] == 3 for r in table[1:])
    # The liar costs at most clients.max_misses (2) attempts their timeout, then is left out.
    assert sum(r["attempts"] - 1 for r in table[1:]) <= 2, [r["attempts"] for r in table]
    assert "client liar left 2 tasks in a row unanswered" in (out / "coordinator.log").read_text()
