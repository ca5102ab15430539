"""A real ``fedge-client`` process in a memory cgroup: capped too small for the task it refuses it with a
``memory:`` reason, which the coordinator counts as ``failed_memory``; capped at 512 MiB it trains the cnn.

Needs root and the cgroup v1 memory controller (/sys/fs/cgroup/memory); skipped otherwise, except in CI
(``CI`` set and root), where a missing controller is a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from coordinator.config import load_config
from test_client_cli import ENV, _Presence

V1 = Path("/sys/fs/cgroup/memory")
MIB = 2**20


def _cgroup_or_skip() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to create a memory cgroup")
    if not (V1 / "memory.limit_in_bytes").exists() or not os.access(V1, os.W_OK):
        message = f"no writable cgroup v1 memory controller at {V1}"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI runs this test as root)")
        pytest.skip(message)


class Cgroup:
    """A memory cgroup of our own, removed afterwards (its processes moved back to the root first)."""

    def __init__(self, limit: int) -> None:
        self.path = V1 / f"fedge-test-{uuid.uuid4().hex[:8]}"
        self.path.mkdir()
        self.limit = limit

    @property
    def limit(self) -> int:
        return int((self.path / "memory.limit_in_bytes").read_text())

    @limit.setter
    def limit(self, value: int) -> None:
        (self.path / "memory.limit_in_bytes").write_text(str(value))

    def used(self) -> int:
        return int((self.path / "memory.usage_in_bytes").read_text())

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                (V1 / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        self.path.rmdir()


def _device(mosquitto: str, prefix: str, client_id: str, state: Path, cgroup: Cgroup) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "edge_client.cli", "run", "--broker", mosquitto, "--client-id",
                             client_id, "--data", "digits", "--partition", "iid", "--num-partitions", "4",
                             "--partition-index", str(len(client_id) % 4), "--state-dir", str(state / client_id),
                             "--prefix", prefix, "--torch-threads", "1", "--exit-after-run"],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    cgroup.add(proc.pid)   # before it imports torch: all it allocates counts against the cap
    return proc


def test_a_capped_device_refuses_what_does_not_fit_and_trains_the_cnn_in_512_mib(mosquitto, prefix, tmp_path):
    _cgroup_or_skip()
    from coordinator.runtime.run import run_federated

    groups = {"tight": Cgroup(512 * MIB), "roomy": Cgroup(512 * MIB)}
    procs: dict[str, subprocess.Popen] = {}
    presence = _Presence(mosquitto, prefix)
    try:
        procs = {c: _device(mosquitto, prefix, c, tmp_path, g) for c, g in groups.items()}
        presence.wait(list(procs), "online", 120)
        tight = groups["tight"]
        tight.limit = tight.used() + 12 * MIB   # it has started; now far too little is left for the task
        out = tmp_path / "run"
        sets = {"run.rounds": 2, "run.out": str(out), "model.name": "cnn", "data.eval": "digits",
                "clients.expected": 2, "clients.min_results": 1, "clients.selection": "profile",
                "clients.round_timeout": 120.0, "transport.broker": mosquitto, "transport.prefix": prefix,
                "export.enabled": False}
        config = load_config(None, [(*k.split(".", 1), v) for k, v in sets.items()])
        outcome: dict = {}
        run = threading.Thread(target=lambda: outcome.update(result=run_federated(config, say=lambda s: None)),
                               daemon=True)
        run.start()
        run.join(300)
        errors = {c: p.communicate(timeout=60)[1] for c, p in procs.items()}
        assert "result" in outcome, f"the run did not finish; the devices said: {errors}"
    finally:
        presence.close()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for g in groups.values():
            g.remove()
    rows = {r["round"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    first, second = rows[1], rows[2]
    assert (first["selected"], first["returned"], first["failed"], first["failed_memory"]) == (2, 1, 1, 1), first
    assert (second["selected"], second["returned"], second["skipped"]) == (1, 1, ["tight"]), second
    assert "task failed: memory: this task needs about" in errors["tight"]
    refusal = json.loads((out / "clients" / "tight.jsonl").read_text().splitlines()[0])
    assert refusal["error"].startswith("memory:") and "are available on this device" in refusal["error"]
    trained = [json.loads(line) for line in (out / "clients" / "roomy.jsonl").read_text().splitlines()]
    assert all(t["error"] is None and 0 < t["profile"]["peak_rss_bytes"] < 512 * MIB for t in trained)
