"""The one place that talks MQTT (paho-mqtt 2.x), plus an in-process stand-in.

Both transports move opaque byte payloads between topics and deliver incoming
messages through a bounded queue, so the client loop and the round engine are the
same code whichever is used. They never look inside a payload.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import time
import uuid
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Iterable
from urllib.parse import urlparse

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edge_client.wire.throttle import ThrottledLog
from storage.errors import FedgeError

__all__ = [
    "TransportError",
    "MessageTooLarge",
    "TlsError",
    "BrokerSettings",
    "BrokerUrlError",
    "BrokerAddress",
    "parse_broker_address",
    "parse_broker_url",
    "Will",
    "Incoming",
    "Transport",
    "MqttTransport",
    "InprocHub",
    "InprocTransport",
]

log = logging.getLogger("fedge.transport")
PROTOCOLS = ("auto", "5", "3.1.1")


class TransportError(FedgeError, RuntimeError):
    """The broker could not be reached or refused us; the message says what to check."""


class MessageTooLarge(TransportError):
    """A message over our size limit (with chunking off) or over the broker's maximum packet size."""


class TlsError(TransportError):
    """TLS cannot work as configured (missing file, unknown CA, wrong host name, a TLS port given as
    mqtt:// or a plain one as mqtts://): no retry can fix it."""


class _NoConnack(TransportError):
    """Something listens at the port but gave no CONNACK: a broker of the other scheme, perhaps."""


class _LoginRefused(TransportError):
    """The broker answered and refused the user name and password."""


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


class BrokerUrlError(TransportError, ValueError):
    """A broker URL fedge cannot use; no retry can fix it."""


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


def _tls_failure(exc: ssl.SSLError, settings: BrokerSettings, host: str, port: int) -> str | None:
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


def _scheme_mismatch(settings: BrokerSettings, host: str, port: int) -> str | None:
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
_LOGIN_REFUSED = {134: "bad user name or password", 135: "not authorized"}


def _login_refused(settings: BrokerSettings, why: str) -> str:
    """What to fix when the broker refused the login: the user tried, and whether a password was given."""
    if not settings.username:
        return (f"the broker refused a login without a user name: {why}; give the user name (--username, "
                f"$FEDGE_MQTT_USERNAME or transport.username) and its password in {settings.password_source}")
    if not settings.password:
        return (f"the broker refused user {settings.username!r}: {why}, and {settings.password_source} is empty; "
                "export the user's password")
    return (f"the broker refused user {settings.username!r}: {why}; check the password in "
            f"{settings.password_source} against the broker's password file")


@dataclass(frozen=True)
class Will:
    """Last-will message the broker publishes if we vanish without disconnecting."""

    topic: str
    payload: bytes
    retain: bool = True


@dataclass(frozen=True)
class Incoming:
    topic: str
    payload: bytes
    # time.monotonic() when the message reached this process, for the receiver's profile
    received_at: float = field(default_factory=time.monotonic, compare=False)
    wire_bytes: int = 0      # bytes it took on the wire (all chunks); set by edge_client.wire.chunking
    error: str = ""          # set instead of a payload when reassembling its chunks failed


