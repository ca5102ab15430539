"""The one place that talks MQTT (paho-mqtt 2.x): persistent sessions, QoS 1, reconnects, and the
broker's refusals (a login, a topic, a packet too large) turned into errors and log lines that
say what to fix, since MQTT itself reports most of them by silence.
"""

from __future__ import annotations

import functools
import logging
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edge_client.wire.broker_settings import PROTOCOLS, BrokerSettings
from edge_client.wire.connect_failures import (LOGIN_REFUSED, LoginRefused, NoConnack, login_refused,
                                               scheme_mismatch, tls_failure)
from edge_client.wire.inbox import DEFAULT_MAX_BYTES, Inbox
from edge_client.wire.shared_loop import SharedLoop
from edge_client.wire.transport_base import Incoming, Transport, Will
from edge_client.wire.transport_errors import MessageTooLarge, TlsError, TransportError

__all__ = ["MqttTransport"]

log = logging.getLogger("fedge.transport")

SUBACK_TIMEOUT = 10.0   # seconds subscribe() waits for the broker's acknowledgement
RECONNECT_DELAYS = (1.0, 30.0)   # first and longest wait before reconnecting, doubling in between


class MqttTransport(Transport):
    """paho-mqtt client with a persistent session, QoS 1 and automatic reconnects.

    Subscriptions are remembered and renewed on every (re)connect, so a broker that
    lost our session still delivers. Call :meth:`connect` explicitly; the
    constructor does no I/O.

    ``flow_control`` (the coordinator and the aggregation workers, which take results from
    a whole fleet): a QoS 1 message is acknowledged when it is taken from the receive queue,
    not when it arrives, and MQTT 5's Receive Maximum tells the broker how many unacknowledged
    messages we hold at most (half the queue's bound in messages, or in bytes over the largest
    message), so a busy receiver slows the broker's delivery instead of dropping messages the
    sender must re-send (:class:`~edge_client.wire.inbox.Inbox` says how brokers that release
    more are held back). Off for devices, whose loop may not read while it trains.

    ``loop`` (many connections in one process, as the fleet benchmark's devices): a
    :class:`~edge_client.wire.shared_loop.SharedLoop` drives this connection from its thread instead
    of a paho network thread of its own. Everything then happens on that thread, so nothing waits:
    :meth:`connect` starts connecting and returns (:attr:`connected` says when the broker accepted),
    a connection that fails or is lost is tried again after 1 s, doubling up to 30 s, ``subscribe``
    does not wait for its SUBACK, :meth:`close` does not wait for what is in flight (the loop's
    ``flush`` does), and ``on_message`` is called once a message is queued, for the loop's owner to
    read it. ``protocol = "auto"`` is MQTT 5 there (no fallback). ``counter(direction, size)`` counts
    each message's payload bytes, 0 for one received and 1 for one published.
    """

    def __init__(self, settings: BrokerSettings, client_id: str, *, will: Will | None = None,
                 queue_size: int = 10_000, flow_control: bool = False, loop: SharedLoop | None = None,
                 on_message: Callable[[], None] | None = None,
                 counter: Callable[[int, int], None] | None = None) -> None:
        if settings.protocol not in PROTOCOLS:
            raise TransportError(f"MQTT protocol must be one of {PROTOCOLS}, got {settings.protocol!r}")
        self.settings = settings
        self._loop = loop
        self._on_arrival = on_message
        self._counter = counter
        self._backoff = RECONNECT_DELAYS[0]
        self.client_id = client_id
        self.will = will
        self.protocol: str | None = None
        # Unacknowledged messages the broker may send us: half what the queue holds, in messages and in bytes.
        self.receive_maximum = max(1, min(65_535, queue_size // 2,
                                          DEFAULT_MAX_BYTES // (2 * settings.max_message_bytes)))
        self._inbox = Inbox(queue_size, window=self.receive_maximum)
        self.flow_control = flow_control
        self._session = 0     # connections made: an acknowledgement belongs to the one its message came on
        self._filters: list[str] = []
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._refused: str | None = None
        self._refused_login: str | None = None   # why the broker refused our user name and password
        self._client: mqtt.Client | None = None
        self._birth: tuple[str, bytes] | None = None
        self._broker_max: int | None = None   # the broker's maximum packet size, when it tells (MQTT 5)
        self._subscribing: dict[int, str] = {}   # SUBSCRIBE packet id -> topic filter, until its SUBACK
        self._early_subacks: set[int] = set()    # SUBACKs that beat subscribe() recording their packet id
        self._subacked = threading.Condition(self._lock)
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
        """Connect, trying MQTT 5 then 3.1.1 when the protocol is ``auto``; on a shared loop, start connecting."""
        if self._loop is not None:
            self._start_on_loop()
            return self
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
                refused += [str(exc)] if isinstance(exc, LoginRefused) else []
                listening |= isinstance(exc, NoConnack)
        if refused:
            raise TransportError(login_refused(self.settings, refused[-1]))
        mismatch = scheme_mismatch(self.settings, *self.settings.host_port()) if listening else None
        if mismatch is not None:
            raise TlsError(mismatch)
        raise TransportError(f"could not connect to {self.settings.url} as {self.client_id!r} ("
                             + "; ".join(reasons) + "). Is the broker running and are the credentials right?")

    def _new_client(self, protocol: str) -> tuple[mqtt.Client, Properties | None]:
        """A paho client with this transport's session settings and callbacks, and its CONNECT properties."""
        v5 = protocol == "5"
        client = mqtt.Client(
            callback_api_version=CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311,
            clean_session=None if v5 else False,
            manual_ack=self.flow_control,
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
            if self.flow_control:
                props.ReceiveMaximum = self.receive_maximum
        return client, props

    def _connect_with(self, protocol: str, timeout: float) -> None:
        v5 = protocol == "5"
        client, props = self._new_client(protocol)
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
            fix = tls_failure(exc, self.settings, host, port)
            if fix is not None:
                raise TlsError(fix) from None
            raise NoConnack(f"{host}:{port} closed the TLS handshake ({exc})") from None
        except OSError as exc:
            self._client = None
            cut = isinstance(exc, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError))
            raise (NoConnack if cut else TransportError)(f"{host}:{port} unreachable ({exc})") from None
        client.loop_start()
        deadline = time.monotonic() + timeout
        while not self._connected.wait(0.05):
            if self._refused or time.monotonic() > deadline:
                client.loop_stop()
                client.disconnect()
                self._client = None
                if self._refused_login:
                    raise LoginRefused(self._refused_login)
                raise NoConnack(self._refused or "no CONNACK in time")
        self.protocol = protocol
        log.debug("connected to %s as %s with MQTT %s", self.settings.url, self.client_id, protocol)

    def _start_on_loop(self) -> None:
        """Hand a new client to the shared loop and dial; the CONNACK comes through the loop."""
        assert self._loop is not None
        protocol = "3.1.1" if self.settings.protocol == "3.1.1" else "5"
        self._ssl_context = self.settings.ssl_context()   # TlsError now for a missing or bad file
        client, props = self._new_client(protocol)
        self._client, self.protocol = client, protocol
        self._loop.attach(client)
        self._dial(client, props)

    def _dial(self, client: mqtt.Client, props: Properties | None) -> None:
        if client is not self._client:   # closed meanwhile
            return
        host, port = self.settings.host_port()
        try:
            client.connect(host, port, keepalive=self.settings.keepalive,
                           clean_start=False if props is not None else mqtt.MQTT_CLEAN_START_FIRST_ONLY,
                           properties=props)
        except OSError as exc:   # ssl.SSLError included
            log.debug("%s: %s:%d unreachable (%s); trying again in %.0f s", self.client_id, host, port, exc,
                      self._backoff)
            self._retry(lambda: self._dial(client, props))

    def _redial(self, client: mqtt.Client) -> None:
        if client is not self._client:
            return
        try:
            client.reconnect()
        except OSError:
            self._retry(lambda: self._redial(client))

    def _retry(self, action: Callable[[], None]) -> None:
        assert self._loop is not None
        self._loop.call_later(self._backoff, action)
        self._backoff = min(RECONNECT_DELAYS[1], self._backoff * 2)

    def _on_connect(self, client: mqtt.Client, userdata: object, flags: object, reason: object,
                    properties: object) -> None:
        if getattr(reason, "is_failure", False):
            self._refused = f"broker refused the connection: {reason}"
            self._refused_login = LOGIN_REFUSED.get(getattr(reason, "value", 0))
            if self._loop is not None:   # nobody waits for the CONNACK to say so
                log.warning("%s: %s", self.client_id, self._refused_login or self._refused)
            return
        self._backoff = RECONNECT_DELAYS[0]
        self._broker_max = getattr(properties, "MaximumPacketSize", None)
        self._connected_at = time.monotonic()
        self._session += 1
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
        elif self._connected.is_set() and client is self._client:   # lost, not closed by us
            self.disconnects += 1
        self._connected.clear()
        if getattr(reason, "value", 0) != 0:
            self._check_oversize(client)
            log.info("disconnected from broker (%s); reconnecting with backoff", reason)
        if self._loop is not None and client is self._client:   # not closed by us: paho's thread would reconnect
            self._retry(lambda: self._redial(client))

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

    def _subscribe_with(self, client: mqtt.Client, topic_filter: str) -> int | None:
        """Send SUBSCRIBE; the packet id to wait for, or None when its SUBACK is already in (or none will come)."""
        _, mid = client.subscribe(topic_filter, qos=1)
        if mid is None:
            return None
        with self._lock:
            if mid in self._early_subacks:
                self._early_subacks.discard(mid)
                return None
            self._subscribing[mid] = topic_filter
        return mid

    def _await_suback(self, client: mqtt.Client, mid: int | None, timeout: float) -> None:
        """Wait until the broker acknowledged a subscription, so that what is published next reaches us.

        Never on paho's own thread (it is the one that reads the SUBACK); a SUBACK that does not come in
        ``timeout`` (a broker gone) is left to the reconnect, which subscribes again."""
        if mid is None or self._loop is not None or threading.current_thread() is getattr(client, "_thread", None):
            return
        with self._subacked:
            if not self._subacked.wait_for(lambda: mid not in self._subscribing, timeout):
                log.warning("no SUBACK from the broker in %.0f s for %s; what is published meanwhile may not "
                            "reach %s", timeout, self._subscribing.get(mid, "?"), self.client_id)

    def _on_subscribe(self, client: mqtt.Client, userdata: object, mid: int, reasons: list[Any],
                      properties: object) -> None:
        """A refused subscription fails silently in MQTT: nothing ever arrives. Say so, and what to fix."""
        with self._lock:
            topic_filter = self._subscribing.pop(mid, None)
            if topic_filter is None:
                self._early_subacks.add(mid)
            self._subacked.notify_all()
        refused = [r for r in reasons if getattr(r, "is_failure", False)]
        if refused:
            self._denied(topic_filter or "?", "read", refused[0])

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
        ack = functools.partial(self._ack, msg.mid, self._session) if self.flow_control and msg.qos else None
        payload = bytes(msg.payload)
        if self._counter is not None:
            self._counter(0, len(payload))
        self._inbox.put(Incoming(msg.topic, payload), ack)
        if self._on_arrival is not None:
            self._on_arrival()

    def _ack(self, mid: int, session: int) -> None:
        """Acknowledge a taken message, on the connection it came on: after a reconnect the broker
        sends unacknowledged ones again, and a packet id of the old connection may name another message."""
        client = self._client
        if client is not None and session == self._session:
            client.ack(mid, 1)

    @property
    def held_over(self) -> int:
        """Messages kept past the receive queue's bounds: the broker sent more than the Receive Maximum."""
        return self._inbox.held_over

    # -- messaging --------------------------------------------------------------
    def subscribe(self, topic_filter: str, *, timeout: float = SUBACK_TIMEOUT) -> None:
        """Subscribe, and return once the broker acknowledged it (or after ``timeout`` seconds): a message
        published after this returns is delivered to us."""
        with self._lock:
            if topic_filter not in self._filters:
                self._filters.append(topic_filter)
        client = self._client
        if client is not None and self._connected.is_set():
            self._await_suback(client, self._subscribe_with(client, topic_filter), timeout)
        elif client is not None and self._loop is None:
            self._subscribe_with(client, topic_filter)

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
        if self._counter is not None:
            self._counter(1, len(payload))

    def announce(self, topic: str, payload: bytes) -> None:
        self._birth = (topic, payload)
        if self._loop is None or self._connected.is_set():   # else it goes on connecting
            self.publish(topic, payload, retain=True)

    def get(self, timeout: float) -> Incoming | None:
        return self._inbox.get(timeout)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def connects(self) -> int:
        """Connections the broker accepted since connect(), reconnects included."""
        return self._session

    def close(self, flush_timeout: float = 5.0) -> None:
        """Disconnect cleanly (no last will); the broker keeps our session.

        Publishes still in flight (a coordinator's last "finished" status, a device's
        offline presence) get up to ``flush_timeout`` seconds to be acknowledged first:
        paho drops what it has not sent when it disconnects, and devices waiting for
        that status would never leave.
        """
        deadline = time.monotonic() + flush_timeout
        while self._loop is None and self._publishing and self._connected.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        client, self._client = self._client, None
        if client is not None:
            client.disconnect()
            if self._loop is None:
                client.loop_stop()

    def drop(self) -> None:
        """Vanish without DISCONNECT, as a crashed device would (the will fires)."""
        client, self._client = self._client, None
        if client is not None:
            if self._loop is None:
                client.loop_stop()
            sock = client.socket()
            if sock is not None:
                if self._loop is not None:
                    self._loop.forget(sock)
                sock.close()

