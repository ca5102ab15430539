"""``fedge-client``: run an edge client on a device against a coordinator's broker."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from edge_client.argcheck import OneLineParser, at_least, check_data_spec, check_partition_spec, fraction

if TYPE_CHECKING:
    from edge_client.client import ClientSettings
    from edge_client.objectives import LocalData
    from edge_client.wire.broker_settings import BrokerSettings

__all__ = ["main", "build_parser"]

log = logging.getLogger("fedge.client")
_DEFAULT_BROKER = "mqtt://127.0.0.1:1883"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="fedge-client",
        description="fedge edge client: trains on this device's private data for a fedge coordinator, over MQTT.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="connect to the broker and serve tasks until stopped",
                         description="Connect to the MQTT broker, announce this device, and run the training "
                                     "tasks the coordinator sends, sending back only what each task asks for.")
    _add_broker_options(run)
    _add_data_options(run)
    _add_runtime_options(run)
    sub.add_parser("apps", help="list the apps installed here: name, version and digest",
                   description="List every app installed on this device (fedge's own and those registered in the "
                               "fedge.apps entry-point group), one line each: its name, version and the digest of "
                               "its files (then weights=SHA256 for an app with starting weights), which a task "
                               "names it by. Each is imported to be listed; one that does not load is named on "
                               "stderr and the exit status is 1.")
    return parser


def _add_broker_options(run: argparse.ArgumentParser) -> None:
    """Where the broker is and who this device is to it."""
    run.add_argument("--bundle", type=Path, default=None,
                     help="device bundle from fedge-coordinator provision (broker, client id, user name, password, "
                          "CA); the options below override what it says")
    run.add_argument("--broker", default=None,
                     help="broker URL mqtt://HOST:PORT, or mqtts://HOST:PORT for TLS (default: the bundle's, else "
                          f"$FEDGE_BROKER, else {_DEFAULT_BROKER})")
    run.add_argument("--ca-file", default=None,
                     help="with mqtts://: PEM file of the CA that signed the broker's certificate (default: the "
                          "bundle's CA, else the system's CAs)")
    run.add_argument("--cert-file", default=None,
                     help="with mqtts://: PEM client certificate, for a broker that requires one")
    run.add_argument("--key-file", default=None, help="with mqtts://: the client certificate's PEM key")
    run.add_argument("--client-id", default=None,
                     help="unique id of this device (letters, digits, '_', '.', '-'); also its MQTT client id "
                          "(required unless the bundle gives it)")


def _add_data_options(run: argparse.ArgumentParser) -> None:
    """What this device trains on, and what it keeps across restarts."""
    run.add_argument("--data", required=True,
                     help="this device's data: digits, fashion-mnist[:DIR] or npz:PATH (its train split is used); "
                          "with --app, whatever location the app's loader reads")
    run.add_argument("--app", default="",
                     help="the installed app whose loader reads --data and whose model the tasks train (docs/apps.md); "
                          "default: fedge's own networks and data sets")
    run.add_argument("--partition", default=None,
                     help="simulation only: take one partition of --data (iid, dirichlet:ALPHA, shards:K, "
                          "attribute:color|rotate|invert:DOMAINS[+LABEL_SPEC])")
    run.add_argument("--partition-index", type=at_least(0), default=0,
                     help="simulation only: which partition (0-based)")
    run.add_argument("--num-partitions", type=at_least(1), default=1, help="simulation only: how many partitions")
    run.add_argument("--seed", type=int, default=0, help="simulation only: partition seed (the run's seed)")
    run.add_argument("--local-test-fraction", type=fraction, default=0.0,
                     help="hold out this share of the local data for personalized evaluation (default 0)")
    run.add_argument("--state-dir", type=Path, default=Path(os.environ.get("FEDGE_STATE_DIR", "fedge-state")),
                     help="directory kept across restarts (profile history, local state); default ./fedge-state")


def _add_runtime_options(run: argparse.ArgumentParser) -> None:
    """Topics, login, protocol, compute, message sizes and when to stop."""
    run.add_argument("--prefix", default=None,
                     help="MQTT topic prefix shared with the coordinator (default: the bundle's, else fedge)")
    run.add_argument("--username", default=None,
                     help="broker user name (default: the bundle's, else $FEDGE_MQTT_USERNAME); the password "
                          "comes from the bundle or $FEDGE_MQTT_PASSWORD, never from the command line")
    run.add_argument("--mqtt-protocol", choices=("auto", "5", "3.1.1"), default="auto",
                     help="MQTT version; auto tries 5, then 3.1.1 (default auto)")
    run.add_argument("--device", default=os.environ.get("FEDGE_DEVICE", "auto"), metavar="auto|cpu|cuda|mps",
                     help="where to train: auto (default, or $FEDGE_DEVICE) takes the CUDA GPU when torch sees one "
                          "(a Jetson with NVIDIA's torch wheel), else the CPU; cuda or cuda:N insists on the GPU. "
                          "What goes on the wire is the same whatever the device")
    run.add_argument("--torch-threads", type=at_least(0), default=0,
                     help="torch CPU threads (0: torch's default); 1 when several clients share a machine")
    run.add_argument("--max-message-bytes", type=at_least(1), default=256 * 1024,
                     help="largest publish; longer messages are sent in chunks. Set it below the broker's "
                          "packet limit (default 256 KiB)")
    run.add_argument("--max-decoded-bytes", type=at_least(1), default=64 * 1024 * 1024,
                     help="refuse whole messages (reassembled, decompressed) larger than this (default 64 MiB)")
    run.add_argument("--no-chunking", dest="chunking", action="store_false",
                     help="never split messages: one over --max-message-bytes is an error")
    run.add_argument("--exit-after-run", action="store_true",
                     help="exit once a run this client took part in finishes (default: keep serving)")
    run.add_argument("--privacy-budget", type=float, default=os.environ.get("FEDGE_PRIVACY_BUDGET"),
                     metavar="EPSILON",
                     help="keep this device's own local-DP account: send only updates with its own noise "
                          "(privacy.mode = 'local' on the coordinator) and refuse any task that would take its "
                          "epsilon past this, over every run, kept in --state-dir (needs dp-accounting; "
                          "docs/privacy.md; env FEDGE_PRIVACY_BUDGET)")
    run.add_argument("--privacy-delta", type=float, default=os.environ.get("FEDGE_PRIVACY_DELTA", "1e-5"),
                     help="with --privacy-budget: the delta its epsilon is at (default 1e-5; env FEDGE_PRIVACY_DELTA)")
    run.add_argument("--min-noise-multiplier", type=float, default=os.environ.get("FEDGE_MIN_NOISE_MULTIPLIER", "0"),
                     metavar="Z", help="with --privacy-budget: refuse tasks asking for less noise than this "
                                       "(default 0; env FEDGE_MIN_NOISE_MULTIPLIER)")
    run.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    run.add_argument("-v", "--verbose", action="store_true",
                     help="log every event at INFO level; without it: connecting, one line per task, a run's end")


def _load_data(args: argparse.Namespace):  # -> LocalData
    from edge_client.inputs import app_device_data, load_device_data

    from edge_client.app import run_app

    app = run_app(args.app)
    if app is not None:
        return app_device_data(app, args.data, args.local_test_fraction, seed=args.seed,
                               client_id=args.client_id, partition=args.partition,
                               partition_index=args.partition_index, num_partitions=args.num_partitions)
    # a simulated device (--partition) keeps only its partition's rows
    return load_device_data(args.data, args.local_test_fraction, seed=args.seed, client_id=args.client_id,
                            partition=args.partition, partition_index=args.partition_index,
                            num_partitions=args.num_partitions)


# What the ``client`` extra installs; a missing one is a deployment step skipped, not a bug.
_CLIENT_EXTRA = frozenset({"torch", "numpy", "paho", "psutil", "safetensors", "zstandard", "lz4", "tomli",
                           "cryptography"})


class _Stop:
    """Set by SIGTERM and SIGINT, polled by the client's loop.

    A signal handler runs between two bytecodes of the main thread, possibly while that thread
    holds a lock; ``threading.Event.set`` takes the event's lock and so deadlocks when a second
    signal lands inside the first one's ``set``. Setting a plain attribute takes no lock and may
    happen any number of times.

    ``exiting``: the process ends when the client does (the ``fedge-client`` command), so further stop
    signals are ignored after it; otherwise (``main`` called in-process) the caller's handlers come back.
    """

    def __init__(self, *, exiting: bool) -> None:
        self.signal: int | None = None
        self.exiting = exiting
        self.previous: dict[int, object] = {}

    def __call__(self, signum: int, frame: object) -> None:
        self.signal = signum

    def is_set(self) -> bool:
        return self.signal is not None

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` s, waking within 0.1 s of a signal; return whether one came."""
        deadline = time.monotonic() + timeout
        while not self.is_set() and time.monotonic() < deadline:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        return self.is_set()

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            self.previous[signum] = signal.signal(signum, self)

    def uninstall(self) -> None:
        """On the way to the interpreter's exit, ignore further stop signals: a signal during it would
        kill the process (Python restores the default handlers first). Returning to a caller, give it
        its own handlers back."""
        for signum, handler in self.previous.items():
            signal.signal(signum, signal.SIG_IGN if self.exiting else handler)


