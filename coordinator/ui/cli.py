"""``fedge-coordinator``: run federated training (``run``), the whole pipeline (``demo``), provision a
deployment (``provision``), take a share of a run's results (``worker``), list the fleet (``status``), or a
method's own command (each method's ``cli.py``, named in :mod:`edge_client.registry`)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge_client.argcheck import OneLineParser, at_least, check_data_spec, check_partition_spec, positive
from edge_client.registry import commands, model_options, resolve, strategies
from coordinator.ui import config_cli, kit_cli, new_cli, privacy_cli, status_cli

__all__ = ["main", "build_parser"]

# flag -> (section, key, type, help); the types check ranges before torch is imported
_FLAGS: dict[str, tuple[str, str, Callable[[str], Any], str]] = {
    "--strategy": ("run", "strategy", str, f"the method: {', '.join(strategies())} (docs/methods.md)"),
    "--model": ("model", "name", str, "model from the registry: mlp, cnn, vgg9; any strategy also takes the model "
                f"options of {', '.join(model_options())} (docs/methods.md)"),
    "--rounds": ("run", "rounds", at_least(1), "number of federated rounds"),
    "--clients": ("clients", "expected", at_least(1), "how many clients the run waits for before round 1"),
    "--clients-per-round": ("clients", "per_round", at_least(0), "clients sampled each round (0: all)"),
    "--min-results": ("clients", "min_results", at_least(0),
                      "results needed to aggregate a round; fewer retries it with a fresh sample (0: all selected)"),
    "--round-timeout": ("clients", "round_timeout", positive, "seconds a round waits for results"),
    "--data": ("data", "eval", str, "evaluation data: digits, fashion-mnist[:DIR], npz:PATH"),
    "--partition": ("data", "partition", str,
                    "how spawned clients split the data: iid, dirichlet:ALPHA, shards:K, "
                    "attribute:color|rotate|invert:DOMAINS[+LABEL_SPEC]"),
    "--transport": ("transport", "kind", str, "mqtt (default) or inproc (clients as threads, no broker)"),
    "--broker": ("transport", "broker", str,
                 "broker URL mqtt://HOST:PORT or mqtts://HOST[:PORT] (TLS); "
                 "omitted: start the embedded broker on 127.0.0.1"),
    "--spawn-clients": ("clients", "spawn", at_least(0),
                        "start N local fedge-client processes on partitions 0..N-1 (threads with inproc)"),
    "--seed": ("run", "seed", int, "seed for model init, sampling, partitions and local shuffling"),
    "--out": ("run", "out", str, "run directory (default runs/RUN_ID)"),
    "--device": ("eval", "device", str,
                 "where the coordinator evaluates on its test split: auto (CUDA when torch sees it), cpu, cuda"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="fedge-coordinator",
        description="fedge coordinator: runs federated rounds with edge clients over MQTT.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="run (or resume) a federated training run",
                         description="Run a federated training run. Flags override the --config file; "
                                     "--set SECTION.KEY=VALUE overrides any other key. The resolved config "
                                     "is written to OUT/config.toml.")
    run.add_argument("--config", type=Path,
                     help="TOML config file (docs/configuration.md; every key: docs/settings.md)")
    for flag, (section, key, typ, text) in _FLAGS.items():
        run.add_argument(flag, type=typ, default=None, help=f"{text} [{section}.{key}]")
    run.add_argument("--resume", action="store_true",
                     help="continue the run in --out from its last checkpoint (reads OUT/config.toml)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override any config key, e.g. --set train.lr=0.01 (repeatable)")
    run.add_argument("--metrics-port", type=at_least(0), default=None, metavar="PORT",
                     help="serve the run's metrics for Prometheus at http://127.0.0.1:PORT/metrics while it runs (0: a "
                          "free port, printed); sets metrics.enabled and metrics.port, metrics.host binds another "
                          "address; needs prometheus-client (docs/monitoring.md)")
    run.add_argument("-v", "--verbose", action="store_true", help="log client and round events to the terminal")
    demo = sub.add_parser("demo", help="the whole pipeline on digits with 4 local client processes",
                          description="Start the embedded broker, spawn 4 client processes on scikit-learn's "
                                      "digits, train with FedAvg for a few rounds and print the run directory.")
    demo.add_argument("--rounds", type=at_least(1), default=5, help="number of rounds (default 5)")
    demo.add_argument("--out", default=None, help="run directory (default runs/RUN_ID)")
    demo.add_argument("-v", "--verbose", action="store_true", help="log client and round events to the terminal")
    for name, path in commands().items():   # the methods' own commands
        resolve(path)(sub, name)
    _add_provision(sub)
    kit_cli.add_command(sub)
    new_cli.add_command(sub)
    privacy_cli.add_command(sub)
    config_cli.add_command(sub)
    status_cli.add_command(sub)
    _add_worker(sub)
    return parser


def _add_worker(sub) -> None:  # sub: the parser's subparsers
    worker = sub.add_parser(
        "worker", help="an aggregation worker: check and fold a share of the devices' results",
        description="Subscribe to every device's result through an MQTT 5 shared subscription "
                    "($share/GROUP/PREFIX/clients/+/result) and check and fold the results the broker hands this "
                    "worker into a partial sum for the coordinator. Start it with the run's own config (the "
                    "coordinator's workers.count says how many it waits for; transport.broker must be a broker both "
                    "reach). Results must arrive unchunked: the devices' max_message_bytes above a result's size. "
                    "See docs/scale.md.")
    worker.add_argument("--config", type=Path, help="the run's TOML config file")
    worker.add_argument("--broker", default=None, help="broker URL mqtt://HOST:PORT [transport.broker]")
    worker.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set workers.group=site-a (repeatable)")
    worker.add_argument("--id", default=None, help="this worker's id (default worker-HOST-PID, or the bundle's)")
    worker.add_argument("--bundle", type=Path, default=None,
                        help="a site aggregator's bundle (fedge-coordinator provision --sites: sites/NAME/"
                             "aggregator.toml): its site broker, id, user name, password and CA; --broker and "
                             "--id override it (docs/sites.md)")
    worker.add_argument("--exit-after-run", action="store_true", help="exit once the coordinator says the run finished")
    worker.add_argument("--metrics-port", type=at_least(0), default=None, metavar="PORT",
                        help="serve this worker's counters for Prometheus at http://HOST:PORT/metrics (0: a free "
                             "port, printed); needs prometheus-client (docs/monitoring.md)")
    worker.add_argument("--metrics-host", default="127.0.0.1",
                        help="the address the metrics endpoint binds (default 127.0.0.1: this machine only)")
    worker.add_argument("-v", "--verbose", action="store_true", help="log every claim and partial sum")


def _worker(args: argparse.Namespace) -> int:
    from coordinator.config import ConfigError, load_config, parse_override
    from coordinator.telemetry import MetricsError, missing_library
    from edge_client.bundle import BundleError, read_bundle

    try:   # the configuration is read and checked in full before torch is imported
        bundle = read_bundle(args.bundle) if args.bundle is not None else None
        overrides = []
        if bundle is not None:   # a site aggregator: its site broker, user, prefix and CA over the run's config
            overrides += [("transport", "broker", bundle.broker), ("transport", "username", bundle.username),
                          ("transport", "prefix", bundle.prefix), ("transport", "ca_file", "")]
        overrides += [parse_override(item) for item in args.set]
        if args.broker:
            overrides.append(("transport", "broker", args.broker))
        config = load_config(args.config, overrides)
        if not config.transport.broker:
            raise ConfigError("a worker needs the broker the devices use: "
                              "--broker mqtt://HOST:PORT or transport.broker")
        if args.metrics_port is not None and missing_library():
            raise ConfigError(missing_library())
    except (ConfigError, MetricsError, BundleError) as exc:
        print(f"fedge-coordinator worker: {exc}", file=sys.stderr)
        return 2
    import signal
    import threading

    from coordinator.runtime.worker import default_worker_id, serve_worker
    from edge_client.wire.protocol import valid_client_id
    from edge_client.wire.transport import TransportError

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        worker_id = args.id or (bundle.client_id if bundle is not None else default_worker_id())
        if not valid_client_id(worker_id):
            raise ConfigError(f"--id {worker_id!r}: use up to 64 letters, digits, '.', '_' or '-'")
        metrics = (args.metrics_host, args.metrics_port) if args.metrics_port is not None else None
        stats = serve_worker(config, worker_id, exit_after_run=args.exit_after_run, stop=stop, bundle=bundle,
                             metrics=metrics)
    except (ConfigError, TransportError, MetricsError) as exc:
        print(f"fedge-coordinator worker: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print("worker done: " + ", ".join(f"{k} {v}" for k, v in stats.items()))
    return 0


def _add_provision(sub) -> None:  # sub: the parser's subparsers
    prov = sub.add_parser(
        "provision", help="make a TLS broker's certificates, users, ACL and one bundle per device",
        description="Write a deployment into --out: a CA (unless --ca-cert/--ca-key are given), the broker's "
                    "certificate for --broker-host, a password for the coordinator and each device, the "
                    "Mosquitto configuration with its password file and ACL, the coordinator's [transport] "
                    "section, and one bundle per device (devices/ID.toml) for fedge-client run --bundle. "
                    "Passwords are never printed. docs/deploy.md walks through it.")
    who = prov.add_mutually_exclusive_group(required=True)
    who.add_argument("--devices", type=int, metavar="N", help="N devices named device-001, device-002, ...")
    who.add_argument("--names", type=Path, metavar="FILE", help="device ids, one a line ('#' comments)")
    who.add_argument("--rotate", metavar="ID",
                     help="give device ID (or coordinator, monitor, worker-N) a new password in an existing --out directory")
    prov.add_argument("--out", type=Path, required=True, help="directory to write (new or empty; 0700)")
    prov.add_argument("--broker-host", action="append", default=[], metavar="HOST",
                      help="the broker's host name or IP as devices reach it; repeat for more names (all go into "
                           "the certificate, the first into the bundles)")
    prov.add_argument("--workers", type=int, default=0, metavar="N",
                      help="also N aggregation worker users, worker-1 ... worker-N, each with its own password "
                           "(workers/ID.password) and rights (docs/scale.md#aggregation-workers)")
    prov.add_argument("--sites", type=Path, default=None, metavar="FILE",
                      help="sites with brokers of their own, bridged to this one (TOML, one [NAME] table per site: "
                           "host, devices, optional aggregator and port); writes sites/NAME/ for each, and the "
                           "site's devices' bundles name its broker (docs/sites.md)")
    prov.add_argument("--port", type=int, default=8883, help="the broker's TLS port (default 8883)")
    prov.add_argument("--prefix", default="fedge", help="topic prefix of the ACL and the bundles (default fedge)")
    prov.add_argument("--ca-cert", type=Path, default=None, help="an existing CA certificate (PEM) to sign with")
    prov.add_argument("--ca-key", type=Path, default=None, help="the existing CA's key (PEM, unencrypted)")
    prov.add_argument("--broker-dir", default="/etc/mosquitto/fedge",
                      help="where the broker's files will be installed; fedge.conf names them there "
                           "(default /etc/mosquitto/fedge)")
    prov.add_argument("--listen", default="", metavar="ADDRESS",
                      help="address the TLS listener binds (default: all interfaces)")


def _provision(args: argparse.Namespace) -> int:
    from coordinator.ops.provision import ProvisionError, device_ids, provision, read_names, rotate_password
    from coordinator.ops.provision_texts import next_commands
    from coordinator.ops.sites import SiteError, read_sites

    try:
        if args.rotate:
            target = rotate_password(args.out, args.rotate)
            print(f"new password for {args.rotate} written to {target} and {args.out / 'broker' / 'fedge.passwd'}")
            print("next: install the password file on the broker, reload Mosquitto, then deliver "
                  f"{target.name} (docs/deploy.md#rotating-a-password)")
            return 0
        ids = read_names(args.names) if args.names is not None else device_ids(args.devices)
        sites = read_sites(args.sites) if args.sites is not None else []
        done = provision(args.out, hosts=args.broker_host, devices=ids, port=args.port, prefix=args.prefix,
                         ca_cert=args.ca_cert, ca_key=args.ca_key, broker_dir=args.broker_dir, listen=args.listen,
                         workers=args.workers, sites=sites)
    except (ProvisionError, SiteError) as exc:
        print(f"fedge-coordinator provision: {exc}", file=sys.stderr)
        return 2
    out = done.out_dir
    print(f"provisioned {len(done.bundles)} devices and the coordinator in {out}")
    print(f"  CA:          {out / 'ca.crt'}" + (f" (key {out / 'ca.key'}: keep it offline)" if done.ca_created else ""))
    in_place = Path(args.broker_dir).resolve() == (out / "broker").resolve()   # its files are read where they are
    print(f"  broker:      {out / 'broker'}/ (fedge.conf, fedge.acl, fedge.passwd, server.crt, server.key, ca.crt)"
          + ("" if in_place else f" -> install into {args.broker_dir}/"))
    print(f"  coordinator: {done.coordinator_config} (password in {done.coordinator_password})")
    print(f"  devices:     {out / 'devices'}/ID.toml, one bundle per device (mode 0600)")
    if done.workers:
        print(f"  workers:     {out / 'workers'}/ID.password for {', '.join(done.workers)}: start each with "
              "fedge-coordinator worker --id ID --set transport.username=ID (docs/scale.md#aggregation-workers)")
    for site in sites:
        agg = (f"; aggregator: fedge-coordinator worker --config RUN.toml --bundle {done.sites[site.name]}/aggregator.toml"
               if site.aggregator else "")
        print(f"  site {site.name}: {done.sites[site.name]}/ -> install into {args.broker_dir}/ on {site.host} "
              f"({len(site.devices)} device{'s' if len(site.devices) != 1 else ''}, bridged as {site.bridge_user}{agg})")
    print(f"  monitor:     {done.monitor_password}: the read-only user's password (fedge-coordinator status)")
    print(next_commands(out, args.broker_dir, list(done.bundles)), end="")
    print("more: docs/deploy.md#provisioning" + (" and docs/sites.md" if sites else ""))
    return 0


def _config_from_args(args: argparse.Namespace):  # -> RunConfig
    from coordinator.config import ConfigError, load_config, parse_override

    overrides = []
    for flag, (section, key, _typ, _text) in _FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is not None:
            overrides.append((section, key, value))
    if getattr(args, "metrics_port", None) is not None:
        overrides += [("metrics", "enabled", True), ("metrics", "port", args.metrics_port)]
    overrides += [parse_override(item) for item in args.set]
    path = _config_path(args)
    if path is not None and args.config is None and not Path(path).exists():   # --resume's own OUT/config.toml
        raise ConfigError(f"--resume: {args.out} holds no run (no config.toml); give the --out of the run to continue")
    return load_config(path, overrides)


def _config_path(args: argparse.Namespace) -> Path | None:
    """The config file a command reads: --config, else OUT/config.toml with --resume."""
    if getattr(args, "resume", False) and args.config is None and args.out:
        return Path(args.out) / "config.toml"
    return args.config


def _checked_config(args: argparse.Namespace):  # -> tuple[RunConfig | None, str]
    """The run's configuration read and checked in full, and what is wrong with it ("" when nothing), before
    torch is imported.

    Importing torch and the methods takes seconds (5 to 8 on a Raspberry Pi); the configuration's checks
    (coordinator/config_checks.py) import none of it, so any mistake in the command line or the config file
    is answered at once. fedge's own data, unlike an app's, is also looked for here (``data.eval``,
    ``data.partition``): the check names the file that is not there.
    """
    from edge_client.data import DataError
    from storage.errors import FedgeError

    try:
        config = _config_from_args(args)
        if config.app.module in ("", "vision"):   # an app reads its own data
            for key, check in (("eval", check_data_spec), ("partition", check_partition_spec)):
                try:
                    check(getattr(config.data, key))
                except DataError as exc:
                    return None, f"data.{key}: {exc}"
    except FedgeError as exc:
        return None, str(exc)
    return config, ""


def _demo_config(args: argparse.Namespace):  # -> RunConfig
    from coordinator.config import load_config

    overrides = [("run", "strategy", "fedavg"), ("run", "rounds", args.rounds), ("model", "name", "cnn"),
                 ("data", "eval", "digits"), ("data", "partition", "iid"), ("clients", "expected", 4),
                 ("clients", "spawn", 4), ("transport", "kind", "mqtt"), ("transport", "broker", "")]
    if args.out:
        overrides.append(("run", "out", args.out))
    return load_config(None, overrides)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "handler", None) is not None:   # a method's command
        return args.handler(args)
    if args.command == "provision":
        return _provision(args)
    if args.command == "worker":
        return _worker(args)
    from rich.console import Console
    from rich.logging import RichHandler
    from rich.markup import escape

    console = Console(stderr=False)
    config, problem = _checked_config(args) if args.command == "run" else (None, "")
    if problem:
        console.print(f"[red]fedge-coordinator: {escape(problem)}[/red]", soft_wrap=True)
        return 2
    handler = RichHandler(console=Console(stderr=True), show_path=False)
    handler.setLevel(logging.INFO if args.verbose else logging.WARNING)
    # A record logged with extra={"said": True} is for the run's log file: ``say`` already printed it.
    handler.addFilter(lambda record: not getattr(record, "said", False))
    logging.basicConfig(level=logging.WARNING, handlers=[handler], format="%(message)s")

    from coordinator.ui.report import RoundTable, mode_columns
    from edge_client.app import run_app
    from coordinator.runtime.run import RunInterrupted, run_federated
    from storage.errors import FedgeError

    try:
        if config is None:
            config = _demo_config(args) if args.command == "demo" else _config_from_args(args)
        app = run_app(config.app.module)
        with RoundTable(console, title=f"fedge {config.run.strategy} / {app.name if app else config.model['name']}",
                        modes=mode_columns(config), headline=app.headline if app else "accuracy") as table:
            result = run_federated(config, resume=getattr(args, "resume", False),
                                   say=lambda text: console.print(f"[dim]{escape(text)}[/dim]", soft_wrap=True),
                                   on_round=table.add,
                                   on_progress=table.progress)
    except FedgeError as exc:
        # One line however long (piped output would wrap at 80 columns); messages hold [section] names.
        console.print(f"[red]fedge-coordinator: {escape(str(exc))}[/red]", soft_wrap=True)
        return 2
    except RunInterrupted as stop:
        console.print(f"[yellow]{escape(_interrupted(stop))}[/yellow]", soft_wrap=True)
        return 130
    except KeyboardInterrupt:
        console.print("[yellow]interrupted before the run started; nothing was written[/yellow]")
        return 130
    s = result.summary
    if s.get("rounds") is not None and "headline" in s:   # an app's run: its headline metric
        name = s["headline"]
        value = s.get(f"final_{name}")
        console.print(f"final test {name} {'-' if value is None else f'{value:.4f}'} after {s['rounds']} rounds "
                      f"({s['bytes_down'] + s['bytes_up']:,} bytes moved)")
    elif s.get("rounds") is not None:
        accuracy = (f"final test accuracy {s['final_accuracy']:.4f}" if s["final_accuracy"] is not None
                    else f"final personalized accuracy {s['final_personalized_accuracy'] or 0.0:.4f}")
        console.print(f"{accuracy} after {s['rounds']} rounds ({s['bytes_down'] + s['bytes_up']:,} bytes moved)")
    console.print(f"run directory: {result.out_dir}")
    console.print(escape(f"next: fedge-profile show {result.out_dir}   fedge-profile html {result.out_dir} "
                         f"-o report.html   fedge-export {result.out_dir}"), highlight=False, soft_wrap=True)
    return 0


def _interrupted(stop) -> str:  # stop: coordinator.runtime.run.RunInterrupted
    """What is true after Ctrl-C: what can be resumed, or that nothing can."""
    if stop.checkpointed_round:
        return (f"interrupted; round {stop.checkpointed_round} is checkpointed: continue with "
                f"fedge-coordinator run --resume --out {stop.out_dir}")
    if stop.out_dir is not None:
        return f"interrupted before any round was checkpointed; nothing to resume in {stop.out_dir}"
    return "interrupted before round 1 finished; nothing was checkpointed, so there is nothing to resume"


if __name__ == "__main__":
    sys.exit(main())
