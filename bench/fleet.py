"""A fleet on one coordinator: what N devices cost the coordinator and the broker.

The coordinator is the real one (``coordinator.runtime.run.run_federated`` in a child process:
FedAvg, ``cnn`` on Fashion-MNIST, 1.69 MB of float32 parameters) and the broker is a
Mosquitto of its own, started fresh for every cell so that its memory is the cell's.
The devices are stand-ins that do not train but run the device's own code
(``bench/fleet_devices.py``): each is an ``edge_client.device_shell.DeviceShell`` (the device
protocol: presence, the run status, which tasks run, fetching the round's model broadcast over
MQTT itself, sending the result every ``resend_every`` seconds until the coordinator acknowledges
it; the result encoding: the task's upload codec, differences from what was sent down, the
envelope, chunks through ``ChunkingTransport``) over its own ``MqttTransport`` and client id
(MQTT 5, persistent session, last will, QoS 1), all connections of a device process driven by
one ``edge_client.wire.shared_loop.SharedLoop`` thread. Only the trainer is the bench's: a think
time drawn from ``--think`` in place of training, then the tensors sent down plus a fixed
perturbation (``bench/fleet_devices.py`` says why a process holds hundreds of such devices
cheaply). Devices import torch because the wire code works on tensors, not to train.

Definitions (also written into the JSON):

* **round overhead** = the coordinator's ``seconds`` for the round (its ``metrics.jsonl``
  row: run status, selection, broadcast, tasks, waiting for results, aggregation) minus
  the longest think time among the devices that got a task in that round (their own
  records). It is the time the round took beyond what its slowest device's work forced:
  task and model delivery, decoding and encoding on the devices, the upload, the
  coordinator's decoding, folding and acknowledgements.
* **coordinator CPU s/round**: the coordinator process's CPU time (all threads) during
  ``Coordinator.train_round``, read at the engine's round start and end events
  (``on_progress``, kind ``round``); the coordinator runs unmodified.
* **peak RSS**: the highest resident set size seen by sampling the coordinator and the
  Mosquitto processes with psutil every 0.2 s, over the whole cell and during the rounds
  only (from the start of round 1 to the end of the last, which leaves out the
  coordinator's data loading and its test-set evaluations).
* **messages and MB per round**: every MQTT publish the devices sent or were delivered
  (tasks, model chunks, acknowledgements, run status, result chunks, re-sends), counted
  at the devices by the coordinator's round they fell in; their payload bytes. The
  coordinator's own ``bytes_down + bytes_up`` (model broadcast once, tasks, results)
  is reported beside it.
* **lost, late, rejected, dropped**: selected minus returned, and the ``late``,
  ``rejected`` and ``inbox_dropped`` counts of the coordinator's rows, summed over rounds.

Sites (``--sites K``, docs/sites.md): the fleet split over K site brokers, device i on
site i % K, each site broker bridged to the central broker by Mosquitto's own bridge with
the section ``fedge-coordinator provision --sites`` writes (``bridge_conf`` over
``bridged_topics``: MQTT 3.1.1, ``cleansession false``; without TLS and passwords, on
loopback). Each bridge reaches the centre through a forwarder of this process that counts
the bytes of that uplink each way (``bench/counting_link.py``); the coordinator stays on
the central broker. ``--site-aggregators on`` adds a site aggregator per site (the real
``fedge-coordinator worker --id agg-site-S`` on its site broker, as
``sites/NAME/aggregator.toml`` starts it) and runs the coordinator with ``workers.count = K``
and ``workers.direct_results = true``: the uplinks then carry claims and one partial sum per
site and round instead of every result. Per cell and site: the uplink's bytes up and down
per round, and the CPU seconds and peak RSS of the site broker and the site aggregator. A
device process connects its devices ``CONNECT_WINDOW`` at a time (each waits for its
CONNACK), so 10,000 devices do not overrun a broker's listen backlog at once.

This machine runs the coordinator, Mosquitto and every device process on the same cores,
so device work (model fetch, encoding) competes with the coordinator for CPU; the devices'
CPU seconds per round are reported so that share is visible.

    python bench/fleet.py [--fleet 10,100,300,1000] [--per-round tenth,all] [--codec-up fp32]
        [--rounds 3] [--processes 4] [--think lognormal:2:0.5] [--skip-existing]
    python bench/fleet.py --fleet 10,50,100,300 --secagg off,on [--secagg-drop 0,0.1] --out FILE   # secure rounds
    python bench/fleet.py --fleet 1000 --per-round all --sites 0,4 --site-aggregators off,on --out FILE   # sites
    python bench/fleet.py --table        # the table of bench/results/fleet.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench_io import RESULTS, write_result
from counting_link import CountingLink
from edge_client.wire.chunking import DEFAULT_PACKET_BYTES

if TYPE_CHECKING:   # annotations only: a device process imports these when it starts
    from coordinator.ops.sites import Site

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = RESULTS / "fleet.json"
DEFAULT_PLOT = ROOT / "docs" / "images" / "fleet.png"
PREFIX = "fleet"
WORKERS_PACKET_BYTES = 8 * 1024 * 1024   # devices' and coordinator's max_message_bytes with aggregation workers
CONNECT_WINDOW = 64          # devices of a process waiting for their CONNACK at once: the fleet connects in waves
SAMPLE_EVERY = 0.2          # seconds between psutil samples of the coordinator, broker and devices
TRAIN_IMAGES = 60_000       # Fashion-MNIST's train split, shared out as each device's num_samples
DEFINITIONS = {
    "overhead_s": "metrics.jsonl 'seconds' of the round minus the longest think time among the devices that got "
                  "a task in that round: what the round took beyond its slowest device's work",
    "coordinator_cpu_s_per_round": "CPU seconds of the coordinator process (all threads) inside "
                                   "Coordinator.train_round, mean over rounds",
    "peak_rss_mb": "highest RSS seen by psutil sampling every 0.2 s over the whole cell (MB = 2**20 bytes); "
                   "'_rounds': only between the start of round 1 and the end of the last round, which leaves out "
                   "the coordinator's start (data loading) and its test-set evaluations of rounds 0 and the last",
    "messages_per_round": "MQTT publishes the devices sent plus those delivered to them, counted at the devices "
                          "per coordinator round, mean over rounds",
    "mb_per_round": "payload bytes of those messages / 1e6, mean over rounds",
    "coordinator_mb_per_round": "metrics.jsonl bytes_down + bytes_up / 1e6, mean over rounds",
    "lost": "sum over rounds of selected - returned",
    "late, rejected, duplicates, failed": "metrics.jsonl counters summed over rounds",
    "inbox_dropped": "messages the coordinator's receive queue dropped, summed over rounds",
    "coordinator_torch_threads": "0: the coordinator as it runs (torch's default threads); N: a variant measured "
                                 "with torch.set_num_threads(N) in the coordinator process",
    "workers": "0: the coordinator takes every result itself; K: K aggregation worker processes share the results "
               "(MQTT 5 shared subscription), check and fold them, and send the coordinator partial sums; results "
               "unchunked (max_message_bytes 8 MiB on devices and coordinator)",
    "workers_cpu_s_per_round": "CPU seconds of all worker processes between the start and end of each round",
    "device_cpu_s_per_round": "CPU seconds of all device processes between the start and end of each round "
                              "(psutil samples), mean over rounds",
    "sites": "0: every device on the central broker; K: K site brokers (LocalMosquitto, anonymous, loopback), "
             "device i on site i % K, each bridged to the central broker with the bridge section provisioning "
             "writes (bridged_topics, MQTT 3.1.1, cleansession false, no TLS) through a byte-counting forwarder",
    "site_aggregators": "an aggregation worker (fedge-coordinator worker --id agg-site-S) on each site broker; the "
                        "coordinator with workers.count = K and workers.direct_results = true; results chunked as "
                        "without workers (a site's lone aggregator gets every chunk)",
    "uplink_bytes_up, uplink_bytes_down": "per round and site: bytes the site's bridge connection carried to and "
                                          "from the central broker (TCP payload: MQTT packets with headers), "
                                          "between the round's start and end (the coordinator's clock; the "
                                          "forwarder stamps each count to the millisecond)",
    "uplink_mb_per_round_up, uplink_mb_per_round_down": "those bytes summed over sites / 1e6, mean over rounds",
    "uplink_bytes_cell": "each uplink's bytes over the whole cell (connection, presence, evaluations included)",
    "site_broker_cpu_s_per_round, site_aggregator_cpu_s_per_round": "per site: CPU seconds of that process "
                                                                    "between the start and end of each round, "
                                                                    "mean over rounds",
    "site_broker_peak_rss_mb, site_aggregator_peak_rss_mb": "per site: highest RSS sampled over the whole cell",
    "bench_cpu_s_per_round": "CPU seconds of the bench's own process per round: the uplink forwarders' threads "
                             "(and the sampling), which share the cores with everything else",
    "worker_lost": "results granted to a worker whose partial sum never came (metrics.jsonl), summed over rounds",
    "devices_connected_s": "from the first device's connection attempt until every device had connected once "
                           f"(each process connects its devices {CONNECT_WINDOW} at a time)",
    "site_aggregator_stats": "each site aggregator's closing counters (its 'worker done' line)",
}


# ----------------------------------------------------------------------------- think time

@dataclass(frozen=True)
class Think:
    """A think-time distribution in seconds: ``lognormal:MEDIAN:SIGMA``, ``uniform:A:B`` or ``fixed:S``.

    Lognormal is the default because device round times are skewed: most devices are close
    to the median and a few are much slower, and the slowest one sets the round's length.
    """

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Think:
        kind, _, rest = text.partition(":")
        try:
            values = [float(v) for v in rest.split(":")] if rest else []
        except ValueError:
            raise argparse.ArgumentTypeError(f"--think {text!r}: the parameters must be numbers") from None
        wanted = {"lognormal": 2, "uniform": 2, "fixed": 1}
        if kind not in wanted or len(values) != wanted[kind]:
            raise argparse.ArgumentTypeError(f"--think {text!r}: use lognormal:MEDIAN:SIGMA, uniform:A:B or fixed:S")
        if any(v < 0 for v in values) or (kind == "lognormal" and values[0] <= 0) or \
                (kind == "uniform" and values[1] < values[0]):
            raise argparse.ArgumentTypeError(f"--think {text!r}: seconds must be >= 0 (median > 0, A <= B)")
        return cls(kind, *values)

    @property
    def text(self) -> str:
        return f"{self.kind}:{self.a:g}" + (f":{self.b:g}" if self.kind != "fixed" else "")

    def draw(self, rng: random.Random) -> float:
        if self.kind == "lognormal":
            return rng.lognormvariate(math.log(self.a), self.b)
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b)
        return self.a


def raise_open_files(needed: int) -> int:
    """Raise this process's soft limit on open files (children, Mosquitto among them, inherit it).

    Mosquitto needs one descriptor per connection and a device process one per device; a
    common soft limit of 1024 would stop a 1000-device fleet at the broker.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = max(soft, needed) if hard == resource.RLIM_INFINITY else min(hard, max(soft, needed, 65536))
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        raise SystemExit(f"this fleet needs {needed} open files but the hard limit is {hard}: raise it (ulimit -Hn)")
    return target