def _connect(transport, stop: _Stop) -> bool:   # transport: MqttTransport
    """Connect, retrying with backoff until it works or a stop signal comes; return whether connected.

    A TLS failure (unknown CA, wrong host name) is raised at once: the same certificate fails the
    same way on every retry.
    """
    from edge_client.wire.transport import TlsError, TransportError

    delay = 1.0
    while not stop.is_set():
        try:
            transport.connect()
            logging.getLogger("fedge.client.activity").info(
                "connected to %s as %s (MQTT %s)", transport.settings.url, transport.client_id, transport.protocol)
            return True
        except TlsError:
            raise
        except TransportError as exc:
            log.warning("%s; retrying in %.0f s", exc, delay)
            stop.wait(delay)
            delay = min(delay * 2, 60.0)
    return False


def _broker_settings(args: argparse.Namespace):  # -> BrokerSettings
    """Broker settings from the command line over the bundle over the environment; fills in ``args.client_id``
    and ``args.prefix`` from the bundle where the command line left them out.

    The bundle comes before the environment: a device provisioned with a bundle must not pick up
    another user's leftovers from an old client.env.
    """
    from edge_client.bundle import read_bundle
    from edge_client.wire.transport import BrokerSettings

    bundle = read_bundle(args.bundle) if args.bundle is not None else None
    if bundle is not None:
        args.client_id = args.client_id or bundle.client_id
        args.prefix = args.prefix or bundle.prefix
    args.prefix = args.prefix or "fedge"
    env = os.environ
    url = args.broker or (bundle.broker if bundle else None) or env.get("FEDGE_BROKER") or _DEFAULT_BROKER
    username = args.username or (bundle.username if bundle else None) or env.get("FEDGE_MQTT_USERNAME")
    password = (bundle.password if bundle else None) or env.get("FEDGE_MQTT_PASSWORD")
    # The bundle's CA serves its TLS broker; a --broker mqtt:// override or a --ca-file replaces it.
    ca_data = bundle.ca_cert if bundle and bundle.ca_cert and not args.ca_file and url.startswith("mqtts:") else None
    source = f"the bundle {args.bundle}" if bundle is not None and bundle.password else "FEDGE_MQTT_PASSWORD"
    return BrokerSettings(url=url, username=username, password=password, protocol=args.mqtt_protocol,
                          max_message_bytes=args.max_message_bytes, ca_file=args.ca_file, ca_data=ca_data,
                          cert_file=args.cert_file, key_file=args.key_file, password_source=source)


