"""``fedge-coordinator status``: the fleet at a glance, from the broker and from a run directory.

Why: before a run, between runs, or on a machine without a dashboard, a person wants to know which
devices are up, what they are, how slow, big and hot their last task was and which of them failed
lately, without reading ``clients/*.jsonl`` by hand. Two sources, either or both:

- the broker: every device's retained presence (``PREFIX/clients/+/presence``: online with its device
  facts, or offline, the broker speaking its last will), the coordinator's retained run status and the
  aggregation workers' presences, read for ``--wait`` seconds over a session that ends with the command;
- a run directory: each device's latest training profile and its recent answers (``clients/ID.jsonl``:
  errors, missed tasks, when it last answered) and the run's last row.

What comes from the broker is checked as the coordinator checks it (:func:`parse_presence`); nothing
received is unpickled or evaluated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from edge_client.argcheck import positive

__all__ = ["add_command", "fleet_status"]

RECENT = 10   # the answers of a device that count as recent


def add_command(sub, name: str = "status") -> None:  # sub: the parser's subparsers
    cmd = sub.add_parser(
        name, help="list the fleet: devices online, their class, last profile and recent failures",
        description="List every device the broker or a run directory knows: online or offline (its retained "
                    "presence on the broker), its class and site (FEDGE_DEVICE_CLASS and FEDGE_SITE on the device, "
                    "else its board or architecture), when it last answered a task, its last training task's profile "
                    "(task seconds, median step, peak memory in MiB, temperature) and its failures among its last "
                    "10 answers (errors and missed tasks), with the run's state and last round. The broker is read "
                    "(for --wait seconds) when --broker or --config names it; its other settings come from --config, "
                    "else from "
                    "RUN_DIR/config.toml, and --set. On a broker with use_username_as_clientid (deploy/mosquitto.conf) "
                    "log in as a read-only user (--set transport.username=monitor), never as the coordinator: a "
                    "second login under its name disconnects the run. Profiles and failures need --run-dir. "
                    "docs/monitoring.md says more.")
    cmd.add_argument("--run-dir", type=Path, default=None, metavar="DIR", help="a run directory (its --out)")
    cmd.add_argument("--broker", default=None, help="broker URL mqtt://HOST:PORT or mqtts://HOST[:PORT] "
                                                    "[transport.broker]")
    cmd.add_argument("--config", type=Path, default=None, help="a run's TOML config: its [transport] section")
    cmd.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key, e.g. --set transport.prefix=lab (repeatable)")
    cmd.add_argument("--wait", type=positive, default=2.0, help="seconds to read retained messages (default 2)")
    cmd.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    cmd.set_defaults(handler=_status)


# -- the broker ------------------------------------------------------------------------------
def _broker_config(args: argparse.Namespace):  # -> RunConfig | None
    """The configuration whose [transport] says how to reach the broker; None unless --broker or --config
    asks for the broker. A run directory alone is not reason enough: its config logs in as the coordinator,
    and on a broker with ``use_username_as_clientid`` a second login under that name disconnects the run."""
    from coordinator.config import load_config, parse_override

    if not (args.broker or args.config):
        return None
    path = args.config
    if path is None and args.run_dir is not None and (args.run_dir / "config.toml").is_file():
        path = args.run_dir / "config.toml"
    overrides = [parse_override(item) for item in args.set]
    if args.broker:   # whatever transport the run had (in-process, embedded broker): this broker now
        overrides += [("transport", "kind", "mqtt"), ("transport", "broker", args.broker)]
    config = load_config(path, overrides)
    return config if config.transport.kind == "mqtt" and config.transport.broker else None


def read_broker(config: Any, wait: float) -> dict[str, Any]:
    """The retained presences of devices and workers and the run status on ``config``'s broker, read for ``wait`` s."""
    from coordinator.runtime.presence import parse_presence
    from coordinator.runtime.profiles import device_labels
    from edge_client.wire.protocol import ProtocolError, StatusBody, Topics, decode
    from edge_client.wire.transport import BrokerSettings, MqttTransport

    t = config.transport
    topics = Topics(t.prefix)
    settings = BrokerSettings(url=t.broker, username=t.username or None, password=os.environ.get(t.password_env),
                              protocol=t.protocol, ca_file=t.ca_file or None, cert_file=t.cert_file or None,
                              key_file=t.key_file or None, session_expiry=0, password_source=t.password_env)
    filters = [topics.all_clients("presence"), topics.all_workers("presence"), topics.coordinator_status]
    devices: dict[str, dict[str, Any]] = {}
    workers: dict[str, bool] = {}
    run: dict[str, Any] | None = None
    transport = MqttTransport(settings, f"fedge-status-{os.getpid()}").connect()
    try:
        for topic in filters:
            transport.subscribe(topic)
        until = time.monotonic() + wait
        while time.monotonic() < until:
            incoming = transport.get(max(0.0, until - time.monotonic()))
            if incoming is None or not incoming.payload:
                continue
            try:
                if incoming.topic == topics.coordinator_status:
                    msg = decode(incoming.payload)
                    run = {"run_id": msg.run_id, "round": msg.round, "state": StatusBody.from_body(msg.body).state}
                elif (worker := topics.worker_of(incoming.topic)) is not None:
                    body = parse_presence(worker, incoming.payload)
                    if body is not None:
                        workers[worker] = body.state == "online"
                elif (client := topics.client_of(incoming.topic)) is not None:
                    body = parse_presence(client, incoming.payload)
                    if body is not None:   # an offline presence (a last will) says nothing of the device
                        devices[client] = {"online": body.state == "online", "samples": body.num_samples}
                        if body.device is not None:
                            devices[client].update(zip(("device_class", "site"), device_labels(body.device)))
            except ProtocolError as exc:
                print(f"ignored a message on {incoming.topic}: {exc}", file=sys.stderr)
        for topic in filters:   # a session the broker keeps (MQTT 3.1.1) then queues nothing for us
            transport.unsubscribe(topic)
    finally:
        transport.close()
    return {"url": t.broker, "prefix": t.prefix, "run": run, "devices": devices,
            "workers": {w: ("online" if up else "offline") for w, up in sorted(workers.items())}}