# ----------------------------------------------------------------------------- the device processes

def devices_child(spec_path: Path) -> int:
    """A device process: serve the fleet slice in ``spec_path`` until the run finishes, then write records."""
    from fleet_devices import Fleet, quiet

    spec = json.loads(spec_path.read_text())
    quiet()
    raise_open_files(len(spec["ids"]) + 64)
    stopping = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stopping.__setitem__("now", True))
    started = time.time()
    fleet = Fleet(spec["brokers"], spec["ids"], Think.parse(spec["think"]), spec["seed"], spec["samples"],
                  prefix=PREFIX, connect_window=CONNECT_WINDOW,
                  max_message_bytes=spec.get("max_message_bytes", DEFAULT_PACKET_BYTES), drop=spec.get("drop", 0.0))
    try:
        fleet.run(lambda: stopping["now"])
    finally:
        fleet.leave()
        out = {"ids": len(spec["ids"]), "started": started, "connecting": fleet.connecting_at,
               "connected": fleet.connected_at, "ended": time.time(),
               "finished": sum(d.finished for d in fleet.devices), "counts": fleet.totals(),
               "traffic": {str(k): v for k, v in sorted(fleet.traffic.items())},
               "cpu_s": time.process_time(), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               "tasks": [asdict(r) for d in fleet.devices for r in d.records]}
        Path(spec["records"]).write_text(json.dumps(out))
    return 0


# ----------------------------------------------------------------------------- the coordinator process

class CoordinatorWatch:
    """The coordinator child's ``on_progress``: each round's wall time, CPU time and memory read at the
    engine's round events (kind ``round``, which bound ``Coordinator.train_round`` on its thread), one
    line per round in ``timing``; and a one-line status in ``status`` for the parent to print."""

    def __init__(self, timing: Path, status: Path) -> None:
        import psutil

        self.timing, self.status = timing, status
        self.me = psutil.Process()
        self.marks: dict[int, dict[str, Any]] = {}   # round -> its start readings, until it ends
        self.shown: tuple[float, Any] = (0.0, None)

    def __call__(self, info: dict[str, Any]) -> None:
        if info.get("kind") == "round":
            self._round(info)
        elif info.get("kind") in ("waiting", "exchange"):
            self._status(info)

    def _round(self, info: dict[str, Any]) -> None:
        if info["phase"] == "start":
            self.marks[info["round"]] = {"round": info["round"], "wall_start": time.time(),
                                         "cpu_start": time.process_time(),
                                         "rss_start_mb": self.me.memory_info().rss / 2**20}
            return
        mark = self.marks.pop(info["round"], None)
        if mark is None:
            return
        mark.update(wall_end=time.time(), cpu_end=time.process_time(),
                    rss_end_mb=self.me.memory_info().rss / 2**20, seconds=info["seconds"])
        with self.timing.open("a") as fh:
            fh.write(json.dumps(mark) + "\n")

    def _status(self, info: dict[str, Any]) -> None:
        """Clients online, or results of the round so far: a new stage at once, the same one once a second."""
        if info["kind"] == "waiting":
            line = {"kind": "waiting", "online": len(info["online"]), "needed": info["needed"]}
        else:
            line = {"kind": "exchange", "round": info["round"], "attempt": info["attempt"],
                    "results": info["results"], "selected": info["selected"]}
        now = time.monotonic()
        key = (line["kind"], line.get("round"), line.get("attempt"))
        if key != self.shown[1] or now - self.shown[0] > 1.0:
            self.shown = (now, key)
            self.status.write_text(json.dumps({**line, "wall": time.time()}))