def _early_check(args: argparse.Namespace):  # -> tuple[BrokerSettings | None, str]
    """The broker settings, and what the command line shows wrong ("" when nothing), before torch is
    imported: a typo is answered at once instead of after torch's import (5 to 8 s on a Raspberry Pi)."""
    from edge_client.bundle import BundleError
    from edge_client.data import DataError
    from edge_client.wire.chunking import MIN_MESSAGE_BYTES
    from edge_client.wire.transport import TransportError

    for flag in ("max_message_bytes", "max_decoded_bytes"):
        if getattr(args, flag) < MIN_MESSAGE_BYTES:
            return None, f"--{flag.replace('_', '-')} must be at least {MIN_MESSAGE_BYTES}"
    try:   # a URL, bundle or TLS file no retry can fix is a configuration error, said at once
        broker = _broker_settings(args)
        broker.ssl_context()
        if args.app in ("", "vision"):   # another app's loader says what its locations are
            check_data_spec(args.data)
        if args.partition and args.app in ("", "vision"):
            check_partition_spec(args.partition)
    except (BundleError, TransportError, DataError) as exc:
        return None, str(exc)
    if not args.client_id:
        return broker, "give --client-id ID (or --bundle PATH, which names it)"
    if args.partition and args.partition_index >= args.num_partitions:
        return broker, (f"--partition-index {args.partition_index} is out of range: it must be below "
                        f"--num-partitions {args.num_partitions}")
    return broker, ""