# -- a run directory ---------------------------------------------------------------------------
def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_run_dir(run_dir: Path) -> dict[str, Any]:
    """What ``run_dir`` says of its run and of each device that answered or missed a task."""
    from coordinator.runtime.profiles import device_labels
    from coordinator.runtime.run_summary import contributions
    from edge_client.wire.protocol import REFUSAL_APP
    from storage.files import read_jsonl

    from coordinator.errors import ConfigError

    if not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir} is not a directory: give the --out of a run")
    rows = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    last = rows[-1] if rows else {}
    name = _headline(run_dir)
    evaluated = [r for r in rows if f"test_{name}" in r]
    run = {"dir": str(run_dir), "finished": (run_dir / "summary.json").is_file(), "round": last.get("round"),
           "headline": name, f"test_{name}": evaluated[-1][f"test_{name}"] if evaluated else None,
           "app_refused": last.get("app_refused", 0)}
    devices: dict[str, dict[str, Any]] = {}
    trained = _training_profiles(run_dir)
    contributed = contributions(rows)   # async mode's rows say what each device's results counted for
    for path in sorted((run_dir / "clients").glob("*.jsonl")):
        client = path.stem
        answers = read_jsonl(path)[-RECENT:]
        latest = _json(run_dir / "clients" / f"{client}.json") or {}
        profile = trained.get(client, {})
        failures = [a for a in answers if a.get("error") or a.get("missed")]
        why = (failures[-1].get("error") or "missed its task") if failures else None
        klass, site = device_labels(latest.get("device"))
        devices[client] = {
            "device_class": klass, "site": site,
            "last_answer_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(path.stat().st_mtime)),
            "last_round": answers[-1].get("round") if answers else None,
            "task_seconds": profile.get("seconds"), "step_seconds": profile.get("step_p50"),
            "peak_memory_bytes": profile.get("peak_rss_bytes"), "temperature_c": profile.get("temperature_c"),
            "recent_failures": len(failures), "recent_answers": len(answers), "last_failure": why,
            # its last answer refused a task because its installed app is not the run's
            "app_refused": bool(answers) and answers[-1].get("refusal") == REFUSAL_APP,
            # async mode: results counted, dropped as too stale, tasks shortened, versions rested, weight share
            "contribution": contributed.get(client)}
    return {"run": run, "devices": devices}


