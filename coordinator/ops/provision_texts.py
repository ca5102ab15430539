"""The text of the files ``fedge-coordinator provision`` writes: the broker's ACL and Mosquitto
configuration, the coordinator's ``[transport]`` section, and the comment atop each device bundle.

Kept apart from the provisioning steps so what a deployment's files say can be read,
and reviewed, in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from coordinator.ops.sites import IN, OUT, Site, bridged_topics
from edge_client.wire.protocol import Topics

__all__ = ["COORDINATOR_USER", "MONITOR_USER", "broker_acl", "site_acl", "mosquitto_conf", "bridge_conf", "coordinator_toml",
           "bundle_comment", "aggregator_comment", "next_commands"]

COORDINATOR_USER = "coordinator"
MONITOR_USER = "monitor"   # reads everything under the prefix, writes nothing: fedge-coordinator status, mosquitto_sub


def _worker_acl(prefix: str, workers: list[str]) -> str:
    """Each aggregation worker reads every result (through the shared subscription), what the coordinator
    publishes, and reads and writes its own topics; it logs in as its own user, whose name is its id."""
    return "".join(f"""
# Aggregation worker {w} (fedge-coordinator worker --id {w}).
user {w}
topic read {prefix}/clients/+/result
topic read {prefix}/coordinator/#
topic readwrite {prefix}/workers/{w}/#
""" for w in workers)


def broker_acl(prefix: str, workers: Sequence[str] = (), sites: Sequence[Site] = (),
               broker_dir: str = "/etc/mosquitto/fedge") -> str:
    """The central broker's ACL; ``broker_dir`` is where its files are installed (``--broker-dir``)."""
    p, d = prefix, broker_dir.rstrip("/")
    return f"""# Mosquitto ACL written by fedge-coordinator provision for the topic prefix "{p}".
# The coordinator reads and writes everything under the prefix.
user {COORDINATOR_USER}
topic readwrite {p}/#

""" + _device_patterns(p) + f"""
# A read-only user for watching a run (fedge-coordinator status, mosquitto_sub) without taking over
# the coordinator's or a device's client id. Its password is in the provisioning directory's
# monitor/password, its hash in {d}/fedge.passwd; fedge-coordinator provision --rotate monitor
# gives it a new one.
user {MONITOR_USER}
topic read {p}/#
""" + _worker_acl(p, list(workers)) + "".join(_bridge_acl(p, site) for site in sites)


def site_acl(prefix: str, site: Site) -> str:
    """A site broker's ACL: its devices as on the central broker, and its aggregator if it has one. The
    bridge needs no line: Mosquitto's bridge is part of the broker, not a client it checks."""
    return (f"# Mosquitto ACL of site {site.name}'s broker, written by fedge-coordinator provision (prefix \"{prefix}\").\n"
            + _device_patterns(prefix) + _worker_acl(prefix, [site.aggregator_user] if site.aggregator_user else []))


def _bridge_acl(prefix: str, site: Site) -> str:
    """The site's bridge user on the central broker: read what comes down and write what goes up of
    this site's topics (:func:`bridged_topics`), so a site can neither read nor pose as another site's
    or a central device."""
    rights = {IN: "read", OUT: "write"}
    lines = "".join(f"topic {rights[way]} {pattern}\n" for pattern, way in bridged_topics(Topics(prefix), site))
    return f"""
# The bridge of site {site.name} (sites/{site.name}/fedge.conf): only its site's topics.
user {site.bridge_user}
""" + lines


def _device_patterns(prefix: str) -> str:
    p = prefix
    return f"""# "pattern" lines apply to every user; %u is the user name, which use_username_as_clientid
# makes the client id too, so a device cannot pose as another. A device writes only its own
# presence and results, reads its own tasks, status and presence (to see the broker passes it
# on), and reads what the coordinator publishes for all (run status, model broadcast). It
# cannot write its tasks or anything of the coordinator's, nor touch other devices' topics.
# The "/#" also covers the topic itself, and the parts of a chunked retained message.
pattern readwrite {p}/clients/%u/presence/#
pattern write {p}/clients/%u/result/#
pattern read {p}/clients/%u/task/#
pattern read {p}/clients/%u/status/#
pattern read {p}/coordinator/#
"""