class Transport:
    """What the client loop and the coordinator need from a transport."""

    def subscribe(self, topic_filter: str) -> None:
        raise NotImplementedError

    def unsubscribe(self, topic_filter: str) -> None:
        raise NotImplementedError

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        raise NotImplementedError

    def announce(self, topic: str, payload: bytes) -> None:
        """Publish a retained "birth" message now and again after every reconnect.

        A broker that fired our last will during a network drop keeps saying we are
        offline until we say otherwise, so the presence must follow each reconnect.
        """
        self.publish(topic, payload, retain=True)

    def get(self, timeout: float) -> Incoming | None:
        """Next incoming message, or None after ``timeout`` seconds."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def prefer(self, topics: Iterable[str]) -> None:
        """Read these topics' waiting messages before any other's (the results a round waits for)."""
        inbox = getattr(self, "_inbox", None)
        if inbox is not None:
            inbox.prefer(topics)

    @property
    def dropped_by(self) -> dict[str, int]:
        """Messages received but dropped before anyone read them, by reason (a full or flooded inbox)."""
        inbox = getattr(self, "_inbox", None)
        return dict(inbox.dropped_by) if inbox is not None else {}

    # Whether the broker is reachable now (an in-process hub always is), and the connections to it
    # lost since connect(): what a device saw of it. A transport with a broker keeps them up to date.
    connected: bool = True
    disconnects: int = 0

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Inbox:
    """What arrived and is not read yet: one queue per topic, served in turn, bounded in total and per topic.

    A device flooding its own topic (or a broken one resending in a loop) must not
    crowd out everyone else: a topic may hold at most ``share`` of the inbox's messages
    and bytes, beyond which its newest messages are dropped, and :meth:`get` takes one
    message from each topic in turn, so the others' results are read at their own pace
    however much one topic holds. Each topic also has a token bucket (``burst`` messages,
    refilled at ``rate`` a second): a legitimate device sends a few chunked messages a
    round, so a topic publishing faster than that for long is flooding, and its excess is
    dropped on arrival, before it costs a decode. Topics named by :meth:`prefer` (the
    result topics of the clients selected this round) are served before the rest. Drops
    are counted by reason (:attr:`dropped_by`) and their warnings throttled.
    """

    def __init__(self, maxsize: int, max_bytes: int = 256 * 1024 * 1024, share: float = 0.25,
                 rate: float = 200.0, burst: int = 2_000) -> None:
        self.maxsize, self.max_bytes = maxsize, max_bytes
        self.topic_messages = max(1, int(maxsize * share))
        self.topic_bytes = max(1, int(max_bytes * share))
        self.rate, self.burst = rate, burst
        self._buckets: dict[str, tuple[float, float]] = {}   # topic -> (tokens, when counted)
        self._preferred: frozenset[str] = frozenset()
        self._queues: OrderedDict[str, deque[Incoming]] = OrderedDict()   # topics in serving order
        self._bytes: dict[str, int] = {}
        self._count = self._total_bytes = 0
        self._ready = threading.Condition()
        self.dropped_by: Counter[str] = Counter()
        self._warn = ThrottledLog(log)

    @property
    def dropped(self) -> int:
        return sum(self.dropped_by.values())

    def put(self, item: Incoming) -> None:
        size = len(item.payload)
        with self._ready:
            queue_ = self._queues.get(item.topic)
            held = len(queue_) if queue_ is not None else 0
            if not self._take_token(item.topic, item.received_at):
                reason = "one topic over its rate limit"
            elif held >= self.topic_messages or self._bytes.get(item.topic, 0) + size > self.topic_bytes:
                reason = "one topic over its share of the inbox"
            elif self._count >= self.maxsize or self._total_bytes + size > self.max_bytes:
                reason = "inbox full"
            else:
                if queue_ is None:
                    queue_ = self._queues[item.topic] = deque()
                queue_.append(item)
                self._bytes[item.topic] = self._bytes.get(item.topic, 0) + size
                self._count += 1
                self._total_bytes += size
                self._ready.notify()
                return
            self.dropped_by[reason] += 1
        self._warn.warning("dropped a message on %s: %s", item.topic, reason)

    def prefer(self, topics: Iterable[str]) -> None:
        """Serve these topics' messages before any other's until the next call."""
        with self._ready:
            self._preferred = frozenset(topics)

    def _take_token(self, topic: str, now: float) -> bool:
        """Spend one of the topic's tokens; False when it has none left (call holding the lock)."""
        tokens, then = self._buckets.get(topic, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate)
        if tokens < 1.0:
            self._buckets[topic] = (tokens, now)
            return False
        self._buckets[topic] = (tokens - 1.0, now)
        if len(self._buckets) > 4 * self.maxsize:   # forget topics whose bucket has refilled
            full = [t for t, (k, w) in self._buckets.items() if k + (now - w) * self.rate >= self.burst]
            for t in full:
                del self._buckets[t]
        return True

    def get(self, timeout: float) -> Incoming | None:
        deadline = time.monotonic() + max(0.0, timeout)
        with self._ready:
            while not self._queues:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._warn.flush()
                    return None
                self._ready.wait(remaining)
            topic = next((t for t in self._queues if t in self._preferred), None) if self._preferred else None
            if topic is None:
                topic = next(iter(self._queues))
            queue_ = self._queues[topic]
            item = queue_.popleft()
            if queue_:
                self._queues.move_to_end(topic)     # the next topic's turn
            else:
                del self._queues[topic]
                self._bytes.pop(topic, None)
            if topic in self._bytes:
                self._bytes[topic] -= len(item.payload)
            self._count -= 1
            self._total_bytes -= len(item.payload)
            return item