def _run(args: argparse.Namespace, exiting: bool) -> int:
    from profiling.memory_trace import mark

    mark("interpreter")
    try:
        broker, problem = _early_check(args)
        if problem:
            print(f"fedge-client: {problem}", file=sys.stderr)
            return 2
        try:
            budget = _privacy_budget(args)
        except ValueError as exc:
            print(f"fedge-client: {exc}", file=sys.stderr)
            return 2
        import torch

        from edge_client.client import ClientSettings
        from edge_client.data import DataError
        from edge_client.wire.protocol import Topics, valid_client_id
        mark("imports")
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in _CLIENT_EXTRA:
            raise
        print(f"fedge-client needs {exc.name}, which is not installed: pip install 'fedge[client]' "
              "(on a device install the pinned torch first, as docs/deploy.md shows)", file=sys.stderr)
        return 2

    if not valid_client_id(args.client_id):
        print(f"fedge-client: bad --client-id {args.client_id!r}: use 1-64 letters, digits, '_', '.', '-'",
              file=sys.stderr)
        return 2
    from edge_client.device import DeviceError, resolve_device
    try:
        device = resolve_device(args.device)
    except DeviceError as exc:
        print(f"fedge-client: {exc}", file=sys.stderr)
        return 2
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    from edge_client.app import AppError

    try:
        data = _load_data(args)
    except (DataError, AppError) as exc:
        print(f"fedge-client: {exc}", file=sys.stderr)
        return 2
    mark("data")
    settings = ClientSettings(client_id=args.client_id, topics=Topics(args.prefix), state_dir=args.state_dir,
                              max_message_bytes=args.max_message_bytes, max_decoded_bytes=args.max_decoded_bytes,
                              chunking=args.chunking, exit_after_run=args.exit_after_run,
                              parent_pid=args.parent_pid, device=str(device), privacy_budget=budget)
    # The client gets the only reference: a task whose model normalizes otherwise makes the inputs again,
    # and the first ones are freed only if nothing here still holds them (a device's whole data set).
    handed = [data]
    del data
    return _serve(broker, settings, handed, exiting)


def _privacy_budget(args: argparse.Namespace):  # -> BudgetSettings | None
    """The device's own budget from the flags, its ledger read once now: a budget that cannot be kept (no
    accountant, an unreadable ledger) stops the client before it connects."""
    if args.privacy_budget is None:
        if args.min_noise_multiplier or args.privacy_delta != 1e-5:
            raise ValueError("--privacy-delta and --min-noise-multiplier apply with --privacy-budget EPSILON")
        return None
    from edge_client.privacy_budget import BudgetSettings, PrivacyBudget

    settings = BudgetSettings(args.privacy_budget, args.privacy_delta, args.min_noise_multiplier)
    ledger = PrivacyBudget(settings, args.state_dir)
    logging.getLogger("fedge.client.activity").info(
        "privacy budget: epsilon %.4g of %g spent at delta %g over %d updates (%s)", ledger.spent(),
        settings.epsilon, settings.delta, len(ledger.releases), ledger.path)
    return settings