def coordinator_child(spec_path: Path) -> int:
    """The real coordinator (``run_federated``) as it runs, watched only through its ``on_progress``."""
    from coordinator.config import load_config
    from coordinator.runtime.run import run_federated

    spec = json.loads(spec_path.read_text())
    if spec.get("torch_threads"):   # a measured variant (--coordinator-torch-threads); normally left alone
        import torch

        torch.set_num_threads(spec["torch_threads"])
    config = load_config(None, [tuple(k.split(".", 1)) + (v,) for k, v in spec["overrides"].items()])
    run_federated(config, say=lambda s: print(s, flush=True),
                  on_progress=CoordinatorWatch(Path(spec["timing"]), Path(spec["status"])))
    return 0


# ----------------------------------------------------------------------------- one cell

@dataclass(frozen=True)
class Cell:
    fleet: int
    per_round: int
    codec: str
    threads: int = 0          # the coordinator's torch threads; 0: torch's default, as the coordinator runs
    workers: int = 0          # aggregation workers (fedge-coordinator worker); 0: the coordinator takes every result
    secagg: bool = False      # secure aggregation (SecAgg+, [secagg] enabled): four exchanges a round
    drop: float = 0.0         # secure rounds: share of a round's devices that fail at the mask stage
    sites: int = 0            # site brokers bridged to the central one, the fleet split over them; 0: flat
    site_aggregators: bool = False   # an aggregation worker on each site broker keeps its site's results

    @property
    def key(self) -> str:
        return (f"{self.fleet}/{self.per_round}/{self.codec}" + (f"/threads={self.threads}" if self.threads else "")
                + (f"/workers={self.workers}" if self.workers else "") + ("/secagg" if self.secagg else "")
                + (f"/drop={self.drop:g}" if self.drop else "")
                + (f"/sites={self.sites}" + ("+aggregators" if self.site_aggregators else "") if self.sites else ""))

    @property
    def topology(self) -> str:
        """How the fleet reaches the coordinator, in words (empty for the flat topology)."""
        if not self.sites:
            return ""
        return f"{self.sites} sites" + (" with aggregators" if self.site_aggregators else " (results up the bridges)")

    @property
    def variant(self) -> bool:
        """A measured variant, kept apart from the coordinator as it runs by default (table only, no plot)."""
        return bool(self.threads or self.workers)

    @classmethod
    def of(cls, result: dict[str, Any]) -> Cell:
        """The cell a result in the JSON belongs to."""
        return cls(result["fleet"], result["per_round"], result["codec_up"], result.get("coordinator_torch_threads", 0),
                   result.get("workers", 0), result.get("secagg", False), result.get("drop", 0.0),
                   result.get("sites", 0), result.get("site_aggregators", False))


class Sampler:
    """psutil readings of named processes every :data:`SAMPLE_EVERY` seconds: peak RSS and CPU over time."""

    def __init__(self) -> None:
        self.procs: dict[str, Any] = {}
        self.peak: dict[str, float] = {}
        self.series: dict[str, list[tuple[float, float, float]]] = {}   # name -> (wall, rss MB, cpu s)

    def watch(self, name: str, pid: int) -> None:
        import psutil

        self.procs[name] = psutil.Process(pid)
        self.series[name] = []

    def sample(self) -> None:
        import psutil

        now = time.time()
        for name, proc in self.procs.items():
            try:
                rss = proc.memory_info().rss / 2**20
                cpu = sum(proc.cpu_times()[:2])
            except psutil.Error:
                continue
            self.peak[name] = max(self.peak.get(name, 0.0), rss)
            self.series[name].append((now, rss, cpu))

    def at(self, name: str, wall: float, column: int) -> float | None:
        """The reading of ``name`` nearest before ``wall`` (column 1: RSS MB, 2: CPU s)."""
        before = [s for s in self.series.get(name, []) if s[0] <= wall]
        if before:
            return before[-1][column]
        return self.series[name][0][column] if self.series.get(name) else None

    def peak_between(self, name: str, start: float, end: float) -> float | None:
        """The highest RSS (MB) of ``name`` sampled between two wall times."""
        inside = [s[1] for s in self.series.get(name, []) if start <= s[0] <= end]
        return max(inside) if inside else None

    def after(self, name: str, wall: float, column: int) -> float | None:
        later = [s for s in self.series.get(name, []) if s[0] >= wall]
        if later:
            return later[0][column]
        return self.series[name][-1][column] if self.series.get(name) else None

    def cpu(self, name: str, start: float, end: float) -> float:
        """CPU seconds of ``name`` from the last sample before ``start`` to the first after ``end``: a round's
        share, to a sample (0.2 s) either way."""
        return (self.after(name, end, 2) or 0.0) - (self.at(name, start, 2) or 0.0)


def _say(text: str) -> None:
    print(text, flush=True)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _toml_value(value: Any) -> str:
    """How ``--set`` reads a value: strings as typed, the rest as TOML (which JSON's scalars are)."""
    return value if isinstance(value, str) else json.dumps(value)


