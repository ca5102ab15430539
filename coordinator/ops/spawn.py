"""Local simulated clients: separate ``fedge-client`` processes, or in this process for inproc.

Each spawned process gets one torch thread (by default) so several clients on one
machine do not oversubscribe its cores, writes its log to ``OUT/logs``, and exits
by itself when the run finishes or when the coordinator process disappears.

Against an external broker, processes log in with the coordinator's user name and password,
unless ``transport.provision_dir`` names a directory from ``fedge-coordinator provision``: then
client i runs with the i-th device bundle there (its own client id, user name and password),
as a broker with ``use_username_as_clientid`` requires, and is named after that device.

In-process clients share one arrangement of the train split (each client's data is a
view of it) and run their tasks on ``sim.workers`` workers (coordinator/runtime/simulation.py),
or, with ``sim.workers = -1``, each on a thread of its own, as separate devices would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.config import RunConfig
from coordinator.errors import ConfigError
from coordinator.runtime.simulation import ClientPool, worker_count
from edge_client.app import App
from edge_client.bundle import BundleError, read_bundle
from edge_client.client import ClientSettings, EdgeClient
from edge_client.data import Dataset, arrange_clients
from edge_client.inputs import app_device_data
from edge_client.objectives import Objective, holdout_seed, local_data_view
from edge_client.wire.protocol import Topics
from edge_client.wire.transport import InprocHub

__all__ = ["SpawnedClients", "spawn_processes", "spawn_threads", "sim_client_id", "device_bundles"]


# After the last client process left: how long the coordinator still takes what was on its way.
_SETTLE_SECONDS = 0.5


def sim_client_id(index: int) -> str:
    return f"sim-{index:03d}"


@dataclass
class SpawnedClients:
    processes: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)
    clients: list[EdgeClient] = field(default_factory=list)   # those running in this process
    stop_event: threading.Event = field(default_factory=threading.Event)

    def failures(self) -> list[str]:
        """Descriptions of spawned processes that already exited with an error."""
        out = []
        for proc, log in zip(self.processes, self.logs):
            if proc.poll() not in (None, 0):
                tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-3:]
                out.append(f"client process {proc.pid} exited with {proc.returncode}: {' | '.join(tail)}")
        return out

    def stop(self, timeout: float = 20.0, *, meanwhile: Callable[[float], None] = time.sleep) -> None:
        """Wait up to ``timeout`` s in all for the clients to leave, then end those still there.

        Processes leave when they see the run's status (the coordinator announces it first), threads
        when told here. ``meanwhile(seconds)`` spends the wait; the coordinator's takes, and so
        acknowledges, what arrives for it: the leaving clients' last messages would otherwise wait
        unacknowledged until the broker gives up on them, noisily (amqtt after 5 s). It is called once
        more after the last process is gone, for messages still on their way.
        """
        self.stop_event.set()
        deadline = time.monotonic() + timeout
        while any(proc.poll() is None for proc in self.processes) and time.monotonic() < deadline:
            meanwhile(0.1)
        for proc in self.processes:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self.processes:
            meanwhile(_SETTLE_SECONDS)
        for thread in self.threads:
            thread.join(timeout=timeout)


def device_bundles(provision_dir: str | Path, count: int) -> list[tuple[str, Path]]:
    """(client id, bundle path) of the first ``count`` devices of a provisioning directory, in id order."""
    paths = sorted((Path(provision_dir) / "devices").glob("*.toml"))
    if len(paths) < count:
        raise ConfigError(f"transport.provision_dir {provision_dir} has {len(paths)} device bundles but "
                          f"{count} clients are to be spawned: provision at least {count} devices "
                          f"(fedge-coordinator provision --devices {count}) or spawn fewer")
    found = []
    for path in paths[:count]:
        try:
            found.append((read_bundle(path).client_id, path))
        except BundleError as exc:
            raise ConfigError(f"transport.provision_dir: {exc}") from None
    return found


def _tls_options(config: RunConfig, *, with_ca: bool) -> list[str]:
    t = config.transport
    pairs = [("--ca-file", t.ca_file if with_ca else ""), ("--cert-file", t.cert_file), ("--key-file", t.key_file)]
    return [item for flag, value in pairs if value for item in (flag, value)]


def spawn_processes(config: RunConfig, count: int, *, broker_url: str, protocol: str, username: str | None,
                    password: str | None, out_dir: Path,
                    device_logins: dict[str, str] | None = None) -> SpawnedClients:
    """Start ``count`` client processes on partitions 0..count-1 of the evaluation data spec.

    With ``transport.provision_dir`` each logs in with a device bundle of its own (the bundle's
    CA, user and password; ``broker_url``, the coordinator's, replaces the bundle's URL so a
    simulation on the broker's machine may use another of the names in its certificate).
    With ``device_logins`` (client id -> password, from the embedded broker) each logs in as
    itself, confined to its own topics; otherwise all share the coordinator's ``username``.
    """
    spawned = SpawnedClients()
    bundles = device_bundles(config.transport.provision_dir, count) if config.transport.provision_dir else None
    env = dict(os.environ)
    if password is not None and bundles is None:
        env["FEDGE_MQTT_PASSWORD"] = password
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        if bundles is not None:
            cid, bundle = bundles[i]
            login = ["--bundle", str(bundle), *_tls_options(config, with_ca=False)]
        else:
            cid = sim_client_id(i)
            login = [*(["--username", username] if username else []), *_tls_options(config, with_ca=True)]
        own_env = env
        if bundles is None and device_logins and cid in device_logins:
            login = ["--username", cid, *_tls_options(config, with_ca=True)]
            own_env = {**env, "FEDGE_MQTT_PASSWORD": device_logins[cid]}
        cmd = [sys.executable, "-m", "edge_client.cli", "run", "--broker", broker_url, "--client-id", cid, *login,
               *(["--app", config.app.module] if config.app.module else []),
               "--data", config.data.eval, "--partition", config.data.partition, "--partition-index", str(i),
               "--num-partitions", str(count), "--seed", str(config.run.seed),
               "--local-test-fraction", str(config.data.local_test_fraction),
               "--state-dir", str(out_dir / "clients" / cid), "--prefix", config.transport.prefix,
               "--mqtt-protocol", protocol, "--torch-threads", str(config.clients.torch_threads),
               "--max-message-bytes", str(config.transport.max_message_bytes),
               "--max-decoded-bytes", str(config.transport.max_decoded_bytes),
               *([] if config.transport.chunking else ["--no-chunking"]),
               "--exit-after-run", "--parent-pid", str(os.getpid())]
        log = out_dir / "logs" / f"{cid}.log"
        with open(log, "ab") as fh:
            spawned.processes.append(subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=own_env,
                                                      stdin=subprocess.DEVNULL))
        spawned.logs.append(log)
    return spawned


def spawn_threads(config: RunConfig, count: int, *, hub: InprocHub, dataset: Dataset | None,
                  out_dir: Path | None = None,
                  objectives: Callable[[str], Mapping[str, Objective]] | None = None,
                  app: App | None = None) -> SpawnedClients:
    """Run ``count`` clients inside this process, through the in-process transport.

    With ``out_dir`` each gets a state directory ``OUT/clients/ID``, as spawned processes do
    (methods that keep state on the device, such as a client's own branches, need one). ``objectives(client_id)``: the
    objectives that client runs instead of the registry's (:attr:`ClientSettings.objectives`). With ``app``, each
    loads its part of the app's data from ``data.eval`` as a spawned process does (``dataset`` is then unused).
    """
    spawned = SpawnedClients()
    ids = [sim_client_id(i) for i in range(count)]
    fraction, seed = config.data.local_test_fraction, config.run.seed
    if app is None:
        assert dataset is not None
        rows = arrange_clients(dataset, config.data.partition, count, seed, fraction,
                               [holdout_seed(seed, cid) for cid in ids])
    topics = Topics(config.transport.prefix)
    pool = ClientPool(hub, topics, worker_count(config.sim.workers)) if config.sim.workers != -1 else None
    for i, cid in enumerate(ids):
        settings = ClientSettings(client_id=cid, topics=topics,
                                  max_message_bytes=config.transport.max_message_bytes,
                                  max_decoded_bytes=config.transport.max_decoded_bytes,
                                  chunking=config.transport.chunking, exit_after_run=True,
                                  state_dir=out_dir / "clients" / cid if out_dir is not None else None,
                                  objectives=objectives(cid) if objectives is not None else {})
        transport = hub.connect(cid, will=EdgeClient.will(settings))
        data = (local_data_view(rows, i, fraction) if app is None else
                app_device_data(app, config.data.eval, fraction, seed=seed, client_id=cid,
                                partition=config.data.partition, partition_index=i, num_partitions=count))
        if pool is None:
            client = EdgeClient(settings, transport, data)
            thread = threading.Thread(target=client.run, args=(spawned.stop_event,), name=cid, daemon=True)
            thread.start()
            spawned.threads.append(thread)
        else:
            client = EdgeClient(settings, transport, data, models=pool.models, broadcasts=pool.broadcasts)
            pool.add(client)
        spawned.clients.append(client)
    if pool is not None:
        spawned.threads += pool.start(spawned.stop_event)
    return spawned