def mosquitto_conf(port: int, listen: str, broker_dir: str, run_as: str | None = None) -> str:
    """The central broker's configuration; ``run_as``: the user a broker started as root keeps (one run in a
    terminal from the provisioning directory, whose 0600 files the ``mosquitto`` user cannot read)."""
    d = broker_dir.rstrip("/")
    bind = f" {listen}" if listen else ""
    user = ("" if run_as is None else
            "\n# Started as root, Mosquitto drops to this user (by default `mosquitto`, which cannot read\n"
            "# the 0600 files of the provisioning directory it runs from); as another user, it stays that user.\n"
            f"user {run_as}\n")
    return f"""# Mosquitto 2.x configuration written by fedge-coordinator provision.
# Install as /etc/mosquitto/conf.d/fedge.conf with the other files of this directory in {d}/
# (docs/deploy.md shows the commands). The stock /etc/mosquitto/mosquitto.conf sets
# pid_file, persistence_location and log_dest.

# Keep sessions and queued messages across broker restarts (fedge uses persistent sessions).
persistence true

# Every client must log in; passwords (PBKDF2-SHA512) in password_file, topic rights in acl_file.
allow_anonymous false
password_file {d}/fedge.passwd
acl_file {d}/fedge.acl

# One TLS listener; its options follow this line. Devices check that the certificate names
# the host in their broker URL and was signed by the CA in their bundle.
listener {port}{bind}
cafile {d}/ca.crt
certfile {d}/server.crt
keyfile {d}/server.key
tls_version tlsv1.2

# The broker replaces a client's id with its user name: the ACL's %u confines each device,
# and no client can knock another off by reusing its id.
use_username_as_clientid true

# Mosquitto's default of 1000 silently drops QoS 1 messages for a slow subscriber; results
# travel in many chunks, so keep a wide margin. Cap memory with max_queued_bytes if needed.
max_queued_messages 100000
max_inflight_messages 100
{user}"""


def bridge_conf(site: Site, prefix: str, centre: str, password: str, broker_dir: str, *, tls: bool = True) -> str:
    """The bridge section of a site broker's ``fedge.conf``: one TLS uplink to the central broker at
    ``centre`` (HOST:PORT, a host its certificate names), carrying :func:`bridged_topics` at QoS 1.

    ``tls=False`` leaves out ``bridge_cafile``, for a plain uplink on loopback (``bench/fleet.py`` bridges
    its bench sites with this very section, so what it measures is what provisioning writes)."""
    d = broker_dir.rstrip("/")
    cafile = f"bridge_cafile {d}/ca.crt\n" if tls else ""
    topics = "".join(f"topic {pattern} {way} 1\n" for pattern, way in bridged_topics(Topics(prefix), site))
    return f"""
# Bridge to the central broker: the site's one uplink (docs/sites.md). The central broker's ACL
# lets user {site.bridge_user} carry only the topics below. This file holds that user's password:
# keep it mode 0600 (Mosquitto reads its configuration before it drops root).
connection fedge-{site.name}
address {centre}
{cafile}remote_clientid {site.bridge_user}
remote_username {site.bridge_user}
remote_password {password}
# MQTT 3.1.1 with try_private (its default): the central broker treats the bridge as a bridge (retained
# messages keep their flag) and keeps its session while the uplink is down, queueing what comes for
# the site; with bridge_protocol_version mqttv50, Mosquitto 2.0.11 lost those messages instead.
bridge_protocol_version mqttv311
try_private true
cleansession false
# The "out" topics are written, never subscribed to, on the central broker: no unsubscribes to send.
bridge_attempt_unsubscribe false
# Reconnect after 2 s, backing off to 30 s while the centre stays unreachable.
restart_timeout 2 30
# The bridge's state ($SYS/broker/connection/...) stays on this broker; the centre's ACL has no line for it.
notifications_local_only true

# What crosses: "in" comes down from the centre, "out" goes up to it.
{topics}"""