def run_cell(cell: Cell, args: argparse.Namespace) -> dict[str, Any]:
    """Broker, coordinator and device processes for one (N, per round, codec); their measurements."""
    from coordinator.ops.mosquitto import LocalMosquitto

    n, tag = cell.fleet, f"[N={cell.fleet} per round={cell.per_round} {cell.codec}" + \
        (f" coordinator torch threads={cell.threads}" if cell.threads else "") + \
        (f" {cell.workers} workers" if cell.workers else "") + (f" {cell.topology}]" if cell.sites else "]")
    processes = max(1, min(args.processes, n))
    raise_open_files(n + 256)   # the most any one process here holds: a flat broker, or all the sites' devices
    work = Path(tempfile.mkdtemp(prefix="fedge-fleet-"))
    began = time.time()
    # Mosquitto's listener takes any number of connections (max_connections -1, its default, said
    # explicitly); the open-file limit raised above is what it inherits.
    broker = LocalMosquitto(workdir=work / "mosquitto", extra_config="max_connections -1\n")
    url = broker.start()
    sampler = Sampler()
    sampler.watch("broker", broker.pid)   # the broker this cell started: sampled and stopped by PID
    children: list[subprocess.Popen] = []
    ids = [f"dev-{i:04d}" for i in range(n)]
    sites = bench_sites(cell, ids)
    site_brokers: list[Any] = []
    uplinks: dict[str, CountingLink] = {}
    brokers = [url] * n   # device i logs in to brokers[i]: the central broker, or site i % K's
    overrides = {
        "run.strategy": "fedavg", "run.rounds": args.rounds, "run.seed": args.seed, "run.out": str(work / "run"),
        "model.name": "cnn", "data.eval": "fashion-mnist", "clients.expected": n, "clients.per_round": cell.per_round,
        "clients.round_timeout": args.round_timeout, "clients.presence_timeout": args.presence_timeout,
        "eval.every": args.rounds, "export.enabled": False, "checkpoint.keep": "last",
        "transport.broker": url, "transport.prefix": PREFIX, "codec.up": cell.codec, "codec.error_feedback": False,
    }
    if cell.secagg:
        overrides.update({"secagg.enabled": True, "secagg.stage_timeout": args.stage_timeout})
        if cell.drop:   # the survivors make the round: without this it waits for all and retries
            overrides["clients.min_results"] = max(3, cell.per_round // 2)
    if cell.workers:   # results must arrive whole: a shared subscription hands out each chunk on its own
        overrides.update({"workers.count": cell.workers, "transport.max_message_bytes": WORKERS_PACKET_BYTES})
    if cell.site_aggregators:   # as provisioning writes it: the site aggregators, and the results that reach the centre
        overrides.update({"workers.count": cell.sites, "workers.direct_results": True})
    coord_spec = {"overrides": overrides, "timing": str(work / "timing.jsonl"), "status": str(work / "status.json"),
                  "torch_threads": cell.threads}
    (work / "coordinator.json").write_text(json.dumps(coord_spec))
    log = (work / "coordinator.out").open("w")
    failure = ""
    try:
        for s, site in enumerate(sites):   # each bridge up before any device logs in to its site
            uplinks[site.name], site_broker = start_site(site, broker.port, work / site.name)
            site_brokers.append(site_broker)
            sampler.watch(f"{site.name}-broker", site_broker.pid)
            brokers[s::len(sites)] = [site_broker.url] * len(site.devices)
            if site.aggregator_user:   # the site's aggregation worker, on its site broker
                aggregator = subprocess.Popen(
                    [sys.executable, "-m", "coordinator.ui.cli", "worker", "--id", site.aggregator_user,
                     "--exit-after-run", *(a for k, v in {**overrides, "transport.broker": site_broker.url}.items()
                                           for a in ("--set", f"{k}={_toml_value(v)}"))],
                    cwd=ROOT, stdout=(work / f"{site.name}-aggregator.out").open("w"), stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL)
                children.append(aggregator)
                sampler.watch(f"{site.name}-aggregator", aggregator.pid)
        if sites:
            sampler.watch("bench", os.getpid())   # the uplink forwarders are threads of this process
        for i in range(cell.workers):   # before the coordinator, which waits for them
            worker = subprocess.Popen([sys.executable, "-m", "coordinator.ui.cli", "worker", "--id", f"worker-{i}",
                                       "--exit-after-run", *(a for k, v in overrides.items()
                                                          for a in ("--set", f"{k}={_toml_value(v)}"))],
                                      cwd=ROOT, stdout=(work / f"worker-{i}.out").open("w"), stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL)
            children.append(worker)
            sampler.watch(f"worker-{i}", worker.pid)
        coordinator = subprocess.Popen([sys.executable, __file__, "--coordinator-child", str(work / "coordinator.json")],
                                       cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        children.insert(0, coordinator)   # children[0]: the coordinator; then workers and devices
        sampler.watch("coordinator", coordinator.pid)
        for p in range(processes):
            part = ids[p::processes]
            spec = {"brokers": brokers[p::processes], "ids": part, "think": args.think.text, "seed": args.seed,
                    "samples": max(1, TRAIN_IMAGES // n), "records": str(work / f"devices-{p}.json"), "drop": cell.drop,
                    "max_message_bytes": WORKERS_PACKET_BYTES if cell.workers else DEFAULT_PACKET_BYTES}
            (work / f"devices-{p}.spec.json").write_text(json.dumps(spec))
            child = subprocess.Popen([sys.executable, __file__, "--devices-child", str(work / f"devices-{p}.spec.json")],
                                     cwd=ROOT, stdout=(work / f"devices-{p}.out").open("w"), stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
            children.append(child)
            sampler.watch(f"devices-{p}", child.pid)
        _say(f"{tag} broker {url}, coordinator pid {coordinator.pid}, {processes} device processes"
             + "".join(f", {site.name} {b.url} (bridge via :{uplinks[site.name].port})"
                       for site, b in zip(sites, site_brokers)))
        deadline = time.monotonic() + args.cell_timeout
        last_line, last_kind, shown_at, status_path = "", None, 0.0, work / "status.json"
        while coordinator.poll() is None:
            sampler.sample()
            if time.monotonic() > deadline:
                failure = f"stopped after --cell-timeout {args.cell_timeout:.0f} s; the rounds finished by then are kept"
                break
            dead = [c for c in children[1:] if c.poll() not in (None, 0)]   # 0: it saw the run finish
            if dead:
                failure = f"a device process failed (exit {dead[0].returncode})"
                break
            try:
                status = json.loads(status_path.read_text())
            except (OSError, ValueError):
                status = None
            if status is not None:
                line = (f"{tag} waiting: {status['online']}/{status['needed']} online" if status["kind"] == "waiting"
                        else f"{tag} round {status['round']} (attempt {status['attempt']}): "
                             f"{status['results']}/{status['selected']} results")
                kind = (status["kind"], status.get("round"), status.get("attempt"))
                if line != last_line and (kind != last_kind or time.monotonic() - shown_at >= 2.0):
                    _say(line)
                    last_line, last_kind, shown_at = line, kind, time.monotonic()
            time.sleep(SAMPLE_EVERY)
        if failure:
            coordinator.terminate()
        coordinator.wait(60)
        if coordinator.returncode != 0 and not failure:
            failure = f"the coordinator exited with {coordinator.returncode}"
        stop_at = time.monotonic() + (0 if failure else 60)
        for child in children[1:]:   # they leave when the run is announced finished
            while child.poll() is None and time.monotonic() < stop_at:
                sampler.sample()
                time.sleep(SAMPLE_EVERY)
            if child.poll() is None:
                child.terminate()
                child.wait(30)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        log.close()
        broker_log = (work / "mosquitto" / "mosquitto.log")
        for site_broker in site_brokers:
            site_broker.stop()
        for link in uplinks.values():
            link.stop()
        broker.stop()
    result = summarize(cell, args, work, sampler, processes, time.time() - began, uplinks)
    warnings = broker_log.read_text(errors="replace").strip().splitlines() if broker_log.exists() else []
    result["broker_log_lines"] = len(warnings)
    result["broker_log_tail"] = warnings[-5:]
    result["coordinator_warnings"] = coordinator_warnings(work / "run" / "coordinator.log")
    for site in sites:
        lines = (work / site.name / "mosquitto.log").read_text(errors="replace").strip().splitlines() \
            if (work / site.name / "mosquitto.log").exists() else []
        result.setdefault("site_broker_log_lines", {})[site.name] = len(lines)
        result.setdefault("site_broker_log_tail", {})[site.name] = lines[-3:]
        if site.aggregator_user:
            result.setdefault("site_aggregator_stats", {})[site.name] = worker_stats(
                work / f"{site.name}-aggregator.out")
    if failure:
        result["failure"] = failure
        result["coordinator_log_tail"] = (work / "coordinator.out").read_text(errors="replace")[-3000:]
        _say(f"{tag} FAILED: {failure}; files kept in {work}")
    else:
        import shutil
        shutil.rmtree(work, ignore_errors=True)
    return result


def bench_sites(cell: Cell, ids: list[str]) -> list[Site]:
    """The cell's sites: device ``ids[i]`` on site ``i % K``, each with an aggregator when the cell has them.
    Their host and port are placeholders: a bench site broker listens where LocalMosquitto finds room."""
    from coordinator.ops.sites import Site

    return [Site(f"site-{s}", "127.0.0.1", tuple(ids[s::cell.sites]), cell.site_aggregators)
            for s in range(cell.sites)]


def site_broker_config(site: Site, uplink_port: int, broker_dir: Path) -> str:
    """What a bench site broker adds to LocalMosquitto's anonymous loopback listener: any number of
    connections, and the bridge section ``fedge-coordinator provision --sites`` writes (``bridge_conf``:
    the topics of ``bridged_topics``, MQTT 3.1.1, ``cleansession false``), without TLS, to the uplink
    forwarder on ``uplink_port``. The central broker is anonymous: the bridge's password is not checked."""
    from coordinator.ops.provision_texts import bridge_conf

    return "max_connections -1\n" + bridge_conf(site, PREFIX, f"127.0.0.1:{uplink_port}", "unchecked",
                                                  str(broker_dir), tls=False)


def start_site(site: Site, centre_port: int, workdir: Path, timeout: float = 10.0) -> tuple[CountingLink, Any]:
    """A site broker bridged to the central broker on ``centre_port`` through a :class:`CountingLink`,
    once the bridge has connected (a device's presence published before that would not go up: the
    bridge does not carry the site's retained messages when it connects). Both are stopped by the caller."""
    from coordinator.ops.broker import BrokerError
    from coordinator.ops.mosquitto import LocalMosquitto

    link = CountingLink(centre_port).start()
    broker = LocalMosquitto(workdir=workdir, extra_config=site_broker_config(site, link.port, workdir))
    try:
        broker.start()
        deadline = time.monotonic() + timeout
        while link.connections == 0:
            if time.monotonic() > deadline:
                log = (workdir / "mosquitto.log").read_text(errors="replace").strip()[-500:]
                raise BrokerError(f"the bridge of {site.name} did not connect to the central broker within "
                                  f"{timeout:.0f} s; its broker's log: {log or '(empty)'}")
            time.sleep(0.02)
    except BaseException:
        broker.stop()
        link.stop()
        raise
    return link, broker


def worker_stats(path: Path) -> dict[str, int]:
    """A worker's closing counters, from its last line ``worker done: folded 250, partials 3, ...``."""
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.startswith("worker done: ")] \
        if path.exists() else []
    if not lines:
        return {}
    pairs = (item.rsplit(" ", 1) for item in lines[-1][len("worker done: "):].split(", "))
    return {k: int(v) for k, v in pairs if v.lstrip("-").isdigit()}


def coordinator_warnings(path: Path, keep: int = 8) -> dict[str, Any]:
    """How many WARNING and ERROR lines the coordinator logged, and the first few of them."""
    if not path.exists():
        return {"count": 0, "first": []}
    lines = [line for line in path.read_text(errors="replace").splitlines() if " WARNING " in line or " ERROR " in line]
    return {"count": len(lines), "first": [line[:300] for line in lines[:keep]]}


def summarize(cell: Cell, args: argparse.Namespace, work: Path, sampler: Sampler, processes: int,
              wall: float, uplinks: dict[str, CountingLink] | None = None) -> dict[str, Any]:
    """One cell's figures from the coordinator's rows and timing, the devices' records and the samples."""
    def read_lines(path: Path) -> list[dict[str, Any]]:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    rows = {r["round"]: r for r in read_lines(work / "run" / "metrics.jsonl")}
    timing = {t["round"]: t for t in read_lines(work / "timing.jsonl")}
    device_files = [json.loads(p.read_text()) for p in sorted(work.glob("devices-*.json")) if not p.name.endswith(
        ".spec.json")]
    tasks = [t for d in device_files for t in d["tasks"]]
    traffic: dict[int, list[int]] = {}
    for d in device_files:
        for r, counts in d["traffic"].items():
            slot = traffic.setdefault(int(r), [0, 0, 0, 0])
            for i, v in enumerate(counts):
                slot[i] += v
    devices = [name for name in sampler.series if name.startswith("devices-")]
    per_round = []
    for r in range(1, args.rounds + 1):
        row, mark = rows.get(r), timing.get(r)
        if row is None or mark is None:
            continue
        mine = [t for t in tasks if t["round"] == r]
        thinks = [t["think"] for t in mine if t["think"] is not None]
        slowest = max(thinks) if thinks else 0.0
        acked = [t["acked"] - t["answered"] for t in mine if t["acked"] and t["answered"]]
        fetch = [t["ready"] - t["received"] for t in mine if t["ready"]]
        answered = [t["answered"] for t in mine if t["answered"]]
        device_cpu = [(sampler.after(name, mark["wall_end"], 2) or 0.0) - (sampler.at(name, mark["wall_start"], 2) or 0.0)
                      for name in devices]
        m_in, b_in, m_out, b_out = traffic.get(r, [0, 0, 0, 0])
        per_round.append({
            "round": r, "seconds": row["seconds"], "slowest_think_s": slowest,
            "overhead_s": row["seconds"] - slowest,
            "selected": row.get("selected"), "returned": row.get("returned"), "attempts": row.get("attempts"),
            "late": row.get("late", 0), "rejected": row.get("rejected", 0), "duplicates": row.get("duplicates", 0),
            "failed": row.get("failed", 0), "inbox_dropped": sum((row.get("inbox_dropped") or {}).values()),
            "coordinator_cpu_s": mark["cpu_end"] - mark["cpu_start"],
            "coordinator_rss_mb_end": mark["rss_end_mb"],
            "device_cpu_s": sum(device_cpu),
            "tasks_delivered_s": max(t["received"] for t in mine) - mark["wall_start"] if mine else None,
            "model_fetch_s_max": max(fetch) if fetch else None,
            "ack_s_median": sorted(acked)[len(acked) // 2] if acked else None,
            "ack_s_max": max(acked) if acked else None,
            "tail_s": mark["wall_end"] - max(answered) if answered else None,
            "device_messages_in": m_in, "device_bytes_in": b_in, "device_messages_out": m_out, "device_bytes_out": b_out,
            "coordinator_bytes_down": row.get("bytes_down", 0), "coordinator_bytes_up": row.get("bytes_up", 0),
            "resends": sum(t["resends"] for t in mine),
            "unacked": sum(1 for t in mine if t["ack"] is None),
            "worker_lost": row.get("worker_lost", 0),
            **{k: v for k, v in row.items() if k.startswith("secagg_")},   # a secure round's stages
        })
    first = timing.get(1)
    last = timing.get(max(timing)) if timing else None
    window = (first["wall_start"], last["wall_end"]) if first and last else None   # rounds, without evaluations
    total = lambda key: sum(p[key] for p in per_round)   # noqa: E731
    return {
        "fleet": cell.fleet, "per_round": cell.per_round, "codec_up": cell.codec, "rounds": args.rounds,
        "coordinator_torch_threads": cell.threads,
        "workers": cell.workers,
        "secagg": cell.secagg,
        "drop": cell.drop,
        "workers_cpu_s_per_round": _mean([sum((sampler.after(f"worker-{i}", timing[p["round"]]["wall_end"], 2) or 0.0)
                                              - (sampler.at(f"worker-{i}", timing[p["round"]]["wall_start"], 2) or 0.0)
                                              for i in range(cell.workers)) for p in per_round])
        if cell.workers else None,
        "worker_peak_rss_mb": max((sampler.peak.get(f"worker-{i}", 0.0) for i in range(cell.workers)), default=None),
        "processes": processes, "think": args.think.text, "complete": len(per_round) == args.rounds,
        "overhead_s": _mean([p["overhead_s"] for p in per_round]),
        "overhead_s_max": max((p["overhead_s"] for p in per_round), default=None),
        "seconds_per_round": _mean([p["seconds"] for p in per_round]),
        "coordinator_cpu_s_per_round": _mean([p["coordinator_cpu_s"] for p in per_round]),
        "coordinator_peak_rss_mb": sampler.peak.get("coordinator"),
        "coordinator_peak_rss_mb_rounds": sampler.peak_between("coordinator", *window) if window else None,
        "coordinator_rss_mb_before_round_1": first["rss_start_mb"] if first else None,
        "broker_peak_rss_mb": sampler.peak.get("broker"),
        "broker_peak_rss_mb_rounds": sampler.peak_between("broker", *window) if window else None,
        "broker_rss_mb_before_round_1": sampler.at("broker", first["wall_start"], 1) if first else None,
        "broker_cpu_s_per_round": _mean([(sampler.after("broker", timing[p["round"]]["wall_end"], 2) or 0.0)
                                         - (sampler.at("broker", timing[p["round"]]["wall_start"], 2) or 0.0)
                                         for p in per_round]),
        "device_cpu_s_per_round": _mean([p["device_cpu_s"] for p in per_round]),
        "device_process_peak_rss_mb": max((sampler.peak.get(name, 0.0) for name in devices), default=None),
        "messages_per_round": _mean([p["device_messages_in"] + p["device_messages_out"] for p in per_round]),
        "mb_per_round": _mean([(p["device_bytes_in"] + p["device_bytes_out"]) / 1e6 for p in per_round]),
        "coordinator_mb_per_round": _mean([(p["coordinator_bytes_down"] + p["coordinator_bytes_up"]) / 1e6
                                           for p in per_round]),
        "selected": total("selected") if per_round else 0, "returned": total("returned") if per_round else 0,
        "lost": sum((p["selected"] or 0) - (p["returned"] or 0) for p in per_round),
        "late": total("late") if per_round else 0, "rejected": total("rejected") if per_round else 0,
        "duplicates": total("duplicates") if per_round else 0, "failed": total("failed") if per_round else 0,
        "inbox_dropped": total("inbox_dropped") if per_round else 0,
        "resends": total("resends") if per_round else 0, "unacked": total("unacked") if per_round else 0,
        "device_counts": {k: sum(d["counts"][k] for d in device_files) for k in
                          (device_files[0]["counts"] if device_files else {})},
        "startup_s": first["wall_start"] - min(d["started"] for d in device_files) if first and device_files else None,
        "cell_wall_s": wall,
        "secagg_seconds_per_round": _mean([p["secagg_seconds"] for p in per_round if "secagg_seconds" in p]) or None,
        "secagg_dropped": sum(p.get("secagg_dropped", 0) for p in per_round),
        "worker_lost": sum(p["worker_lost"] for p in per_round),
        "devices_connected_s": max(d["connected"] for d in device_files) - min(d["connecting"] for d in device_files)
        if device_files and all(d.get("connected") for d in device_files) else None,
        **site_figures(cell, sampler, per_round, timing, uplinks or {}),
        "per_round_detail": per_round,
    }


def site_figures(cell: Cell, sampler: Sampler, per_round: list[dict[str, Any]], timing: dict[int, dict[str, Any]],
                 uplinks: dict[str, CountingLink]) -> dict[str, Any]:
    """A sites cell's own figures (none for the flat topology): each uplink's bytes per round (added to
    ``per_round``'s rows) and over the cell, and what each site broker and site aggregator cost."""
    if not cell.sites:
        return {"sites": 0, "site_aggregators": False}
    names = sorted(uplinks)
    spans = {p["round"]: (timing[p["round"]]["wall_start"], timing[p["round"]]["wall_end"]) for p in per_round}
    for p in per_round:
        crossed = {name: uplinks[name].between(*spans[p["round"]]) for name in names}
        p["uplink_bytes_up"] = {name: up for name, (up, _) in crossed.items()}
        p["uplink_bytes_down"] = {name: down for name, (_, down) in crossed.items()}

    def per_site(role: str) -> dict[str, float | None]:
        """Each site's process ``NAME-role``: its CPU seconds per round, mean over rounds."""
        return {name: _mean([sampler.cpu(f"{name}-{role}", *span) for span in spans.values()])
                for name in names if f"{name}-{role}" in sampler.series}

    return {
        "sites": cell.sites, "site_aggregators": cell.site_aggregators,
        "uplink_mb_per_round_up": _mean([sum(p["uplink_bytes_up"].values()) / 1e6 for p in per_round]),
        "uplink_mb_per_round_down": _mean([sum(p["uplink_bytes_down"].values()) / 1e6 for p in per_round]),
        "uplink_bytes_cell": {name: {"up": link.up, "down": link.down} for name, link in sorted(uplinks.items())},
        "uplink_connections": {name: link.connections for name, link in sorted(uplinks.items())},
        "site_broker_cpu_s_per_round": per_site("broker"),
        "site_broker_peak_rss_mb": {name: sampler.peak.get(f"{name}-broker") for name in names},
        "site_aggregator_cpu_s_per_round": per_site("aggregator") if cell.site_aggregators else None,
        "site_aggregator_peak_rss_mb": {name: sampler.peak.get(f"{name}-aggregator") for name in names}
        if cell.site_aggregators else None,
        "bench_cpu_s_per_round": _mean([sampler.cpu("bench", *span) for span in spans.values()]),
    }


# ----------------------------------------------------------------------------- output

def _order(c: dict[str, Any]) -> tuple:
    """Cells in the JSON and the table: by N, per round, codec, then the variants (absent in older cells)."""
    return (c["fleet"], c["per_round"], c["codec_up"], c.get("coordinator_torch_threads", 0), c.get("workers", 0),
            c.get("sites", 0), c.get("site_aggregators", False))


def table(cells: list[dict[str, Any]]) -> str:
    """The measured table in Markdown, one line per cell."""
    head = ("| N | per round | codec up | overhead s (mean; max) | coordinator CPU s/round "
            "| coordinator peak RSS MB (rounds; run) | broker RSS MB (before round 1; peak) | messages/round "
            "| MB/round (devices; coordinator) | lost / late / rejected / dropped |")
    lines = [head, "|" + "---|" * 10]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)   # noqa: E731
    for c in sorted(cells, key=_order):
        lost = f"{c['lost']} / {c['late']} / {c['rejected']} / {c['inbox_dropped']}"
        mark = "" if c.get("complete") and not c.get("failure") else " (incomplete)"
        if c.get("coordinator_torch_threads"):
            mark += f", coordinator on {c['coordinator_torch_threads']} torch thread(s)"
        if c.get("workers"):
            mark += f", {c['workers']} aggregation worker(s) ({fmt(c.get('workers_cpu_s_per_round'), '.2f')} CPU s/round)"
        if c.get("sites"):
            mark += (f", {Cell.of(c).topology} (uplinks {fmt(c.get('uplink_mb_per_round_up'), ',.1f')} MB/round up, "
                     f"{fmt(c.get('uplink_mb_per_round_down'), ',.1f')} down)")
        lines.append(f"| {c['fleet']} | {c['per_round']} | `{c['codec_up']}`{mark} | "
                     f"{fmt(c['overhead_s'], '.2f')}; {fmt(c['overhead_s_max'], '.2f')} | "
                     f"{fmt(c['coordinator_cpu_s_per_round'], '.2f')} | "
                     f"{fmt(c.get('coordinator_peak_rss_mb_rounds'), '.0f')}; {fmt(c['coordinator_peak_rss_mb'], '.0f')} | "
                     f"{fmt(c.get('broker_rss_mb_before_round_1'), '.0f')}; {fmt(c['broker_peak_rss_mb'], '.0f')} | "
                     f"{fmt(c['messages_per_round'], ',.0f')} | "
                     f"{fmt(c['mb_per_round'], ',.1f')}; {fmt(c['coordinator_mb_per_round'], ',.1f')} | {lost} |")
    return "\n".join(lines)


def plot(cells: list[dict[str, Any]], path: Path) -> None:
    """Overhead, coordinator memory and broker memory against N, one line per (per round, codec);
    complete cells with the coordinator as it runs only (the others are in the table, marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.4))
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in cells:
        if c.get("complete") and not c.get("failure") and c.get("overhead_s") is not None \
                and not Cell.of(c).variant:
            share = "all" if c["per_round"] == c["fleet"] else "N/10"
            mode = ("" if not c.get("secagg") else ", secure" + (f", {c['drop']:.0%} fail" if c.get("drop") else ""))
            mode += f", {Cell.of(c).topology}" if c.get("sites") else ""
            groups.setdefault((share, c["codec_up"] + mode), []).append(c)
    panels = (("overhead_s", "round overhead: round time - slowest think", "seconds (log)"),
              ("coordinator_peak_rss_mb_rounds", "coordinator peak RSS during the rounds", "MB"),
              ("broker_peak_rss_mb", "Mosquitto peak RSS", "MB (log)"))
    for (share, codec), group in sorted(groups.items()):
        group.sort(key=lambda c: c["fleet"])
        xs = [c["fleet"] for c in group]
        style = {"marker": "o" if codec.startswith("fp32") else "s", "linestyle": "-" if share == "all" else "--"}
        for ax, (key, _, _) in zip(axes, panels):
            ax.plot(xs, [c.get(key) for c in group], label=f"{share} per round, {codec}", **style)
    for ax, (key, title, unit) in zip(axes, panels):
        ax.set_xscale("log")
        fleets = sorted({c["fleet"] for group in groups.values() for c in group})
        ax.set_xticks(fleets, [str(n) for n in fleets])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        if key in ("overhead_s", "broker_peak_rss_mb"):   # both span two orders of magnitude
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 3.0)))
            ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        else:
            ax.set_ylim(bottom=0)
        ax.set_xlabel("devices in the fleet (N)")
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _mosquitto_version() -> str | None:
    from coordinator.ops.mosquitto import mosquitto_binary

    binary = mosquitto_binary()
    if binary is None:
        return None
    try:
        out = subprocess.run([binary, "-h"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.splitlines()[0].strip() if out else None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/fleet.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__)
    parser.add_argument("--fleet", default="10,100,300,1000",
                        help="fleet sizes N to measure, comma-separated (default 10,100,300,1000)")
    parser.add_argument("--per-round", default="tenth,all",
                        help="clients per round for each N: 'tenth' (N/10, at least 1), 'all' (N), or numbers; "
                             "comma-separated (default tenth,all)")
    parser.add_argument("--codec-up", default="fp32",
                        help="upload codecs (codec.up), comma-separated; default fp32, what the protocol sends by "
                             "default. E.g. fp32,topk:0.1+int8+zstd")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per cell (default 3)")
    parser.add_argument("--processes", type=int, default=4,
                        help="device processes per cell; the devices are spread over them (default 4)")
    parser.add_argument("--think", type=Think.parse, default=Think.parse("lognormal:2:0.5"),
                        help="think time in place of training, in seconds: lognormal:MEDIAN:SIGMA, uniform:A:B or "
                             "fixed:S, drawn per device and task (default lognormal:2:0.5)")
    parser.add_argument("--round-timeout", type=float, default=600.0,
                        help="clients.round_timeout, seconds (default 600: generous, so that slowness shows as "
                             "overhead rather than as retries)")
    parser.add_argument("--presence-timeout", type=float, default=600.0,
                        help="clients.presence_timeout: how long the coordinator waits for the fleet to come online")
    parser.add_argument("--cell-timeout", type=float, default=3600.0,
                        help="stop a cell (coordinator and devices) after this many seconds and keep the rounds it "
                             "finished, marked incomplete (default 3600)")
    parser.add_argument("--coordinator-torch-threads", type=int, default=0, metavar="N",
                        help="run the coordinator with torch.set_num_threads(N), a variant kept apart in the JSON "
                             "and the table (default 0: torch's default, as the coordinator runs)")
    parser.add_argument("--workers", type=lambda text: [int(v) for v in text.split(",") if v.strip()], default=[0],
                        metavar="K[,K...]",
                        help="aggregation worker processes (fedge-coordinator worker) per cell, comma-separated; "
                             "each K > 0 is a variant kept apart in the JSON and the table, run with results "
                             f"unchunked (max_message_bytes {WORKERS_PACKET_BYTES // 2**20} MiB). Default 0: the "
                             "coordinator takes every result itself")
    parser.add_argument("--sites", type=_counts, default=[0], metavar="K[,K...]",
                        help="site brokers the fleet is split over (device i on site i %% K), each bridged to the "
                             "central broker by Mosquitto's bridge as `provision --sites` writes it, its uplink through "
                             "a byte-counting forwarder; comma-separated, a cell each. Default 0: every device on the "
                             "central broker")
    parser.add_argument("--site-aggregators", type=_modes, default=[False], metavar="off,on",
                        help="with --sites K > 0: off (results go up the bridges to the coordinator), on (an aggregation "
                             "worker on each site broker keeps its site's results: workers.count = K, "
                             "workers.direct_results), or off,on (a cell each). Default off")
    parser.add_argument("--secagg", type=_modes, default=[False], metavar="off,on",
                        help="secure aggregation off, on, or both (a cell each; default off): [secagg] enabled, four "
                             "exchanges a round, devices answer every stage with the device's own code")
    parser.add_argument("--secagg-drop", type=_fractions, default=[0.0], metavar="0,0.1",
                        help="secure cells: shares of a round's devices that fail their mask task after sharing "
                             "their keys, a cell each (default 0); the coordinator recovers their masks from shares")
    parser.add_argument("--stage-timeout", type=float, default=600.0,
                        help="secure cells: secagg.stage_timeout, seconds a stage waits for answers (default 600)")
    parser.add_argument("--seed", type=int, default=0, help="run.seed, think times and perturbations (default 0)")
    parser.add_argument("--skip-cell", action="append", default=[], metavar="N/PER_ROUND/CODEC",
                        help="leave out one cell, e.g. 1000/1000/fp32 (repeatable)")
    parser.add_argument("--skip-existing", action="store_true",
                        help="keep the finished cells (N, per round, codec) already in --out and run only the others")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results (default {DEFAULT_OUT})")
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT, help=f"PNG figure (default {DEFAULT_PLOT})")
    parser.add_argument("--table", action="store_true", help="print the table of --out and exit (runs nothing)")
    parser.add_argument("--coordinator-child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--devices-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.processes < 1:
        parser.error("--rounds and --processes must be at least 1")
    if any(args.sites) and True in args.site_aggregators and (any(args.workers) or True in args.secagg):
        parser.error("site aggregators are the run's aggregation workers: run them without --workers (central "
                     "workers would take the results that reach the centre a second time) and without --secagg "
                     "(secure rounds need every result at the coordinator); or use --site-aggregators off")
    return args


def _modes(text: str) -> list[bool]:
    modes = {"off": False, "on": True}
    chosen = [v.strip() for v in text.split(",") if v.strip()]
    if not chosen or any(v not in modes for v in chosen):
        raise argparse.ArgumentTypeError(f"expected off, on or off,on; got {text!r}")
    return [modes[v] for v in chosen]


def _counts(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated counts >= 0, e.g. 0,4,10; got {text!r}")
    return values


def _fractions(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 <= v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions in [0, 1), got {text!r}")
    return values


def cells_of(args: argparse.Namespace) -> list[Cell]:
    cells = []
    for n in (int(v) for v in args.fleet.split(",") if v.strip()):
        shares = []
        for share in args.per_round.split(","):
            share = share.strip()
            k = max(1, n // 10) if share == "tenth" else n if share == "all" else int(share)
            if 1 <= k <= n and k not in shares:
                shares.append(k)
        for k in shares:
            for codec in (c.strip() for c in args.codec_up.split(",") if c.strip()):
                for workers in args.workers:
                    for secagg in args.secagg:
                        for drop in args.secagg_drop if secagg else [0.0]:
                            for sites in (s for s in args.sites if s <= n):   # no site without a device
                                for aggregators in args.site_aggregators if sites else [False]:
                                    cell = Cell(n, k, codec, args.coordinator_torch_threads, workers, secagg, drop,
                                                sites, aggregators)
                                    if cell.key not in args.skip_cell and cell not in cells:
                                        cells.append(cell)
    return cells


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.coordinator_child:
        return coordinator_child(args.coordinator_child)
    if args.devices_child:
        return devices_child(args.devices_child)
    if args.table:
        print(table(json.loads(args.out.read_text())["cells"]))
        return 0
    # Cells of other (N, per round, codec) already in --out stay; a cell run again replaces its line.
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    results = list(previous.get("cells", []))
    finished = {Cell.of(c).key for c in results if c.get("complete") and not c.get("failure")}
    todo = [c for c in cells_of(args) if not (args.skip_existing and c.key in finished)]
    _say(f"{len(todo)} cells to run" + (f", {len(results)} in {args.out} already" if results else ""))
    started = time.time()
    for i, cell in enumerate(todo, 1):
        _say(f"cell {i}/{len(todo)}: N={cell.fleet}, {cell.per_round} per round, codec up {cell.codec}"
             + (f", {cell.topology}" if cell.sites else ""))
        result = run_cell(cell, args)
        results = [c for c in results if Cell.of(c).key != cell.key] + [result]
        _say(f"  overhead {result['overhead_s'] if result['overhead_s'] is None else round(result['overhead_s'], 2)} s"
             f" per round, coordinator CPU {result['coordinator_cpu_s_per_round'] or 0:.2f} s/round, peak RSS "
             f"coordinator {result['coordinator_peak_rss_mb'] or 0:.0f} MB, broker {result['broker_peak_rss_mb'] or 0:.0f}"
             f" MB; lost {result['lost']}, late {result['late']}; cell took {result['cell_wall_s']:.0f} s"
             + (f"; uplinks {result['uplink_mb_per_round_up'] or 0:,.1f} MB/round up, "
                f"{result['uplink_mb_per_round_down'] or 0:,.1f} down" if cell.sites else ""))
        report = {
            "machine": {"python": platform.python_version(), "arch": platform.machine(), "cpus": os.cpu_count(),
                        "mosquitto": _mosquitto_version()},
            "model": "cnn on Fashion-MNIST 28x28 (1.69 MB of float32 parameters), FedAvg, codec.down fp32 with the "
                     "model broadcast, codec.error_feedback false",
            "definitions": DEFINITIONS,
            "cells": sorted(results, key=_order),
        }
        write_result(args.out, report)
        plot(report["cells"], args.plot)
    if not todo and results:
        plot(results, args.plot)
    if results:
        print(table(results))
        print(f"figure: {args.plot}")
    if todo:
        _say(f"{len(todo)} cells in {time.time() - started:.0f} s")
    return 0


def _stop(signum: int, frame: Any) -> None:
    """SIGTERM ends the sweep through run_cell's cleanup: its children and broker are stopped by PID."""
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _stop)
    sys.exit(main())
