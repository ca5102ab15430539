"""Where the broker is and how to reach it: the broker URL and the login and TLS settings.

Everything here is checked when it is made, so a malformed URL or contradictory TLS
options are a configuration error at start, never a retry loop later.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from urllib.parse import urlparse

from edge_client.wire.transport_errors import BrokerUrlError, TlsError

__all__ = ["PROTOCOLS", "BrokerSettings", "BrokerAddress", "parse_broker_address", "parse_broker_url"]

PROTOCOLS = ("auto", "5", "3.1.1")


@dataclass(frozen=True)
class BrokerSettings:
    """Where the broker is and how to talk to it.

    An ``mqtts://`` URL turns TLS on. The broker's certificate is checked against
    ``ca_file`` (or the PEM text ``ca_data``, as a device bundle carries it inline), or
    against the system's CAs when neither is given; ``cert_file`` and ``key_file`` add
    a client certificate for brokers that ask for one.
    """

    url: str = "mqtt://127.0.0.1:1883"
    username: str | None = None
    password: str | None = None
    protocol: str = "auto"          # "5", "3.1.1", or "auto" (try 5, fall back to 3.1.1)
    keepalive: int = 30
    session_expiry: int = 7 * 24 * 3600
    connect_timeout: float = 15.0
    max_message_bytes: int = 64 * 1024 * 1024
    ca_file: str | None = None
    ca_data: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    # Where the password comes from (a variable, a bundle): named when the broker refuses the login.
    password_source: str = "FEDGE_MQTT_PASSWORD"

    def __post_init__(self) -> None:
        # A malformed URL or contradictory TLS options are configuration errors now, not a retry loop later.
        address = parse_broker_address(self.url)
        given = [name for name in ("ca_file", "ca_data", "cert_file", "key_file") if getattr(self, name)]
        if given and not address.tls:
            options = ", ".join(name.replace("_data", "_file") for name in given)
            raise BrokerUrlError(f"{options} given but broker URL {self.url!r} is plain MQTT: use "
                                 f"mqtts://{address.host}:PORT (the broker's TLS listener, usually 8883)")
        if self.ca_file and self.ca_data:
            raise TlsError("give the CA certificate either as a file or inline, not both")
        if self.key_file and not self.cert_file:
            raise TlsError("a client key (key_file, --key-file) needs its certificate (cert_file, --cert-file)")

    def host_port(self) -> tuple[str, int]:
        return parse_broker_url(self.url)

    @property
    def tls(self) -> bool:
        return parse_broker_address(self.url).tls

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context for an ``mqtts://`` broker (None for ``mqtt://``); TlsError naming the file to fix.

        Built here rather than by paho's ``tls_set``, which takes neither inline CA text nor
        a minimum version: this context refuses anything older than TLS 1.2, requires a
        certificate from the broker and checks it names the host of the URL.
        """
        if not self.tls:
            return None
        for option, path in (("CA file", self.ca_file), ("client certificate", self.cert_file),
                             ("client key", self.key_file)):
            if path and not os.path.isfile(path):
                raise TlsError(f"{option} {path} does not exist: give the path of a PEM file")
        # PROTOCOL_TLS_CLIENT requires the broker's certificate and checks its host name. With a CA given,
        # only that CA is trusted: a public CA's certificate for some other host must not pass.
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            if self.ca_file or self.ca_data:
                context.load_verify_locations(cafile=self.ca_file or None, cadata=self.ca_data or None)
            else:
                context.load_default_certs(ssl.Purpose.SERVER_AUTH)
        except (ssl.SSLError, ValueError) as exc:
            where = f"CA file {self.ca_file}" if self.ca_file else "the inline CA certificate (ca_cert)"
            raise TlsError(f"{where} is not a PEM certificate ({exc}): give the CA's .crt/.pem file") from None
        except OSError as exc:
            raise TlsError(f"cannot read CA file {self.ca_file}: {exc.strerror}") from None
        if self.cert_file:
            try:
                context.load_cert_chain(self.cert_file, self.key_file or None)
            except (ssl.SSLError, ValueError) as exc:
                raise TlsError(f"client certificate {self.cert_file} and key {self.key_file or '(in the same file)'}"
                               f" do not load ({exc}): give a PEM certificate and its unencrypted key") from None
            except OSError as exc:
                raise TlsError(f"cannot read client certificate or key: {exc}") from None
        return context


@dataclass(frozen=True)
class BrokerAddress:
    """A parsed broker URL: ``tls`` for ``mqtts://``."""

    host: str
    port: int
    tls: bool


_DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}


def parse_broker_address(url: str) -> BrokerAddress:
    """Host, port and TLS of ``mqtt://HOST[:PORT]`` (1883) or ``mqtts://HOST[:PORT]`` (8883); BrokerUrlError
    saying why otherwise."""
    hint = f"broker URL {url!r} must look like mqtt://HOST:PORT (e.g. mqtt://127.0.0.1:1883)"
    if not isinstance(url, str) or "://" not in url:
        raise BrokerUrlError(f"{hint}: the mqtt:// scheme is missing")
    parsed = urlparse(url)
    if parsed.scheme not in _DEFAULT_PORTS:
        raise BrokerUrlError(f"{hint}: fedge speaks MQTT (mqtt://) or MQTT over TLS (mqtts://, e.g. "
                             f"mqtts://broker.lan:8883), not {parsed.scheme}://")
    try:
        port = parsed.port or _DEFAULT_PORTS[parsed.scheme]
    except ValueError:
        raise BrokerUrlError(f"{hint}: the port is not a number in 1..65535") from None
    if not parsed.hostname or parsed.path not in ("", "/") or parsed.query or parsed.username or parsed.password:
        raise BrokerUrlError(f"{hint}: give only a host and a port (credentials go in --username and "
                             "the FEDGE_MQTT_PASSWORD variable)")
    return BrokerAddress(parsed.hostname, port, parsed.scheme == "mqtts")


def parse_broker_url(url: str) -> tuple[str, int]:
    """(host, port) of a broker URL (see :func:`parse_broker_address`)."""
    address = parse_broker_address(url)
    return address.host, address.port
