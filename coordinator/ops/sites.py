"""Sites: a farm's or a factory's own Mosquitto next to its devices, bridged to the central broker.

A site's devices log in to the site broker; Mosquitto's own bridge carries over one uplink
what the coordinator and the devices exchange, and nothing else (docs/sites.md). What it
carries is decided here, once, from the topic layout: the bridge's ``topic`` lines on the
site broker and the bridge user's rights on the central broker are both made from
:func:`bridged_topics`, so they cannot drift apart.

A site with an aggregator keeps its devices' results: an aggregation worker on the site
broker (``fedge-coordinator worker --bundle sites/NAME/aggregator.toml``) claims each one
and sends the coordinator one partial sum per round, so the uplink carries claims and the
partial instead of every device's update. Without one, the results go up the bridge.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from edge_client.wire.protocol import Topics, valid_client_id
from storage.errors import FedgeError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["Site", "SiteError", "read_sites", "check_sites", "bridged_topics", "IN", "OUT"]

IN, OUT = "in", "out"   # centre -> site, site -> centre (Mosquitto's bridge directions, seen from the site)


class SiteError(FedgeError, ValueError):
    """A sites file that cannot be used; the message says what to fix."""


@dataclass(frozen=True)
class Site:
    """One site: its broker as its devices reach it, its devices, and whether it aggregates its own results."""

    name: str
    host: str
    devices: tuple[str, ...]
    aggregator: bool = False
    port: int = 8883

    @property
    def bridge_user(self) -> str:
        """The user the site's bridge logs in to the central broker as (also its client id there)."""
        return f"bridge-{self.name}"

    @property
    def aggregator_user(self) -> str | None:
        """The site aggregator's user name and worker id, when the site has one."""
        return f"agg-{self.name}" if self.aggregator else None

    @property
    def url(self) -> str:
        """The site broker's URL, as the site's device bundles carry it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"mqtts://{host}:{self.port}"


def bridged_topics(topics: Topics, site: Site) -> list[tuple[str, str]]:
    """What the site's bridge carries, as (topic filter, ``IN`` or ``OUT``), each filter with ``/#`` so it
    also covers the parts of a chunked retained message.

    Down: what the coordinator publishes for all (run status, model broadcast and its parts, the
    workers' manifest), each site device's tasks and status, and the verdicts for the site's
    aggregator. Up: each device's presence, its results unless the site aggregates them, and the
    aggregator's presence, claims and partial sums. Nothing of another site's or a central device's.
    """
    lines = [(f"{topics.prefix}/coordinator/#", IN)]
    for device in site.devices:
        lines += [(topics.client(device, "task") + "/#", IN), (topics.client(device, "status") + "/#", IN),
                  (topics.client(device, "presence") + "/#", OUT)]
        if not site.aggregator:
            lines.append((topics.client(device, "result") + "/#", OUT))
    if site.aggregator_user:
        agg = site.aggregator_user
        lines += [(topics.worker(agg, "status") + "/#", IN)]
        lines += [(topics.worker(agg, kind) + "/#", OUT) for kind in ("presence", "claim", "partial")]
    return lines


def read_sites(path: Path) -> list[Site]:
    """Sites from a TOML file, one table per site::

        [farm-a]
        host = "farm-a.lan"            # the site broker, as its devices reach it (its certificate names it)
        devices = ["pi-01", "pi-02"]   # provisioned devices (--devices/--names) that log in to the site broker
        aggregator = true              # optional (false): a site aggregator keeps the results on the site
        port = 8883                    # optional: the site broker's TLS port
    """
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise SiteError(f"cannot read --sites {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SiteError(f"--sites {path} is not valid TOML: {exc}") from None
    sites = []
    for name, table in raw.items():
        if not isinstance(table, dict):
            raise SiteError(f"--sites {path}: {name!r} must be a table [{name}] with host and devices")
        unknown = sorted(set(table) - {"host", "devices", "aggregator", "port"})
        host, devices = table.get("host"), table.get("devices")
        aggregator, port = table.get("aggregator", False), table.get("port", 8883)
        if unknown:
            raise SiteError(f"--sites {path}: [{name}] has unknown keys {unknown}; use host, devices, aggregator, port")
        if not isinstance(host, str) or not host:
            raise SiteError(f"--sites {path}: [{name}] needs host = \"...\", the site broker as its devices reach it")
        if not isinstance(devices, list) or not devices or not all(isinstance(d, str) for d in devices):
            raise SiteError(f"--sites {path}: [{name}] needs devices = [\"ID\", ...], at least one device id")
        if not isinstance(aggregator, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise SiteError(f"--sites {path}: [{name}] aggregator must be true or false and port in 1..65535")
        sites.append(Site(name, host, tuple(devices), aggregator, port))
    return sites


def check_sites(sites: Sequence[Site], devices: Sequence[str], reserved: Sequence[str]) -> None:
    """Every site device is a provisioned device in one site only; site names make valid user names that
    no device or other user already has (``reserved``: the coordinator's and the workers' users)."""
    seen: dict[str, str] = {}
    users = set(devices) | set(reserved)
    for site in sites:
        if not valid_client_id(site.name) or len(site.bridge_user) > 64:
            raise SiteError(f"site name {site.name!r}: use 1-57 letters, digits, '_', '.', '-' (it becomes the "
                            "user names bridge-NAME and agg-NAME and a directory)")
        missing = sorted(set(site.devices) - set(devices))
        if missing:
            raise SiteError(f"site {site.name}: devices {missing} are not provisioned: add them to --names "
                            "(or fix their spelling in the sites file)")
        for device in site.devices:
            if device in seen:
                raise SiteError(f"device {device} is in sites {seen[device]} and {site.name}: a device logs in "
                                "to one broker")
            seen[device] = site.name
        for user in filter(None, (site.bridge_user, site.aggregator_user)):
            if user in users:
                raise SiteError(f"site {site.name}'s user {user} is already a device or another user: rename the "
                                "site or the device")
            users.add(user)