class MqttTransport(Transport):
    """paho-mqtt client with a persistent session, QoS 1 and automatic reconnects.

    Subscriptions are remembered and renewed on every (re)connect, so a broker that
    lost our session still delivers. Call :meth:`connect` explicitly; the
    constructor does no I/O.
    """

    def __init__(self, settings: BrokerSettings, client_id: str, *, will: Will | None = None,
                 queue_size: int = 10_000) -> None:
        if settings.protocol not in PROTOCOLS:
            raise TransportError(f"MQTT protocol must be one of {PROTOCOLS}, got {settings.protocol!r}")
        self.settings = settings
        self.client_id = client_id
        self.will = will
        self.protocol: str | None = None
        self._inbox = _Inbox(queue_size)
        self._filters: list[str] = []
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._refused: str | None = None
        self._refused_login: str | None = None   # why the broker refused our user name and password
        self._client: mqtt.Client | None = None
        self._birth: tuple[str, bytes] | None = None
        self._broker_max: int | None = None   # the broker's maximum packet size, when it tells (MQTT 5)
        self._subscribing: dict[int, str] = {}   # SUBSCRIBE packet id -> topic filter, until its SUBACK
        self.denied: set[str] = set()            # topic filters the broker refused to let us read or write
        # PUBLISH packet id -> topic until its PUBACK, and refusals whose PUBACK beat publish() returning.
        # No lock: paho calls on_publish holding its own lock, which publish() takes too.
        self._publishing: dict[int, str] = {}
        self._sizes: dict[int, int] = {}             # in-flight publish -> its packet size
        self._connected_at = 0.0
        self.disconnects = 0                 # connections lost since connect(): what a device saw of the broker
        self._oversize_strikes: dict[int, int] = {}  # packet size -> disconnects right after sending it
        self._too_large: int | None = None           # smallest packet the broker was seen to refuse
        self._refused_early: dict[int, object] = {}
        self._ssl_context: ssl.SSLContext | None = None

    # -- connection -------------------------------------------------------------
    def connect(self) -> "MqttTransport":
        """Connect, trying MQTT 5 then 3.1.1 when the protocol is ``auto``."""
        candidates = ["5", "3.1.1"] if self.settings.protocol == "auto" else [self.settings.protocol]
        self._ssl_context = self.settings.ssl_context()   # TlsError now for a missing or bad file
        reasons: list[str] = []
        refused: list[str] = []
        listening = False   # a connection was made but nothing answered it as MQTT
        for protocol in candidates:
            # Some 3.1.1-only brokers never answer a v5 CONNECT that carries credentials,
            # so the v5 probe of ``auto`` gets a short timeout.
            timeout = min(5.0, self.settings.connect_timeout) if len(candidates) > 1 and protocol == "5" \
                else self.settings.connect_timeout
            try:
                self._connect_with(protocol, timeout)
                return self
            except TlsError:
                raise   # the other protocol version would fail the same handshake
            except TransportError as exc:
                reasons.append(f"MQTT {protocol}: {exc}")
                refused += [str(exc)] if isinstance(exc, _LoginRefused) else []
                listening |= isinstance(exc, _NoConnack)
        if refused:
            raise TransportError(_login_refused(self.settings, refused[-1]))
        mismatch = _scheme_mismatch(self.settings, *self.settings.host_port()) if listening else None
        if mismatch is not None:
            raise TlsError(mismatch)
        raise TransportError(f"could not connect to {self.settings.url} as {self.client_id!r} ("
                             + "; ".join(reasons) + "). Is the broker running and are the credentials right?")

    def _connect_with(self, protocol: str, timeout: float) -> None:
        v5 = protocol == "5"
        client = mqtt.Client(
            callback_api_version=CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311,
            clean_session=None if v5 else False,
        )
        if self.settings.username is not None:
            client.username_pw_set(self.settings.username, self.settings.password)
        if self.will is not None:
            client.will_set(self.will.topic, self.will.payload, qos=1, retain=self.will.retain)
        client.reconnect_delay_set(min_delay=1, max_delay=30)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_subscribe = self._on_subscribe
        client.on_publish = self._on_publish
        if self._ssl_context is not None:
            client.tls_set_context(self._ssl_context)
        props = None
        if v5:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = self.settings.session_expiry
        host, port = self.settings.host_port()
        self._connected.clear()
        self._refused = None
        self._refused_login = None
        self._client = client
        try:
            client.connect(host, port, keepalive=self.settings.keepalive,
                           clean_start=False if v5 else mqtt.MQTT_CLEAN_START_FIRST_ONLY, properties=props)
        except ssl.SSLError as exc:
            self._client = None
            fix = _tls_failure(exc, self.settings, host, port)
            if fix is not None:
                raise TlsError(fix) from None
            raise _NoConnack(f"{host}:{port} closed the TLS handshake ({exc})") from None
        except OSError as exc:
            self._client = None
            cut = isinstance(exc, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError))
            raise (_NoConnack if cut else TransportError)(f"{host}:{port} unreachable ({exc})") from None
        client.loop_start()
        deadline = time.monotonic() + timeout
        while not self._connected.wait(0.05):
            if self._refused or time.monotonic() > deadline:
                client.loop_stop()
                client.disconnect()
                self._client = None
                if self._refused_login:
                    raise _LoginRefused(self._refused_login)
                raise _NoConnack(self._refused or "no CONNACK in time")
        self.protocol = protocol
        log.debug("connected to %s as %s with MQTT %s", self.settings.url, self.client_id, protocol)

    def _on_connect(self, client: mqtt.Client, userdata: object, flags: object, reason: object,
                    properties: object) -> None:
        if getattr(reason, "is_failure", False):
            self._refused = f"broker refused the connection: {reason}"
            self._refused_login = _LOGIN_REFUSED.get(getattr(reason, "value", 0))
            return
        self._broker_max = getattr(properties, "MaximumPacketSize", None)
        self._connected_at = time.monotonic()
        if self._too_large is not None:
            self._drop_oversize(client)
        with self._lock:
            filters = list(self._filters)
        for f in filters:
            self._subscribe_with(client, f)
        if self._birth is not None:
            client.publish(self._birth[0], self._birth[1], qos=1, retain=True)
        self._connected.set()

    def _on_disconnect(self, client: mqtt.Client, userdata: object, flags: object, reason: object,
                       properties: object) -> None:
        if not self._connected.is_set() and not self._refused:
            self._refused = f"connection closed before CONNACK ({reason})"
        elif self._connected.is_set():
            self.disconnects += 1
        self._connected.clear()
        if getattr(reason, "value", 0) != 0:
            self._check_oversize(client)
            log.info("disconnected from broker (%s); reconnecting with backoff", reason)

    def _drop_oversize(self, client: mqtt.Client) -> None:
        """Take the in-flight messages over the learned limit out of paho's queue before it resends them.

        Called on connect: paho resends its queue right after this callback returns, and
        the queue must not change while it does (so not from the disconnect callback)."""
        with self._lock:
            doomed = [mid for mid, size in self._sizes.items() if size >= (self._too_large or 0)]
            for mid in doomed:
                self._sizes.pop(mid, None)
                self._publishing.pop(mid, None)
        with client._out_message_mutex:   # paho keeps in-flight messages here; no public way to drop one
            for mid in doomed:
                client._out_messages.pop(mid, None)

    def _check_oversize(self, client: mqtt.Client) -> None:
        """A broker over whose packet limit a publish goes closes the connection, and paho sends the
        message again after every reconnect, for ever. MQTT 5 brokers announce the limit (checked in
        :meth:`publish`); MQTT 3.1.1 ones do not. So: the same large packet in flight when the broker
        hangs up right after connecting, twice, is taken as over the limit; it is dropped from paho's
        queue, and :meth:`publish` refuses packets of that size from then on with an error naming the fix.
        """
        with self._lock:
            sizes = dict(self._sizes)
        if not sizes or time.monotonic() - self._connected_at > 2.0:
            return
        largest = max(sizes.values())
        strikes = self._oversize_strikes[largest] = self._oversize_strikes.get(largest, 0) + 1
        if strikes < 2:
            return
        self._too_large = largest if self._too_large is None else min(self._too_large, largest)
        log.error("the broker closes the connection whenever a %d-byte packet is sent: it is over the broker's "
                  "packet limit (max_packet_size); lower max_message_bytes so such messages are chunked",
                  self._too_large)

    def _subscribe_with(self, client: mqtt.Client, topic_filter: str) -> None:
        _, mid = client.subscribe(topic_filter, qos=1)
        if mid is not None:
            with self._lock:
                self._subscribing[mid] = topic_filter

    def _on_subscribe(self, client: mqtt.Client, userdata: object, mid: int, reasons: list[Any],
                      properties: object) -> None:
        """A refused subscription fails silently in MQTT: nothing ever arrives. Say so, and what to fix."""
        with self._lock:
            topic_filter = self._subscribing.pop(mid, "?")
        refused = [r for r in reasons if getattr(r, "is_failure", False)]
        if refused:
            self._denied(topic_filter, "read", refused[0])

    def _on_publish(self, client: mqtt.Client, userdata: object, mid: int, reason: object,
                    properties: object) -> None:
        topic = self._publishing.pop(mid, None)
        with self._lock:
            self._sizes.pop(mid, None)
        if getattr(reason, "is_failure", False):   # MQTT 5 says so; 3.1.1 brokers drop it silently
            if topic is None:
                self._refused_early[mid] = reason
            else:
                self._denied(topic, "write", reason)

    def _denied(self, topic: str, access: str, reason: object) -> None:
        """Refused access fails silently in MQTT (nothing arrives, nothing is delivered): say it, once."""
        if topic not in self.denied:
            self.denied.add(topic)
            log.error("the broker refused to let %s %s %s (%s): check the broker's ACL; with fedge's ACL "
                      "(deploy/mosquitto.acl) a device's client id must equal its MQTT user name",
                      self.client_id, access, topic, reason)

    def _on_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        self._inbox.put(Incoming(msg.topic, bytes(msg.payload)))

    # -- messaging --------------------------------------------------------------
    def subscribe(self, topic_filter: str) -> None:
        with self._lock:
            if topic_filter not in self._filters:
                self._filters.append(topic_filter)
        if self._client is not None:
            self._subscribe_with(self._client, topic_filter)

    def unsubscribe(self, topic_filter: str) -> None:
        with self._lock:
            if topic_filter in self._filters:
                self._filters.remove(topic_filter)
        if self._client is not None:
            self._client.unsubscribe(topic_filter)

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        """Publish at QoS 1; refuse what our limit or the broker's maximum packet size forbids.

        paho ignores the broker's limit: an oversize publish gets us disconnected and is
        resent forever, so it must never leave.
        """
        if self._client is None:
            raise TransportError("publish before connect(): call connect() first")
        if len(payload) > self.settings.max_message_bytes:
            raise MessageTooLarge(f"message of {len(payload)} bytes to {topic} exceeds "
                                  f"max_message_bytes={self.settings.max_message_bytes}")
        packet = len(payload) + len(topic.encode()) + 16   # fixed header, topic length, packet id, properties
        if self._broker_max is not None and packet > self._broker_max:
            raise MessageTooLarge(f"a {len(payload)}-byte message to {topic} does not fit the broker's maximum "
                                  f"packet size of {self._broker_max} bytes; set max_message_bytes "
                                  f"(transport.max_message_bytes, --max-message-bytes) to at most "
                                  f"{self._broker_max - len(topic.encode()) - 16} so larger messages are chunked")
        if self._too_large is not None and packet >= self._too_large:
            raise MessageTooLarge(f"a {len(payload)}-byte message to {topic} is over the broker's packet limit: "
                                  f"it closed the connection each time a {self._too_large}-byte packet was sent "
                                  f"(MQTT 3.1.1 does not announce the limit); set max_message_bytes "
                                  f"(transport.max_message_bytes, --max-message-bytes) to the broker's limit "
                                  f"(Mosquitto's max_packet_size) or lower, so larger messages are chunked")
        info = self._client.publish(topic, payload, qos=1, retain=retain)
        if info.rc == mqtt.MQTT_ERR_SUCCESS:
            self._publishing[info.mid] = topic
            with self._lock:
                self._sizes[info.mid] = packet
            if info.mid in self._refused_early:   # its PUBACK came first
                self._publishing.pop(info.mid, None)
                self._denied(topic, "write", self._refused_early.pop(info.mid))
        if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN, mqtt.MQTT_ERR_QUEUE_SIZE):
            raise TransportError(f"publish to {topic} failed: {mqtt.error_string(info.rc)}")

    def announce(self, topic: str, payload: bytes) -> None:
        self._birth = (topic, payload)
        self.publish(topic, payload, retain=True)

    def get(self, timeout: float) -> Incoming | None:
        return self._inbox.get(timeout)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def close(self, flush_timeout: float = 5.0) -> None:
        """Disconnect cleanly (no last will); the broker keeps our session.

        Publishes still in flight (a coordinator's last "finished" status, a device's
        offline presence) get up to ``flush_timeout`` seconds to be acknowledged first:
        paho drops what it has not sent when it disconnects, and devices waiting for
        that status would never leave.
        """
        deadline = time.monotonic() + flush_timeout
        while self._publishing and self._connected.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        client, self._client = self._client, None
        if client is not None:
            client.disconnect()
            client.loop_stop()

    def drop(self) -> None:
        """Vanish without DISCONNECT, as a crashed device would (the will fires)."""
        client, self._client = self._client, None
        if client is not None:
            client.loop_stop()
            sock = client.socket()
            if sock is not None:
                sock.close()


