"""Provision a TLS Mosquitto deployment: CA, broker certificate, users, ACL, and one bundle per device.

``fedge-coordinator provision`` writes everything a deployment needs into one
directory, so no secret is ever typed or pasted:

- ``ca.crt`` (and ``ca.key`` when the CA is made here): the certificate authority.
- ``broker/``: the broker's certificate and key for its host name or IP, the password
  file (Mosquitto 2's PBKDF2-SHA512 format), the ACL and ``fedge.conf``, a TLS listener
  with ``allow_anonymous false`` and ``use_username_as_clientid true``.
- ``coordinator/``: ``coordinator.toml`` (the ``[transport]`` section to run with) and
  ``password``.
- ``monitor/password``: the read-only ``monitor`` user's, for ``fedge-coordinator status``.
- ``devices/ID.toml``: one bundle per device (:mod:`edge_client.bundle`); a site's devices' bundles name
  their site broker.
- ``sites/NAME/`` for each site (:mod:`coordinator.ops.sites`): the site broker's certificate, password
  file, ACL and ``fedge.conf`` with the bridge to the central broker, and ``aggregator.toml``, the site
  aggregator's bundle, when the site has one. The bridge's user goes into the central broker's password
  file and ACL, with rights to its site's topics only.

Keys, passwords and bundles are written with mode 0600 and never logged or printed.
Certificates are made with the ``openssl`` command, which every Linux that runs
Mosquitto has, rather than a Python dependency.
"""

from __future__ import annotations

import base64
import getpass
import hashlib
import ipaddress
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.ops.provision_texts import (COORDINATOR_USER, MONITOR_USER, bridge_conf, broker_acl, bundle_comment,
                                             aggregator_comment, coordinator_toml, mosquitto_conf,
                                             site_acl)
from coordinator.ops.sites import Site, SiteError, check_sites
from edge_client.bundle import Bundle, BundleError, bundle_toml, read_bundle
from edge_client.wire.protocol import ProtocolError, Topics, valid_client_id
from storage.errors import FedgeError

__all__ = ["ProvisionError", "Provisioned", "provision", "rotate_password", "device_ids", "read_names",
           "password_line", "write_file", "COORDINATOR_USER", "MONITOR_USER"]

CA_DAYS = 3650
SERVER_DAYS = 825
# Mosquitto 2's default iteration count. The passwords are 192 random bits, which no amount of
# key stretching would make stronger, and every login costs the broker these iterations.
PBKDF2_ITERATIONS = 101


class ProvisionError(FedgeError, RuntimeError):
    """Provisioning cannot go on; the message says what to fix."""


@dataclass(frozen=True)
class Provisioned:
    """Where things were written (no secrets)."""

    out_dir: Path
    broker_conf: Path
    coordinator_config: Path
    coordinator_password: Path
    bundles: dict[str, Path]
    monitor_password: Path
    ca_created: bool
    workers: dict[str, Path] = field(default_factory=dict)   # aggregation worker user -> its password file
    sites: dict[str, Path] = field(default_factory=dict)     # site name -> its directory (sites/NAME)


def worker_ids(count: int) -> list[str]:
    """The users of ``count`` aggregation workers: ``worker-1``, ``worker-2``, ... (also their ``--id``)."""
    if count < 0:
        raise ProvisionError("--workers must be 0 or more")
    return [f"worker-{i}" for i in range(1, count + 1)]


def device_ids(count: int) -> list[str]:
    if count < 1:
        raise ProvisionError("--devices must be at least 1")
    return [f"device-{i:03d}" for i in range(1, count + 1)]


def read_names(path: Path) -> list[str]:
    """Device ids from a file, one a line; blank lines and ``#`` comments are skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ProvisionError(f"cannot read --names {path}: {exc.strerror}") from None
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


def _check_ids(ids: list[str]) -> None:
    bad = [i for i in ids if not valid_client_id(i)]
    if bad:
        raise ProvisionError(f"bad device ids {bad}: use 1-64 letters, digits, '_', '.', '-' (each is a client id, "
                             "an MQTT user name and a topic level)")
    for reserved, whose in ((COORDINATOR_USER, "the coordinator's"), (MONITOR_USER, "the read-only monitor's")):
        if reserved in ids:
            raise ProvisionError(f"{reserved!r} is {whose} user name: rename that device")
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ProvisionError(f"device ids must be unique; repeated: {', '.join(duplicates)}")
    if not ids:
        raise ProvisionError("no device ids: the --names file is empty")


def password_line(username: str, password: str, *, salt: bytes | None = None) -> str:
    """A Mosquitto 2 password-file line (``$7$``: PBKDF2-SHA512), made here so no password is ever put on
    a command line (``mosquitto_passwd -b``), where other users could read it in the process list."""
    salt = salt if salt is not None else secrets.token_bytes(12)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, PBKDF2_ITERATIONS)
    return (f"{username}:$7${PBKDF2_ITERATIONS}${base64.b64encode(salt).decode()}$"
            f"{base64.b64encode(digest).decode()}")


def _new_password() -> str:
    return secrets.token_urlsafe(24)


def write_file(path: Path, text: str, mode: int) -> None:
    """Write ``text`` to ``path`` with ``mode`` from the first byte (replacing it atomically when it exists)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _openssl(*args: str, stdin: str | None = None) -> str:
    binary = shutil.which("openssl")
    if binary is None:
        raise ProvisionError("the openssl command is not installed: apt-get install openssl")
    done = subprocess.run([binary, *args], input=stdin, capture_output=True, text=True)
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise ProvisionError(f"openssl {args[0]} failed: {tail}")
    return done.stdout


