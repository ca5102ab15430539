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
* A QoS 1 delivery gets 5 s for its PUBACK (fixed); then amqtt forgets it
  (it is not sent again) and logs a warning, and at its shutdown a
  traceback.  A subscriber that acknowledges on take, as the coordinator
  does, must take what arrives until it disconnects.

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
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from coordinator.ops.amqtt_config import amqtt_config, hash_password, topic_acl
from coordinator.ops.amqtt_quirks import (SnapshotDict, configure_amqtt_logging, debug_requested, quiet_loop_errors,
                                          settle_deliveries)
from coordinator.ops.broker_endpoint import BrokerEndpoint, BrokerError, free_port

__all__ = [
    "BrokerEndpoint",
    "BrokerError",
    "EmbeddedBroker",
    "free_port",
]

log = logging.getLogger(__name__)

# How often start() retries when the port it picked was taken in the meantime.
_BIND_ATTEMPTS = 5

# How long stop() lets deliveries in flight end before amqtt's shutdown cancels them.
_SETTLE_SECONDS = 1.0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
            configure_amqtt_logging()

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
        Deliveries in flight get up to a second to be acknowledged; what
        failed or is still unacknowledged then is dropped, logged at DEBUG only.
        Connected clients lose their connection; all sessions and retained
        messages are discarded (amqtt keeps them in memory only).  Stop the
        clients first (a run does: its devices are told the run finished and
        have left, and the coordinator has taken what they sent), so nothing
        is in flight.

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
        """With device logins, each device is confined to its own topics; without, all share one login."""
        assert self._password_file is not None
        devices = self._device_passwords
        acl = topic_acl(self._prefix, self._coordinator_user, devices) if devices else None
        return amqtt_config(self._host, port, self._password_file, acl)

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
            fh.writelines(f"{user}:{hash_password(secret)}\n" for user, secret in logins.items())

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
        if not debug_requested():
            loop.set_exception_handler(quiet_loop_errors)
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
        broker._subscriptions = SnapshotDict()   # amqtt's own table, empty until clients subscribe
        await broker.start()
        ready.set()
        try:
            await stop_event.wait()
        finally:
            await settle_deliveries(broker, _SETTLE_SECONDS)
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