def coordinator_toml(url: str, prefix: str, out_dir: Path, workers: int = 0, direct_results: bool = False) -> str:
    return f"""# fedge coordinator settings for the broker provisioned in {out_dir}.
# Run with:  export FEDGE_MQTT_PASSWORD="$(cat {out_dir / 'coordinator' / 'password'})"
#            fedge-coordinator run --config {out_dir / 'coordinator' / 'coordinator.toml'} ...
# or copy this section into your own config file.
[transport]
broker = "{url}"
prefix = "{prefix}"
username = "{COORDINATOR_USER}"
password_env = "FEDGE_MQTT_PASSWORD"
ca_file = "{out_dir / 'ca.crt'}"
# Spawned simulation clients (--spawn-clients N) log in with the device bundles of this directory.
provision_dir = "{out_dir}"
""" + (f"""
# Aggregation workers: {workers} in all, counting one aggregator per site that has one (docs/sites.md).
[workers]
count = {workers}
# The coordinator takes the results that reach the central broker itself (central devices and sites
# without an aggregator); the site aggregators keep their sites' results.
direct_results = {str(direct_results).lower()}
""" if direct_results else "")


def bundle_comment(device: str) -> str:
    return (f"fedge device bundle for {device}: broker, identity, password and CA of one device.\n"
            "It holds a password: keep it mode 0600 and readable only by the user that runs fedge-client.\n"
            "Use: fedge-client run --bundle THIS_FILE --data SPEC (docs/deploy.md)")


def aggregator_comment(site: str) -> str:
    return (f"fedge site aggregator bundle for site {site}: its site broker, id, password and CA.\n"
            "It holds a password: keep it mode 0600 and readable only by the user that runs the aggregator.\n"
            "Use: fedge-coordinator worker --config RUN.toml --bundle THIS_FILE (docs/sites.md)")


def next_commands(out_dir: Path, broker_dir: str, devices: Sequence[str]) -> str:
    """The commands that take a fresh provisioning directory to a run and a look at the fleet, with its
    paths filled in, so a first deployment needs no guessing which file goes where."""
    out, d = Path(out_dir), broker_dir.rstrip("/")
    b = out / "broker"
    first = devices[0] if devices else "ID"
    if Path(d).resolve() == b.resolve():   # the files stay where they are: a broker in a terminal
        broker = [f"mosquitto -c {b / 'fedge.conf'}        # in a terminal of its own; Ctrl-C stops it"]
    else:
        broker = [f"sudo install -d -m 0750 -o root -g mosquitto {d}",
                  f"sudo install -m 0644 {b / 'ca.crt'} {b / 'server.crt'} -t {d}/",
                  f"sudo install -m 0640 -o root -g mosquitto {b / 'server.key'} {b / 'fedge.passwd'} "
                  f"{b / 'fedge.acl'} -t {d}/",
                  f"sudo install -m 0644 {b / 'fedge.conf'} /etc/mosquitto/conf.d/fedge.conf",
                  "sudo systemctl restart mosquitto",
                  f"# no systemd? provision with --broker-dir {b} and run: mosquitto -c {b / 'fedge.conf'}"]
    config = out / "coordinator" / "coordinator.toml"
    steps = [
        ("1. start the broker, on the machine named in the bundles (docs/deploy.md#mosquitto):", broker),
        ("2. start the devices: a flash kit per device (docs/deploy.md#flash-kits), or by hand on each with its "
         "bundle copied there:", [
            "pip wheel --no-deps -w dist .        # fedge's wheel, in the checkout",
            f"fedge-coordinator kit --deploy {out} --target pi --wheel dist/fedge-VERSION-py3-none-any.whl",
            f"fedge-client run --bundle {out / 'devices' / first}.toml --data npz:DATA.npz"]),
        ("3. run, on this machine:", [
            f'export FEDGE_MQTT_PASSWORD="$(cat {out / "coordinator" / "password"})"',
            f"fedge-coordinator run --config {config} --clients {max(1, len(devices))} --data npz:EVAL.npz "
            "--rounds 10 --out runs/first"]),
        ("4. watch the fleet, as the read-only monitor user:", [
            f'FEDGE_MQTT_PASSWORD="$(cat {out / "monitor" / "password"})" fedge-coordinator status '
            f"--config {config} --set transport.username={MONITOR_USER} --run-dir runs/first"]),
    ]
    return "next:\n" + "".join(f"  {title}\n" + "".join(f"    {line}\n" for line in lines) for title, lines in steps)
