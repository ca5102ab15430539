"""The processes a lab starts: one ``fedge-client run`` per device (in the device's cgroups and
namespace), the coordinator and the broker (outside, as on a laptop). Each carries the lab's id in
its environment (``FEDGE_LAB_ID``), which is how ``--cleanup`` finds them after a crash.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from coordinator.ops.mosquitto import mosquitto_binary

__all__ = ["LAB_ENV", "client_command", "start", "stop", "lab_pids", "start_broker"]

LAB_ENV = "FEDGE_LAB_ID"
# Joins the cgroups before `ip netns exec`, which remounts /sys and would hide them.
_JOIN = 'for d in "$@"; do [ "$d" = -- ] && break; echo $$ > "$d/cgroup.procs" || exit 97; shift; done; shift; exec "$@"'


def client_command(*, cgroup_dirs: list[Path], ns: str, broker: str, client_id: str, data: str, partition: str,
                   index: int, count: int, seed: int, state_dir: Path, prefix: str, threads: int) -> list[str]:
    """The device's process: join its cgroups, enter its namespace, run the real client."""
    client = [sys.executable, "-m", "edge_client.cli", "run", "--broker", broker, "--client-id", client_id,
              "--data", data, "--partition", partition, "--partition-index", str(index),
              "--num-partitions", str(count), "--seed", str(seed), "--state-dir", str(state_dir),
              "--prefix", prefix, "--torch-threads", str(threads), "--exit-after-run"]
    return ["sh", "-c", _JOIN, "lab-join", *map(str, cgroup_dirs), "--", "ip", "netns", "exec", ns, *client]


def start(cmd: list[str], log: Path, lab_id: str) -> subprocess.Popen:
    """Start ``cmd`` in a process group of its own (the lab, not the terminal, decides when it stops)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, LAB_ENV: lab_id, "OMP_WAIT_POLICY": "PASSIVE"}
    with open(log, "ab") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)


def stop(procs: list[subprocess.Popen], first: int = signal.SIGTERM, grace: float = 15.0) -> None:
    """Signal every process still running, wait up to ``grace`` s, then SIGKILL the rest."""
    for proc in procs:
        if proc.poll() is None:
            try:
                proc.send_signal(first)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def lab_pids(lab_id: str | None = None) -> list[int]:
    """Processes started by a lab (``lab_id``, or any lab), read from their environment."""
    found = []
    wanted = f"{LAB_ENV}={lab_id}".encode() if lab_id else f"{LAB_ENV}=".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(item.startswith(wanted) for item in env):
            found.append(int(entry.name))
    return found


def start_broker(workdir: Path, port: int, addresses: list[str], lab_id: str, timeout: float = 10.0) -> subprocess.Popen:
    """Mosquitto with a config file of the lab's own, listening on ``addresses`` only (loopback and the
    lab's bridge), anonymous (nothing outside the machine can reach the bridge)."""
    binary = mosquitto_binary()
    if binary is None:
        raise RuntimeError("mosquitto is not installed: apt-get install mosquitto (or make system-deps)")
    workdir.mkdir(parents=True, exist_ok=True)
    conf = workdir / "mosquitto.conf"
    lines = [f"listener {port} {address}" for address in addresses]
    lines += ["allow_anonymous true", "persistence false", "max_queued_messages 100000", "log_dest stderr",
              "log_type error", "log_type warning", "user root"]
    conf.write_text("\n".join(lines) + "\n", encoding="utf-8")
    proc = start([binary, "-c", str(conf)], workdir / "mosquitto.log", lab_id)
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((addresses[0], port), timeout=0.2).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop([proc])
                raise RuntimeError(f"mosquitto did not start: {(workdir / 'mosquitto.log').read_text().strip()}")
            time.sleep(0.05)