def _training_profiles(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Each device's latest profile of a training task (one that ran optimizer steps, as reports count them:
    :attr:`profiling.runs.RunRecords.training_objectives`). A calibration, evaluation or secure-aggregation
    task is short and says nothing of how long the device takes to train."""
    from profiling.runs import ReportError, load

    try:
        records = load(run_dir)
    except ReportError:   # nothing recorded yet
        return {}
    latest = {}
    for client, device in records.devices.items():
        profiles = [t.profile for t in records.training_tasks(device) if t.profile.get("seconds") is not None]
        if profiles:
            latest[client] = profiles[-1]
    return latest


# -- both --------------------------------------------------------------------------------------
def fleet_status(broker: dict[str, Any] | None, run_dir: dict[str, Any] | None) -> dict[str, Any]:
    """One record per device from what the broker and the run directory say (None: not consulted). The broker's
    class and site win: they are what the device says now."""
    fields = ("online", "device_class", "site", "samples", "last_answer_at", "last_round", "task_seconds",
              "step_seconds", "peak_memory_bytes", "temperature_c", "recent_failures", "recent_answers", "last_failure",
              "app_refused", "contribution")
    ids = sorted(set((broker or {}).get("devices", {})) | set((run_dir or {}).get("devices", {})))
    devices = []
    for client in ids:
        record: dict[str, Any] = dict.fromkeys(fields)
        record.update((run_dir or {}).get("devices", {}).get(client, {}))
        record.update((broker or {}).get("devices", {}).get(client, {}))
        devices.append({"client_id": client, **record})
    return {"broker": None if broker is None else {k: broker[k] for k in ("url", "prefix", "run", "workers")},
            "run": None if run_dir is None else run_dir["run"], "devices": devices}


def _status(args: argparse.Namespace) -> int:
    from coordinator.config import ConfigError
    from edge_client.wire.transport import TransportError

    try:
        config = _broker_config(args)
        if config is None and args.run_dir is None:
            raise ConfigError("nothing to read: give --broker mqtt://HOST:PORT (or a --config naming "
                              "transport.broker) and/or --run-dir DIR")
        run_dir = read_run_dir(args.run_dir) if args.run_dir is not None else None
        broker = read_broker(config, args.wait) if config is not None else None
    except (ConfigError, TransportError) as exc:
        print(f"fedge-coordinator status: {exc}", file=sys.stderr)
        return 2
    status = fleet_status(broker, run_dir)
    if args.json:
        print(json.dumps(status, indent=1))
    else:
        _print_table(status)
    return 0


def _run_said(run: dict[str, Any]) -> str:
    """The retained run status in words: a finished run names its last round, a running one the round in
    progress (docs/protocol.md)."""
    where = {"finished": "finished after round", "running": "running round", "stopped": "stopped in round"}
    return f"run {run['run_id']} {where.get(run['state'], run['state'] + ' at round')} {run['round']}"


def _print_table(status: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    def show(value: Any, form: str = "{}") -> str:   # escaped: devices choose their ids, classes and errors
        return "-" if value is None or value == "" else escape(form.format(value))

    console = Console(width=None if sys.stdout.isatty() else 200)   # piped: wide enough for every column
    broker, run = status["broker"], status["run"]
    if broker is not None:
        r = broker["run"]
        said = _run_said(r) if r else "no run status retained"
        workers = ", ".join(f"{w} {s}" for w, s in broker["workers"].items()) or "none"
        console.print(escape(f"broker {broker['url']} (prefix {broker['prefix']}): {said}; aggregation workers: "
                             f"{workers}"), highlight=False, soft_wrap=True)
    if run is not None:
        name = run.get("headline", "accuracy")
        value = show(run.get(f"test_{name}"), "{:.4f}")
        refused = [d["client_id"] for d in status["devices"] if d.get("app_refused")]
        apps = (f"; {run['app_refused']} device(s) refused for their app, which is not the run's "
                f"({', '.join(refused) or 'see clients/'}): install the run's app and restart them"
                if run.get("app_refused") else "")
        console.print(escape(f"run directory {run['dir']}: {'finished' if run['finished'] else 'not finished'}, "
                             f"last row round {run['round']}, test {name} {value}{apps}"), highlight=False,
                      soft_wrap=True)
    table = Table(title=f"{len(status['devices'])} devices")
    asynchronous = any(d.get("contribution") for d in status["devices"])
    for column in ("device", "state", "last answer", "class", "site", "task s", "step ms", "peak MiB", "temp C",
                   "failures", "last failure", *(("async results",) if asynchronous else ())):
        table.add_column(column)
    for d in status["devices"]:
        state = {True: "[green]online[/green]", False: "[red]offline[/red]", None: "-"}[d["online"]]
        answered = show(d["last_answer_at"]) + (f" (round {d['last_round']})" if d["last_round"] is not None else "")
        failures = show(d["recent_failures"]) + (f"/{d['recent_answers']}" if d["recent_answers"] else "")
        table.add_row(show(d["client_id"]), state, answered, show(d["device_class"]), show(d["site"]),
                      show(d["task_seconds"], "{:.2f}"),
                      show(None if d["step_seconds"] is None else d["step_seconds"] * 1000, "{:.1f}"),
                      show(None if d["peak_memory_bytes"] is None else d["peak_memory_bytes"] / 2**20, "{:.0f}"),
                      show(d["temperature_c"], "{:.1f}"), failures, show((d["last_failure"] or "")[:60]),
                      *((_contribution_said(d.get("contribution")),) if asynchronous else ()))
    console.print(table)


def _contribution_said(c: dict[str, Any] | None) -> str:
    """A device's contribution to an async run, in a cell: what counted, what was dropped as too stale, its rest."""
    if not c:
        return "-"
    said = f"{c['counted']} counted, {c['dropped']} too stale, {c['weight_share']:.0%} of the weight"
    return said + "".join(f", {c[k]} {k}" for k in ("shortened", "rested") if c[k])


def _headline(run_dir: Path) -> str:
    """The metric a run is judged by: its app's headline (the run's config.toml names the app), or accuracy for
    fedge's own networks and for an app this machine cannot load."""
    from coordinator.config import load_config
    from storage.errors import FedgeError

    from edge_client.app import run_app

    path = run_dir / "config.toml"
    try:
        app = run_app(load_config(path).app.module) if path.is_file() else None
    except FedgeError:
        return "accuracy"
    return app.headline if app is not None else "accuracy"
