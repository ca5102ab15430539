"""Embedded MQTT broker for the coordinator.

A federated round needs a broker that the coordinator and its edge clients
share.  For a laptop demo, CI, or a single-host simulation it is much nicer if
the coordinator can bring its own broker instead of asking the user to install
and configure Mosquitto.  This module wraps `amqtt`_ (a pure-Python MQTT 3.1.1
broker) so that it runs next to the coordinator:

* in a **daemon thread with its own event loop**, so it neither needs the
  caller to be async nor interferes with an event loop the caller may run;
* bound to a **loopback address only**: it has no TLS, so it must not be
  reachable from the network;
* with **freshly generated credentials** and anonymous access disabled.
  Besides keeping other local users out, this is functionally required:
  amqtt never persists sessions of anonymous clients, so QoS 1 messages
  published while a ``clean_session=False`` client is offline would be lost.

Notes for callers (measured against amqtt 0.12.1):

* Only MQTT 3.1.1 is spoken.  paho-mqtt clients must use
  ``protocol=MQTTv311`` (the default) and ``clean_session=False`` for
  persistent sessions.  An MQTTv5 CONNECT *without* credentials is refused,
  but one *with* credentials is misparsed and never answered: the client
  hangs until its keepalive expires, so pin 3.1.1 explicitly.
* Messages queued for an offline persistent session are redelivered with the
  RETAIN flag set, so do not use ``message.retain`` to tell "stale retained
  state" from "missed live message" on this broker.
* Delivery QoS is the *subscription* QoS (amqtt does not downgrade to the
  publish QoS): a QoS 0 publish reaches a QoS 1 subscriber as QoS 1 and is
  even queued for it while it is offline.
* There is no maximum packet size; the MQTT limit (256 MB) applies.

.. _amqtt: https://github.com/Yakifo/amqtt
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import os
import secrets
import shutil
import socket
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from collections.abc import Sequence
from typing import Any

from storage.errors import FedgeError

__all__ = [
    "BrokerEndpoint",
    "BrokerError",
    "EmbeddedBroker",
    "free_port",
]

log = logging.getLogger(__name__)

#: Set (to anything but "", "0", "false", "no", "off") to see amqtt's own logs at DEBUG.
DEBUG_ENV_VAR = "FEDGE_BROKER_DEBUG"

# Loggers that are chatty at INFO: amqtt logs every connection and state change,
# and the `transitions` state-machine library (used by amqtt) logs every callback.
_NOISY_LOGGERS = ("amqtt", "transitions")

# How often start() retries when the port it picked was taken in the meantime.
_BIND_ATTEMPTS = 5


class BrokerError(FedgeError, RuntimeError):
    """The embedded broker could not be started or stopped."""


@dataclass(frozen=True)
class BrokerEndpoint:
    """Everything a client needs to reach a broker.

    Credentials are kept out of :attr:`url` and out of ``repr()`` so that the
    endpoint can be logged or shown in a dashboard without leaking the
    password.
    """

    host: str
    port: int
    username: str | None
    password: str | None = field(repr=False)
    protocol: str = "3.1.1"
    """MQTT protocol version the broker speaks ("3.1.1" or "5")."""
    devices: dict[str, str] = field(default_factory=dict, repr=False)
    """Device id -> password: each device's own login, confined to its own topics."""

    @property
    def url(self) -> str:
        """``mqtt://HOST:PORT`` -- deliberately without credentials."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"mqtt://{host}:{self.port}"


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on *host* that was free a moment ago.

    The OS picks it (bind to port 0), so it will not collide with well-known
    ports.  Another process may still grab it before the caller binds, so
    callers must be ready to retry; :meth:`EmbeddedBroker.start` does.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _debug_requested() -> bool:
    value = os.environ.get(DEBUG_ENV_VAR, "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


def _configure_amqtt_logging() -> None:
    """Keep amqtt quiet unless the user asked for broker debugging.

    amqtt logs each connect/disconnect at INFO, which would drown the
    coordinator's own progress output in a federation with many clients.
    """
    level = logging.DEBUG if _debug_requested() else logging.WARNING
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(level)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _hash_password(password: str) -> str:
    """Hash *password* in the Argon2 format amqtt's FileAuthPlugin verifies.

    amqtt 0.12 reads ``user:hash`` lines and verifies them with pwdlib's
    Argon2 hasher (legacy ``$6$`` sha512-crypt lines are still accepted but
    deprecated, and cannot be generated).  The parameters are intentionally
    cheap: the password is 256 random bits, so a slow hash adds no security,
    whereas the default cost (64 MiB, 3 passes, ~100 ms) would be paid inside
    the broker's event loop on every CONNECT and stall message delivery while
    a fleet of clients (re)connects.
    """
    try:
        from pwdlib.hashers.argon2 import Argon2Hasher
    except ImportError as exc:  # pragma: no cover - dependency problem
        raise BrokerError(
            "the embedded broker needs 'pwdlib' with argon2 support "
            "(installed with amqtt>=0.12; try: pip install 'pwdlib[argon2]')"
        ) from exc
    return Argon2Hasher(time_cost=1, memory_cost=8192, parallelism=1).hash(password)


def _bind_in_use(exc: BaseException) -> bool:
    """True if *exc* (or something it wraps) is "address already in use"."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno == errno.EADDRINUSE:
            return True
        current = current.__cause__ or current.__context__
    return False