class InprocHub:
    """A broker in memory for one process: topic filters, retained messages, wills.

    It exists so experiments and tests run the real coordinator and client code,
    through the real encoder and decoder, without sockets.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Filters without wildcards by topic, the rest in a list: with hundreds of simulated clients
        # nearly every filter is exact, and a publish must not test each of them.
        self._exact: dict[str, list[InprocTransport]] = {}
        self._wild: list[tuple[str, InprocTransport]] = []
        self._retained: dict[str, bytes] = {}

    def connect(self, client_id: str | None = None, *, will: Will | None = None,
                queue_size: int = 10_000) -> "InprocTransport":
        return InprocTransport(self, client_id or uuid.uuid4().hex, will, queue_size)

    def _subscribe(self, endpoint: "InprocTransport", topic_filter: str) -> None:
        with self._lock:
            if "+" in topic_filter or "#" in topic_filter:
                self._wild.append((topic_filter, endpoint))
            else:
                self._exact.setdefault(topic_filter, []).append(endpoint)
            retained = [(t, p) for t, p in self._retained.items() if mqtt.topic_matches_sub(topic_filter, t)]
        for topic, payload in retained:
            endpoint._inbox.put(Incoming(topic, payload))

    def _unsubscribe(self, endpoint: "InprocTransport", topic_filter: str) -> None:
        with self._lock:
            self._wild = [(f, e) for f, e in self._wild if not (e is endpoint and f == topic_filter)]
            kept = [e for e in self._exact.pop(topic_filter, []) if e is not endpoint]
            if kept:
                self._exact[topic_filter] = kept

    def _publish(self, topic: str, payload: bytes, retain: bool) -> None:
        with self._lock:
            if retain and payload:
                self._retained[topic] = payload
            elif retain:   # as in MQTT, an empty retained message clears the topic's
                self._retained.pop(topic, None)
            targets = {id(e): e for e in self._exact.get(topic, ())}
            targets.update((id(e), e) for f, e in self._wild if mqtt.topic_matches_sub(f, topic))
        for endpoint in targets.values():
            endpoint._inbox.put(Incoming(topic, payload))

    def _leave(self, endpoint: "InprocTransport", *, fire_will: bool) -> None:
        with self._lock:
            self._wild = [(f, e) for f, e in self._wild if e is not endpoint]
            self._exact = {f: kept for f, es in self._exact.items() if (kept := [e for e in es if e is not endpoint])}
        if fire_will and endpoint.will is not None:
            self._publish(endpoint.will.topic, endpoint.will.payload, endpoint.will.retain)


class InprocTransport(Transport):
    def __init__(self, hub: InprocHub, client_id: str, will: Will | None, queue_size: int) -> None:
        self.hub = hub
        self.client_id = client_id
        self.will = will
        self._inbox = _Inbox(queue_size)

    def connect(self) -> "InprocTransport":
        return self

    def subscribe(self, topic_filter: str) -> None:
        self.hub._subscribe(self, topic_filter)

    def unsubscribe(self, topic_filter: str) -> None:
        self.hub._unsubscribe(self, topic_filter)

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        self.hub._publish(topic, bytes(payload), retain)

    def get(self, timeout: float) -> Incoming | None:
        return self._inbox.get(timeout)

    def close(self) -> None:
        self.hub._leave(self, fire_will=False)

    def drop(self) -> None:
        self.hub._leave(self, fire_will=True)