def _serve(broker: BrokerSettings, settings: ClientSettings, handed: list[LocalData], exiting: bool) -> int:
    """Connect and serve tasks until stopped; every way out says this device is offline first. ``handed``: the
    device's data, taken out of the list so that the client holds the only reference. ``exiting``: see
    :class:`_Stop`."""
    from edge_client.client import EdgeClient
    from edge_client.wire.transport import MqttTransport, TlsError

    offline = EdgeClient.will(settings)
    transport = MqttTransport(broker, settings.client_id, will=offline)
    stop = _Stop(exiting=exiting)
    stop.install()
    try:
        connected = _connect(transport, stop)
    except TlsError as exc:
        stop.uninstall()
        print(f"fedge-client: {exc}", file=sys.stderr)
        return 2
    from profiling.memory_trace import mark

    mark("connected")
    if not connected:
        stop.uninstall()
        print(f"fedge-client: stopped before connecting to {broker.url}", file=sys.stderr)
        return 0
    notice = threading.Thread(target=_say_stopping, args=(stop,), name="fedge-stop-notice", daemon=True)
    notice.start()
    try:
        EdgeClient(settings, transport, handed.pop()).run(stop)
    finally:
        # Every way out says this device is offline: a clean DISCONNECT fires no last will, and a
        # coordinator that still saw it online would select it and fail the round.
        try:
            transport.publish(offline.topic, offline.payload, retain=True)
            time.sleep(0.2)   # let it leave before disconnecting
        finally:
            transport.close()
            stop.uninstall()
            if stop.is_set():
                notice.join(1.0)   # its "stopping" line first
                log.warning("stopped")
    return 0


def _say_stopping(stop: _Stop) -> None:
    """Log the stop signal as it comes, from a thread of its own: the signal handler may not log (logging
    takes locks), and the client's loop only sees the signal once its task is done, which can be minutes."""
    while not stop.wait(3600.0):
        pass
    log.warning("stopping: finishing the task at hand")


def _apps() -> int:
    """``fedge-client apps``: one line per installed app that loads (AppIdentity.line); 1 when one does not."""
    from edge_client.app import AppError, app_identity, installed_apps, load_app

    try:
        names = sorted(installed_apps())
    except AppError as exc:
        print(f"fedge-client: {exc}", file=sys.stderr)
        return 1
    status = 0
    for name in names:
        try:
            print(app_identity(load_app(name)).line(), flush=True)
        except Exception as exc:   # noqa: BLE001 -- an app's own import may raise anything; name it and go on
            print(f"fedge-client: app {name} does not load: {type(exc).__name__}: {exc}", file=sys.stderr)
            status = 1
    return status


def main(argv: list[str] | None = None, *, exiting: bool = False) -> int:
    """``fedge-client`` in-process: returns its exit code and leaves the caller's signal handlers as they were
    (``exiting``: the process ends next, as under :func:`entry`)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # A person at the device sees it working without -v: connecting, one line per task, a run's end.
    logging.getLogger("fedge.client.activity").setLevel(logging.INFO)
    if args.command == "run":
        try:
            return _run(args, exiting)
        except KeyboardInterrupt:   # Ctrl-C while starting up, before the stop signals are handled
            print("fedge-client: interrupted", file=sys.stderr)
            return 130
    if args.command == "apps":
        return _apps()
    return 2


def entry() -> None:
    """The ``fedge-client`` command: :func:`main`, then the process's exit."""
    sys.exit(main(exiting=True))


if __name__ == "__main__":
    entry()