def _quiet_connection_errors(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Loop exception handler that keeps per-connection noise out of the console.

    amqtt lets some socket errors escape its connection callback (e.g. it
    half-closes a transport the client already dropped), and connection tasks
    still stuck in the CONNECT handshake are cancelled at shutdown; asyncio
    would print a traceback for each.  Those concern one client only, so they
    are logged at DEBUG; anything else goes to the default handler.
    """
    exc = context.get("exception")
    if isinstance(exc, (asyncio.CancelledError, OSError)):
        log.debug("embedded broker: %s: %r", context.get("message"), exc)
        return
    loop.default_exception_handler(context)


class _SnapshotDict(dict):
    """A dict whose loops walk a copy of its keys or items, taken when the loop begins.

    amqtt 0.12.1, the latest release, loops over its subscription table with an ``await`` inside
    (sending retained messages to a reconnecting persistent session): a client subscribing a new
    filter meanwhile grows the table, the loop dies with "dictionary changed size during iteration",
    that client's connection handler dies with it, and asyncio prints the traceback. Walking a
    snapshot gives the loop the table as it was when it began, which is what the loop means.
    """

    def __iter__(self):  # type: ignore[override]
        return iter(list(super().keys()))

    def keys(self):  # type: ignore[override]
        return list(super().keys())

    def values(self):  # type: ignore[override]
        return list(super().values())

    def items(self):  # type: ignore[override]
        return list(super().items())


class EmbeddedBroker:
    """amqtt broker on 127.0.0.1 in a daemon thread with its own event loop.

    Typical use::

        with EmbeddedBroker() as broker:
            ep = broker.endpoint
            client.username_pw_set(ep.username, ep.password)
            client.connect(ep.host, ep.port)

    The broker keeps all state (sessions, retained messages) in memory; it is
    gone after :meth:`stop`.  A stopped instance can be started again and will
    get new credentials.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        workdir: Path | None = None,
        devices: Sequence[str] = (),
        prefix: str = "fedge",
    ) -> None:
        """Configure, but do not start, the broker.

        Args:
            host: loopback address to bind.  Non-loopback addresses are
                rejected because the broker has no TLS.
            port: TCP port; 0 picks a free one at :meth:`start`.
            workdir: where to write the password file.  If None a private
                temporary directory is created and removed by :meth:`stop`.
            devices: device ids that get a login of their own (user = id), allowed
                to publish only on ``PREFIX/clients/ID/...`` and to subscribe only
                there and to the coordinator's topics, as the shipped Mosquitto ACL
                allows; without devices, every client shares the generated login.
            prefix: the topic prefix those rules are written for.
        """
        if not _is_loopback(host):
            raise ValueError(
                f"EmbeddedBroker only binds loopback addresses (got {host!r}): "
                "it has no TLS; use an external broker for remote clients"
            )
        if not 0 <= port <= 65535:
            raise ValueError(f"port out of range: {port}")
        self._host = host
        self._port = port
        self._workdir = Path(workdir) if workdir is not None else None
        self._devices = list(devices)
        self._prefix = prefix
        self._device_passwords: dict[str, str] = {}
        self._coordinator_user = ""

        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._endpoint: BrokerEndpoint | None = None
        self._tmpdir: Path | None = None
        self._password_file: Path | None = None

    # ------------------------------------------------------------------ info

    @property
    def endpoint(self) -> BrokerEndpoint | None:
        """Connection details while running, else None."""
        return self._endpoint

    @property
    def running(self) -> bool:
        """True between a successful :meth:`start` and :meth:`stop`."""
        return self._endpoint is not None and self._thread is not None and self._thread.is_alive()

    def __repr__(self) -> str:
        state = self._endpoint.url if self._endpoint else "stopped"
        return f"<EmbeddedBroker {state}>"

    # ------------------------------------------------------------- lifecycle

    def start(self, timeout: float = 10.0) -> BrokerEndpoint:
        """Start the broker and return how to reach it.

        Generates a random username/password, writes amqtt's password file
        (mode 0600), and waits until the listener accepts connections.
        Calling it on a running broker returns the current endpoint.

        Raises:
            BrokerError: the broker did not come up within *timeout* seconds
                or amqtt rejected the configuration.
        """
        with self._lock:
            if self._endpoint is not None:
                return self._endpoint
            _configure_amqtt_logging()

            username = "fedge-" + secrets.token_hex(4)
            password = secrets.token_urlsafe(32)
            self._device_passwords = {d: secrets.token_urlsafe(32) for d in self._devices}
            self._coordinator_user = username
            try:
                self._write_password_file({username: password, **self._device_passwords})
            except BaseException:
                self._remove_files()
                raise

            attempts = _BIND_ATTEMPTS if self._port == 0 else 1
            last_error: BaseException | None = None
            try:
                for _ in range(attempts):
                    port = self._port or free_port(self._host)
                    try:
                        self._launch(port, timeout)
                    except BrokerError as exc:
                        last_error = exc
                        if self._port == 0 and _bind_in_use(exc):
                            continue  # someone took the port we picked; pick another
                        raise
                    self._endpoint = BrokerEndpoint(
                        host=self._host,
                        port=port,
                        username=username,
                        password=password,
                        protocol="3.1.1",
                        devices=dict(self._device_passwords),
                    )
                    log.debug("embedded MQTT broker listening on %s", self._endpoint.url)
                    return self._endpoint
                raise BrokerError(
                    f"could not bind a free port on {self._host} after {attempts} attempts"
                ) from last_error
            except BaseException:
                self._remove_files()
                raise

    def stop(self, timeout: float = 10.0) -> None:
        """Shut the broker down and delete its temporary files.

        Safe to call more than once, and on a broker that never started.
        Connected clients lose their connection; all sessions and retained
        messages are discarded (amqtt keeps them in memory only).

        Raises:
            BrokerError: the broker thread did not finish within *timeout*
                seconds.  Files are removed and the instance is considered
                stopped anyway; the daemon thread dies with the process.
        """
        with self._lock:
            thread, loop, stop_event = self._thread, self._loop, self._stop_event
            self._thread = self._loop = self._stop_event = None
            self._endpoint = None
            try:
                if thread is not None and thread.is_alive():
                    self._signal_stop(loop, stop_event)
                    thread.join(timeout)
                    if thread.is_alive():
                        raise BrokerError(
                            f"embedded MQTT broker did not shut down within {timeout:g} s"
                        )
            finally:
                self._remove_files()

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -------------------------------------------------------------- internals

    def _config(self, port: int) -> dict[str, Any]:
        """amqtt 0.12 broker configuration.

        Only the two auth plugins are loaded: the default plugin set also
        contains packet/event loggers (noise) and the $SYS plugin, which
        publishes every 20 s and warns about its psutil dependency.  Listing
        ``plugins`` explicitly also keeps amqtt from falling back to the
        deprecated entry-point plugin discovery.  Both auth plugins must agree
        (amqtt ANDs the answers of all auth plugins that give one), so a
        client without a username is refused by AnonymousAuthPlugin and a
        wrong password by FileAuthPlugin.
        """
        host = f"[{self._host}]" if ":" in self._host else self._host
        assert self._password_file is not None
        return {
            "listeners": {
                "default": {"type": "tcp", "bind": f"{host}:{port}"},
            },
            # None: sessions of clean_session=False clients never expire while the
            # broker runs, so an edge device may be offline for a whole round.
            "session_expiry_interval": None,
            "plugins": {
                "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": False},
                "amqtt.plugins.authentication.FileAuthPlugin": {
                    "password_file": str(self._password_file),
                },
                **({"amqtt.plugins.topic_checking.TopicAccessControlListPlugin": self._acl()}
                   if self._device_passwords else {}),
            },
        }

    def _acl(self) -> dict[str, Any]:
        """Topic rules by user: the coordinator anywhere, each device on its own topics only.

        Without them any spawned client could answer for another or forge its errors;
        the rules are by user name, which the password proves (a client id proves nothing).
        """
        own = {d: f"{self._prefix}/clients/{d}/#" for d in self._device_passwords}
        # amqtt 0.12's plugin Config names the subscribe rules `acl` (and warns that the name is
        # deprecated in favour of a `subscribe-acl` its Config does not accept yet).
        warnings.filterwarnings("ignore", message="The 'acl' option is deprecated", category=DeprecationWarning)
        return {
            "publish_acl": {self._coordinator_user: ["#"], **{d: [topic] for d, topic in own.items()}},
            "acl": {self._coordinator_user: ["#"],
                    **{d: [topic, f"{self._prefix}/coordinator/#"] for d, topic in own.items()}},
        }

    def _write_password_file(self, logins: dict[str, str]) -> None:
        if self._workdir is not None:
            self._workdir.mkdir(parents=True, exist_ok=True)
            directory = self._workdir
        else:
            self._tmpdir = Path(tempfile.mkdtemp(prefix="fedge-broker-"))  # mode 0700
            directory = self._tmpdir
        path = directory / f"broker-passwd-{secrets.token_hex(4)}"
        # O_EXCL + explicit mode: the file is never readable by others, not even briefly.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        self._password_file = path
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.writelines(f"{user}:{_hash_password(secret)}\n" for user, secret in logins.items())

    def _remove_files(self) -> None:
        if self._password_file is not None:
            try:
                self._password_file.unlink()
            except FileNotFoundError:
                pass
            self._password_file = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def _launch(self, port: int, timeout: float) -> None:
        """Run one amqtt Broker on *port* in a new thread; wait until it listens."""
        ready = threading.Event()
        outcome: dict[str, Any] = {}
        thread = threading.Thread(
            target=self._thread_main,
            args=(port, ready, outcome),
            name=f"fedge-mqtt-broker:{port}",
            daemon=True,
        )
        thread.start()
        if not ready.wait(timeout):
            # Ask the loop to give up; if it is wedged the daemon thread is abandoned.
            self._signal_stop(outcome.get("loop"), outcome.get("stop_event"), abort=True)
            thread.join(1.0)
            raise BrokerError(
                f"embedded MQTT broker did not start on {self._host}:{port} within {timeout:g} s"
            )
        error = outcome.get("error")
        if error is not None:
            thread.join(timeout)
            raise BrokerError(f"embedded MQTT broker failed to start on {self._host}:{port}: {error}") from error
        self._thread = thread
        self._loop = outcome["loop"]
        self._stop_event = outcome["stop_event"]

    def _thread_main(self, port: int, ready: threading.Event, outcome: dict[str, Any]) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        if not _debug_requested():
            loop.set_exception_handler(_quiet_connection_errors)
        outcome["loop"] = loop  # lets a timed-out start() stop this loop
        try:
            loop.run_until_complete(self._serve(port, ready, outcome))
        except BaseException as exc:  # noqa: BLE001 - must reach the starting thread
            if not ready.is_set():
                outcome["error"] = exc
            else:
                log.warning("embedded MQTT broker stopped abnormally: %r", exc)
        finally:
            ready.set()
            try:
                pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
                for task in pending:
                    task.cancel()
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
            except Exception:  # noqa: BLE001 - best-effort cleanup
                pass
            finally:
                asyncio.set_event_loop(None)
                loop.close()

    async def _serve(
        self,
        port: int,
        ready: threading.Event,
        outcome: dict[str, Any],
    ) -> None:
        from amqtt.broker import Broker  # imported late: coordinator-only dependency

        stop_event = asyncio.Event()
        outcome["stop_event"] = stop_event
        broker = Broker(self._config(port))  # must be created inside the running loop
        broker._subscriptions = _SnapshotDict()   # amqtt's own table, empty until clients subscribe
        await broker.start()
        ready.set()
        try:
            await stop_event.wait()
        finally:
            await broker.shutdown()

    @staticmethod
    def _signal_stop(
        loop: asyncio.AbstractEventLoop | None,
        stop_event: asyncio.Event | None,
        *,
        abort: bool = False,
    ) -> None:
        if loop is None or loop.is_closed():
            return
        try:
            if stop_event is not None:
                loop.call_soon_threadsafe(stop_event.set)
            if abort:
                loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:  # loop closed between the check and the call
            pass