def _new_key(path: Path) -> None:
    """A P-256 private key, written 0600 by us (openssl's own -out would leave the mode to the umask)."""
    write_file(path, _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256"), 0o600)


def _make_ca(ca_crt: Path, ca_key: Path) -> None:
    _new_key(ca_key)
    pem = _openssl("req", "-x509", "-new", "-key", str(ca_key), "-sha256", "-days", str(CA_DAYS),
                   "-subj", "/CN=fedge deployment CA", "-addext", "basicConstraints=critical,CA:TRUE",
                   "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    write_file(ca_crt, pem, 0o644)


def _check_ca(ca_crt: Path, ca_key: Path) -> None:
    """A given CA certificate and key must belong together, or every device would refuse the broker later."""
    for what, path in (("--ca-cert", ca_crt), ("--ca-key", ca_key)):
        if not path.is_file():
            raise ProvisionError(f"{what} {path} does not exist")
    cert_pub = _openssl("x509", "-in", str(ca_crt), "-noout", "-pubkey")
    key_pub = _openssl("pkey", "-in", str(ca_key), "-pubout")
    if cert_pub.strip() != key_pub.strip():
        raise ProvisionError(f"--ca-key {ca_key} is not the key of --ca-cert {ca_crt}: give the pair that belongs "
                             "together")


def _subject_alt_names(hosts: list[str]) -> str:
    names = []
    for host in hosts:
        try:
            names.append(f"IP:{ipaddress.ip_address(host)}")
        except ValueError:
            names.append(f"DNS:{host}")
    return ",".join(names)


def _make_server_cert(hosts: list[str], ca_crt: Path, ca_key: Path, crt: Path, key: Path) -> None:
    """The broker's certificate, naming every host devices use in their URL (subjectAltName)."""
    _new_key(key)
    csr = _openssl("req", "-new", "-key", str(key), "-subj", f"/CN={hosts[0]}")
    with tempfile.TemporaryDirectory() as tmp:
        ext = Path(tmp) / "ext.cnf"
        ext.write_text(f"subjectAltName={_subject_alt_names(hosts)}\nbasicConstraints=critical,CA:FALSE\n"
                       "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n")
        pem = _openssl("x509", "-req", "-CA", str(ca_crt), "-CAkey", str(ca_key), "-set_serial",
                       str(secrets.randbits(63)), "-days", str(SERVER_DAYS), "-sha256", "-extfile", str(ext),
                       stdin=csr)
    write_file(crt, pem, 0o644)


def provision(out_dir: Path, *, hosts: list[str], devices: list[str], port: int = 8883, prefix: str = "fedge",
              ca_cert: Path | None = None, ca_key: Path | None = None, broker_dir: str = "/etc/mosquitto/fedge",
              listen: str = "", workers: int = 0, sites: Sequence[Site] = ()) -> Provisioned:
    """Write a whole deployment into ``out_dir`` (which must not exist or be empty); see the module docstring.

    ``hosts``: the broker's host names or IPs, all named in its certificate; the first goes into
    the bundles' URL and the sites' bridges. ``broker_dir``: where the broker's files will be
    installed, which ``fedge.conf`` refers to (on the site brokers too). ``listen``: the address
    the listeners bind (empty: all). ``sites``: devices that log in to a site broker instead.
    """
    out_dir = Path(out_dir).resolve()
    agents = _check_request(out_dir, devices, workers, hosts, port, prefix, ca_cert, ca_key, sites)
    out_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(out_dir, 0o700)   # it holds every secret of the deployment
    broker = out_dir / "broker"
    ca_pem, ca_pair = _write_certificates(out_dir, hosts, ca_cert, ca_key)

    host = hosts[0]
    url = f"mqtts://{f'[{host}]' if ':' in host else host}:{port}"
    site_of = {d: site for site in sites for d in site.devices}
    bridges = [site.bridge_user for site in sites]
    site_agents = [site.aggregator_user for site in sites if site.aggregator_user]
    passwords = {COORDINATOR_USER: _new_password(), MONITOR_USER: _new_password(), **{u: _new_password() for u in devices + agents + bridges
                                                       + site_agents}}
    central = [COORDINATOR_USER, MONITOR_USER, *(d for d in devices if d not in site_of), *agents, *bridges]
    write_file(broker / "fedge.passwd", _passwd(passwords, central), 0o600)
    write_file(broker / "fedge.acl", broker_acl(prefix, agents, sites, broker_dir), 0o644)
    in_place = Path(broker_dir).resolve() == broker.resolve()   # a broker run in a terminal from this directory
    write_file(broker / "fedge.conf", mosquitto_conf(port, listen, broker_dir,
                                                     run_as=getpass.getuser() if in_place else None), 0o644)
    coordinator = out_dir / "coordinator"
    write_file(coordinator / "password", passwords[COORDINATOR_USER] + "\n", 0o600)
    write_file(out_dir / "monitor" / "password", passwords[MONITOR_USER] + "\n", 0o600)
    write_file(coordinator / "coordinator.toml",
               coordinator_toml(url, prefix, out_dir, workers + len(site_agents), bool(site_agents) and not workers),
               0o644)
    bundles = {}
    for device in devices:
        path = out_dir / "devices" / f"{device}.toml"
        bundle = Bundle(broker=site_of[device].url if device in site_of else url, client_id=device, username=device,
                        password=passwords[device], prefix=prefix, ca_cert=ca_pem)
        write_file(path, bundle_toml(bundle, comment=bundle_comment(device)), 0o600)
        bundles[device] = path
    worker_passwords = {}
    for agent in agents:   # the worker reads it from the variable transport.password_env names
        worker_passwords[agent] = out_dir / "workers" / f"{agent}.password"
        write_file(worker_passwords[agent], passwords[agent] + "\n", 0o600)
    centre = f"{host}:{port}"
    site_dirs = {site.name: _write_site(out_dir / "sites" / site.name, site, prefix=prefix, centre=centre,
                                        passwords=passwords, ca_pem=ca_pem, ca_pair=ca_pair, listen=listen,
                                        broker_dir=broker_dir) for site in sites}
    return Provisioned(out_dir, broker / "fedge.conf", coordinator / "coordinator.toml", coordinator / "password",
                       bundles, out_dir / "monitor" / "password", ca_created=ca_cert is None, workers=worker_passwords, sites=site_dirs)


def _passwd(passwords: dict[str, str], users: Sequence[str]) -> str:
    """A Mosquitto password file with these users' lines."""
    return "".join(password_line(u, passwords[u]) + "\n" for u in users)


def _write_site(site_dir: Path, site: Site, *, prefix: str, centre: str, passwords: dict[str, str], ca_pem: str,
                ca_pair: tuple[Path, Path], listen: str, broker_dir: str) -> Path:
    """A site broker's files: its certificate for the site host, its devices' and aggregator's passwords and
    ACL, and ``fedge.conf`` (its TLS listener and the bridge, with the bridge user's password: 0600)."""
    write_file(site_dir / "ca.crt", ca_pem, 0o644)
    _make_server_cert([site.host], *ca_pair, site_dir / "server.crt", site_dir / "server.key")
    users = [*site.devices, *([site.aggregator_user] if site.aggregator_user else [])]
    write_file(site_dir / "fedge.passwd", _passwd(passwords, users), 0o600)
    write_file(site_dir / "fedge.acl", site_acl(prefix, site), 0o644)
    conf = mosquitto_conf(site.port, listen, broker_dir) + bridge_conf(site, prefix, centre,
                                                                       passwords[site.bridge_user], broker_dir)
    write_file(site_dir / "fedge.conf", conf, 0o600)
    if site.aggregator_user:
        agent = site.aggregator_user
        bundle = Bundle(broker=site.url, client_id=agent, username=agent, password=passwords[agent], prefix=prefix,
                        ca_cert=ca_pem)
        write_file(site_dir / "aggregator.toml", bundle_toml(bundle, comment=aggregator_comment(site.name)), 0o600)
    return site_dir


def _check_request(out_dir: Path, devices: list[str], workers: int, hosts: list[str], port: int, prefix: str,
                   ca_cert: Path | None, ca_key: Path | None, sites: Sequence[Site] = ()) -> list[str]:
    """Refuse a provisioning request before anything is written, so a mistake leaves no half-made
    deployment behind; return the aggregation workers' user names."""
    _check_ids(devices)
    agents = worker_ids(workers)
    if set(agents) & set(devices):
        raise ProvisionError(f"device ids {sorted(set(agents) & set(devices))} are aggregation workers' user names: "
                             "rename those devices")
    try:
        check_sites(sites, devices, [COORDINATOR_USER, MONITOR_USER, *agents])
    except SiteError as exc:
        raise ProvisionError(str(exc)) from None
    if not hosts or not all(hosts):
        raise ProvisionError("give the broker's host name or IP with --broker-host (as devices will reach it)")
    if not 1 <= port <= 65535:
        raise ProvisionError(f"--port {port} is not in 1..65535")
    if (ca_cert is None) != (ca_key is None):
        raise ProvisionError("give both --ca-cert and --ca-key, or neither (a new CA is made)")
    try:
        Topics(prefix)
    except ProtocolError as exc:
        raise ProvisionError(str(exc)) from None
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ProvisionError(f"{out_dir} is not empty: give a new --out directory (to change one device's "
                             "password there, use --rotate ID)")
    return agents


def _write_certificates(out_dir: Path, hosts: list[str], ca_cert: Path | None,
                        ca_key: Path | None) -> tuple[str, tuple[Path, Path]]:
    """The CA (made here, or the given pair copied after checking they belong together) and the broker's
    certificate signed by it; return the CA certificate's PEM text, which every bundle carries, and the
    CA's certificate and key files (the site brokers' certificates are signed with them too)."""
    broker = out_dir / "broker"
    if ca_cert is None or ca_key is None:
        _make_ca(out_dir / "ca.crt", out_dir / "ca.key")
        ca_crt_path, ca_key_path = out_dir / "ca.crt", out_dir / "ca.key"
    else:
        _check_ca(Path(ca_cert), Path(ca_key))
        write_file(out_dir / "ca.crt", Path(ca_cert).read_text(encoding="utf-8"), 0o644)
        ca_crt_path, ca_key_path = out_dir / "ca.crt", Path(ca_key)
    ca_pem = ca_crt_path.read_text(encoding="utf-8")
    write_file(broker / "ca.crt", ca_pem, 0o644)
    _make_server_cert(hosts, ca_crt_path, ca_key_path, broker / "server.crt", broker / "server.key")
    return ca_pem, (ca_crt_path, ca_key_path)


def rotate_password(out_dir: Path, user: str) -> Path:
    """Give ``user`` (a device, an aggregation worker, a site aggregator or ``coordinator``) a new password in
    the provisioning directory: its line in ``broker/fedge.passwd`` (a site's own users: its site's
    ``sites/NAME/fedge.passwd``) and its bundle or password file. Returns the file to deliver."""
    out_dir = Path(out_dir).resolve()
    passwd = out_dir / "broker" / "fedge.passwd"
    if not passwd.is_file():
        raise ProvisionError(f"{passwd} does not exist: give the --out directory of an earlier provision")
    files = [passwd, *sorted((out_dir / "sites").glob("*/fedge.passwd"))]   # a site device's is its site's
    holders = {line.split(":", 1)[0]: path for path in files for line in path.read_text(encoding="utf-8").splitlines()}
    if user not in holders:
        raise ProvisionError(f"no user {user!r} in {', '.join(map(str, files))}; users: {', '.join(holders)}")
    if user.startswith("bridge-") and (out_dir / "sites" / user.removeprefix("bridge-") / "fedge.conf").is_file():
        raise ProvisionError(f"{user} is a site bridge, whose password is also in its site's fedge.conf: "
                             "provision the deployment again to change it")
    passwd = holders[user]
    lines = passwd.read_text(encoding="utf-8").splitlines()
    users = [line.split(":", 1)[0] for line in lines]
    password = _new_password()
    aggregator = out_dir / "sites" / user.removeprefix("agg-") / "aggregator.toml"
    own_files = {COORDINATOR_USER: "coordinator/password", MONITOR_USER: "monitor/password"}
    if user in own_files or (out_dir / "workers" / f"{user}.password").is_file():
        target = out_dir / own_files.get(user, f"workers/{user}.password")
        write_file(target, password + "\n", 0o600)
    else:
        site_agent = user.startswith("agg-") and aggregator.is_file()
        target = aggregator if site_agent else out_dir / "devices" / f"{user}.toml"
        try:
            old = read_bundle(target)
        except BundleError as exc:
            raise ProvisionError(str(exc)) from None
        fresh = Bundle(broker=old.broker, client_id=old.client_id, username=old.username, password=password,
                       prefix=old.prefix, ca_cert=old.ca_cert)
        comment = aggregator_comment(user.removeprefix("agg-")) if site_agent else bundle_comment(user)
        write_file(target, bundle_toml(fresh, comment=comment), 0o600)
    lines[users.index(user)] = password_line(user, password)
    write_file(passwd, "\n".join(lines) + "\n", 0o600)
    return target
