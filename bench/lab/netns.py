"""The lab's network: a Linux bridge with a private /24 and no external ports, and for each device a
network namespace joined to it by a veth pair, its rates shaped with ``tbf`` on both ends (uplink on
the device's end, downlink on the bridge's end). A device goes offline when its veth is set down.

Everything is named ``flabID-...`` (interface names hold 15 characters), so a crashed lab's leftovers
are found by name. There is no ``netem`` on the kernels the lab targets: no added latency, no loss.
"""

from __future__ import annotations

import ipaddress
import re
import shutil
from dataclasses import dataclass

from lab.system import System

__all__ = ["LINK_PREFIX", "LabNet", "is_lab_name", "netns_problem", "lab_subnet"]

LINK_PREFIX = "flab"
_LAB_NAME = re.compile(rf"^{LINK_PREFIX}[0-9a-f]{{4}}(-|$)")


def is_lab_name(name: str) -> bool:
    return bool(_LAB_NAME.match(name))


def lab_subnet(lab_id: str) -> ipaddress.IPv4Network:
    """A /24 of 10.231.0.0/16 picked by the lab id, so two labs rarely share one."""
    return ipaddress.IPv4Network(f"10.231.{int(lab_id, 16) % 250}.0/24")


def netns_problem(system: System) -> str:
    """Why the lab cannot make namespaces and veths here ("" when it can)."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing: apt-get install iproute2"
    if system.run("ip", "netns", "list", check=False) is None:
        return "ip netns does not work here"
    return ""


def _tbf(rate_bps: int) -> list[str]:
    burst = max(16 * 1024, rate_bps // 8 // 50)   # 20 ms at the rate, at least 16 KiB
    return ["tbf", "rate", f"{rate_bps}bit", "burst", str(burst), "latency", "200ms"]


@dataclass(frozen=True)
class DeviceLink:
    ns: str
    host_veth: str
    ns_veth: str
    address: str


class LabNet:
    def __init__(self, system: System, lab_id: str, subnet: ipaddress.IPv4Network) -> None:
        self.system, self.lab_id, self.subnet = system, lab_id, subnet
        self.bridge = f"{LINK_PREFIX}{lab_id}-br"
        self.bridge_address = str(subnet.network_address + 1)
        self.links: dict[str, DeviceLink] = {}

    def link_names(self, index: int) -> DeviceLink:
        base = f"{LINK_PREFIX}{self.lab_id}-{index:03d}"
        return DeviceLink(base, base + "h", base + "n", str(self.subnet.network_address + 10 + index))

    def create_bridge(self) -> None:
        run = self.system.run
        run("ip", "link", "add", self.bridge, "type", "bridge")
        run("ip", "addr", "add", f"{self.bridge_address}/{self.subnet.prefixlen}", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")

    def add_device(self, key: str, index: int, uplink_bps: int, downlink_bps: int) -> DeviceLink:
        link = self.link_names(index)
        run, ns = self.system.run, ["ip", "netns", "exec", link.ns]
        run("ip", "netns", "add", link.ns)
        self.links[key] = link
        run("ip", "link", "add", link.host_veth, "type", "veth", "peer", "name", link.ns_veth)
        run("ip", "link", "set", link.ns_veth, "netns", link.ns)
        run("ip", "link", "set", link.host_veth, "master", self.bridge)
        run("ip", "link", "set", link.host_veth, "up")
        run(*ns, "ip", "addr", "add", f"{link.address}/{self.subnet.prefixlen}", "dev", link.ns_veth)
        run(*ns, "ip", "link", "set", link.ns_veth, "up")
        run(*ns, "ip", "link", "set", "lo", "up")
        run("tc", "qdisc", "add", "dev", link.host_veth, "root", *_tbf(downlink_bps))
        run(*ns, "tc", "qdisc", "add", "dev", link.ns_veth, "root", *_tbf(uplink_bps))
        return link

    def set_link(self, key: str, up: bool) -> None:
        self.system.run("ip", "link", "set", self.links[key].host_veth, "up" if up else "down")

    def qdiscs(self, key: str) -> str:
        """What tc reports on both ends of a device's link (to show the shaping is in force)."""
        link = self.links[key]
        return (self.system.run("tc", "qdisc", "show", "dev", link.host_veth) +
                self.system.run("ip", "netns", "exec", link.ns, "tc", "qdisc", "show", "dev", link.ns_veth))

    def remove(self) -> list[str]:
        """Delete this lab's namespaces (their veth ends go with them), veths and bridge."""
        return remove_net(self.system, lambda name: name.startswith(f"{LINK_PREFIX}{self.lab_id}-"))


def remove_net(system: System, match) -> list[str]:
    """Delete every namespace and link whose name ``match`` accepts; what could not be deleted."""
    problems = []
    names = [line.split()[0] for line in system.run("ip", "netns", "list", check=False).splitlines() if line.strip()]
    for ns in filter(match, names):
        try:
            system.run("ip", "netns", "del", ns)
        except RuntimeError as exc:
            problems.append(str(exc))
    links = [line.split(":")[1].strip().split("@")[0]
             for line in system.run("ip", "-o", "link", "show", check=False).splitlines() if line.count(":") >= 2]
    for link in filter(match, links):
        try:
            system.run("ip", "link", "del", link)
        except RuntimeError as exc:
            if "Cannot find device" not in str(exc):   # a veth goes with its peer
                problems.append(str(exc))
    return problems
