"""Why a connection to the broker failed, in words that say what to fix.

A TLS port given as ``mqtt://``, a plain one as ``mqtts://``, an unknown CA and a
refused login all look alike from paho (no CONNACK, a closed socket); these helpers
tell them apart, so :mod:`edge_client.wire.mqtt_transport` can stop retrying what no
retry can fix and name the setting to change.
"""

from __future__ import annotations

import socket
import ssl
import uuid

from edge_client.wire.broker_settings import BrokerSettings
from edge_client.wire.transport_errors import TransportError

__all__ = ["NoConnack", "LoginRefused", "LOGIN_REFUSED", "tls_failure", "scheme_mismatch", "login_refused"]


class NoConnack(TransportError):
    """Something listens at the port but gave no CONNACK: a broker of the other scheme, perhaps."""


class LoginRefused(TransportError):
    """The broker answered and refused the user name and password."""


def tls_failure(exc: ssl.SSLError, settings: BrokerSettings, host: str, port: int) -> str | None:
    """What to fix for a handshake failure no retry can cure; None for a transient one (connection cut)."""
    if isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)):
        return None
    ca = (f"the CA in {settings.ca_file}" if settings.ca_file else
          "the bundle's CA (ca_cert)" if settings.ca_data else "the system's CAs")
    if isinstance(exc, ssl.SSLCertVerificationError):
        if exc.verify_code in (62, 64) or "match" in str(exc.verify_message).lower():   # host name or IP mismatch
            return (f"TLS: the broker's certificate at {host}:{port} does not name {host!r} "
                    f"({exc.verify_message}): connect with the host name or IP the certificate was made for, "
                    f"or re-provision the broker's certificate for {host}")
        return (f"TLS: the broker's certificate at {host}:{port} is not signed by {ca} ({exc.verify_message}): "
                "give the deployment's CA certificate (--ca-file, transport.ca_file, or the device's bundle)")
    reason = getattr(exc, "reason", "") or str(exc)
    if reason == "WRONG_VERSION_NUMBER":
        return (f"TLS: {host}:{port} does not speak TLS: use mqtt:// for a plain listener, or the port of the "
                "broker's TLS listener (usually 8883)")
    return f"TLS handshake with {host}:{port} failed ({reason}): check the CA, client certificate and TLS version"


def _speaks_tls(host: str, port: int, timeout: float) -> bool:
    """Whether ``host:port`` completes a TLS handshake. Only a probe, after a plain connect failed: the
    certificate is not checked and nothing is sent over the connection."""
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    probe.check_hostname = False
    probe.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout) as raw, probe.wrap_socket(raw, server_hostname=host):
            return True
    except OSError:   # ssl.SSLError included: not a TLS listener
        return False


def _speaks_plain_mqtt(host: str, port: int, timeout: float) -> bool:
    """Whether ``host:port`` answers a plain MQTT 3.1.1 CONNECT with a CONNACK (a refusal counts: it is
    still MQTT). Only a probe, after a TLS connect failed: a throwaway client id, a clean session, no login."""
    client_id = f"fedge-probe-{uuid.uuid4().hex[:12]}".encode()
    body = b"\x00\x04MQTT\x04\x02\x00\x05" + len(client_id).to_bytes(2, "big") + client_id
    try:
        with socket.create_connection((host, port), timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(bytes([0x10, len(body)]) + body)
            return sock.recv(1)[:1] == b"\x20"
    except OSError:
        return False


def scheme_mismatch(settings: BrokerSettings, host: str, port: int) -> str | None:
    """The scheme to use when the port speaks the other one, or None. ``mqtt://`` at a TLS listener and
    ``mqtts://`` at a plain one fail like a dead broker or a refused login, so the port is asked."""
    timeout = min(3.0, settings.connect_timeout)
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if settings.tls and _speaks_plain_mqtt(host, port, timeout):
        return (f"{settings.url}: the port speaks plain MQTT, not TLS; use mqtt://{where}, or the port of the "
                "broker's TLS listener (usually 8883)")
    if not settings.tls and _speaks_tls(host, port, timeout):
        return (f"{settings.url}: the broker answered with TLS; use mqtts://{where} (with the CA that signed its "
                "certificate: --ca-file, transport.ca_file or the device's bundle)")
    return None


# CONNACK reason codes of a refused login (paho gives MQTT 3.1.1's return codes 4 and 5 the same codes).
LOGIN_REFUSED = {134: "bad user name or password", 135: "not authorized"}


def login_refused(settings: BrokerSettings, why: str) -> str:
    """What to fix when the broker refused the login: the user tried, and whether a password was given."""
    if not settings.username:
        return (f"the broker refused a login without a user name: {why}; give the user name (--username, "
                f"$FEDGE_MQTT_USERNAME or transport.username) and its password in {settings.password_source}")
    if not settings.password:
        return (f"the broker refused user {settings.username!r}: {why}, and {settings.password_source} is empty; "
                "export the user's password")
    return (f"the broker refused user {settings.username!r}: {why}; check the password in "
            f"{settings.password_source} against the broker's password file")
