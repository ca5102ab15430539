"""One lab: build the fleet on this machine (cgroups, namespaces, bridge, broker), run policies on it,
and take it all down again, whatever happens.

``teardown`` may be called any number of times (from ``finally``, a signal handler and ``atexit``);
it removes everything carrying this lab's id and reports what it could not remove.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.ops.broker import free_port
from lab import processes
from lab.cgroups import Cgroups, cgroup_problem
from lab.fleet import Fleet
from lab.netns import LINK_PREFIX, LabNet, lab_subnet, netns_problem
from lab.schedule import Event
from lab.system import System

__all__ = ["LabError", "LabOptions", "Lab", "new_lab_id"]


class LabError(RuntimeError):
    """The lab cannot run here, or could not be built; the message says what to do."""


def new_lab_id() -> str:
    return secrets.token_hex(2)


@dataclass
class LabOptions:
    rounds: int = 5
    budget: float | None = None      # wall-clock seconds per policy
    seed: int = 0
    data: str = "digits"
    partition: str = "dirichlet:0.5"
    model: str = "mlp"
    per_round: int = 0               # 0: a third of the fleet
    min_results: int = 0             # 0: half of per_round
    expected: int = 0                # 0: per_round
    round_timeout: float = 120.0
    restart_after: float | None = None   # seconds of training after which the coordinator is restarted once
    work: Path = Path("runs/edge-lab")
    lab_id: str = field(default_factory=new_lab_id)

    def resolved(self, fleet: Fleet) -> tuple[int, int, int]:
        """(expected, per_round, min_results) for this fleet."""
        per_round = self.per_round or max(1, len(fleet.devices) // 3)
        return (self.expected or per_round, per_round, self.min_results or max(1, per_round // 2))


class Lab:
    def __init__(self, fleet: Fleet, options: LabOptions, system: System, say: Callable[[str], None]) -> None:
        self.fleet, self.options, self.system, self.say = fleet, options, system, say
        self.id = options.lab_id
        self.name = f"{LINK_PREFIX}{self.id}"
        self.work = options.work / self.name
        self.cgroups = Cgroups(system, self.name)
        self.net = LabNet(system, self.id, lab_subnet(self.id))
        self.broker: subprocess.Popen | None = None
        self.port = 0
        self.children: list[subprocess.Popen] = []   # every process started, for teardown
        self._torn_down = False

    @property
    def broker_url(self) -> str:
        """The URL the devices use (the bridge's address); the coordinator uses 127.0.0.1."""
        return f"mqtt://{self.net.bridge_address}:{self.port}"

    def check(self) -> None:
        if self.system.dry_run:
            return
        if os.geteuid() != 0:
            raise LabError("the edge lab needs root (it creates cgroups, network namespaces and tc qdiscs): "
                           "run it with sudo, or use --dry-run to see what it would create")
        problem = cgroup_problem() or netns_problem(self.system)
        if problem:
            raise LabError(f"cannot build the lab here: {problem}")
        taken = self.system.run("ip", "-o", "-4", "addr", "show")
        if f" {self.net.bridge_address}/" in taken:
            raise LabError(f"{self.net.subnet} is already in use on this machine; pick another --lab-id")

    def setup(self) -> None:
        """Cgroups, bridge, one namespace and shaped veth per device, the broker."""
        self.check()
        self.say(f"lab {self.name}: {len(self.fleet.devices)} devices on {self.net.bridge} ({self.net.subnet}), "
                 f"cgroup {'v2' if self.cgroups.v2 else 'v1'}, work dir {self.work}")
        self.cgroups.create_lab()
        self.net.create_bridge()
        for d in self.fleet.devices:
            self.cgroups.create(d.id, d.cpu_share, d.memory_bytes)
            link = self.net.add_device(d.id, d.index, d.uplink_bps, d.downlink_bps)
            self.say(f"  {d.id:<18} {link.ns} {link.address:<13} cpu {d.cpu_share:.3f} core  "
                     f"mem {d.memory_bytes / 2**20:.0f} MiB  up {d.uplink_bps / 1e6:g} / down "
                     f"{d.downlink_bps / 1e6:g} Mbit/s  {d.availability.kind}"
                     + (f"  throttle {d.throttle.fraction:.0%}" if d.throttle else ""))
        if self.system.dry_run:
            self.say(f"  start mosquitto on 127.0.0.1 and {self.net.bridge_address} (config in {self.work}/broker)")
            return
        self.port = free_port()
        self.broker = processes.start_broker(self.work / "broker", self.port,
                                             ["127.0.0.1", self.net.bridge_address], self.id)
        self.children.append(self.broker)
        self.say(f"broker: mosquitto pid {self.broker.pid} on 127.0.0.1:{self.port} and {self.broker_url}")

    def apply(self, event: Event) -> None:
        """One scheduled change: a link down or up, a CPU quota lowered or restored."""
        device = next(d for d in self.fleet.devices if d.id == event.device)
        if event.action in ("link_down", "link_up"):
            self.net.set_link(device.id, event.action == "link_up")
        else:
            share = device.cpu_share * (event.fraction if event.action == "throttle" else 1.0)
            self.cgroups.set_cpu(device.id, share)

    def reset(self) -> None:
        """Every link up and every quota at its device's share: the state a policy starts from."""
        for d in self.fleet.devices:
            self.net.set_link(d.id, True)
            self.cgroups.set_cpu(d.id, d.cpu_share)

    def teardown(self) -> list[str]:
        """Remove everything this lab created; what could not be removed (empty when all is gone)."""
        if self._torn_down:
            return []
        self._torn_down = True
        self.say(f"lab {self.name}: cleaning up")
        problems: list[str] = []
        processes.stop(self.children, grace=10.0)
        for pid in processes.lab_pids(self.id):   # anything a child left behind
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        problems += self.cgroups.remove()
        problems += self.net.remove()
        for problem in problems:
            self.say(f"  could not remove: {problem}")
        if self.system.dry_run:
            self.say("dry run: nothing was created")
        elif not problems:
            self.say(f"lab {self.name}: removed (processes, namespaces, veths, bridge, qdiscs, cgroups, broker)")
        return problems


def cleanup_all(system: System, say: Callable[[str], None]) -> list[str]:
    """Remove the leftovers of every lab on this machine (``--cleanup``): processes, cgroups, network."""
    from lab.cgroups import lab_cgroup_dirs, remove_tree
    from lab.netns import is_lab_name, remove_net

    pids = processes.lab_pids()
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    dirs = lab_cgroup_dirs(is_lab_name)
    problems = remove_tree(system, dirs) + remove_net(system, is_lab_name)
    say(f"removed {len(pids)} lab processes and {len(dirs)} lab cgroup trees"
        + (f"; could not remove: {'; '.join(problems)}" if problems else ""))
    return problems
