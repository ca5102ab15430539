"""One federated run from start to finish: run directory, broker, clients, rounds.

Everything with a lifetime (embedded broker, transport, spawned clients) is opened
here and closed in reverse order whatever happens, so an interrupted run leaves no
stray processes behind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from coordinator.aggregation import tolerance
from coordinator.config import ConfigError, RunConfig, dump_config
from coordinator.privacy_noise import refusal as noise_refusal, start_note as noise_note
from coordinator.runtime.asynchronous import AsyncRun
from coordinator.runtime.bookkeeping import RunRecords
from coordinator.runtime.engine import Coordinator, EvalData, RunError
from coordinator.runtime.run_summary import run_summary
from coordinator.runtime.weights import WeightBound
from coordinator.ops.spawn import SpawnedClients, sim_client_id, spawn_processes, spawn_threads
from coordinator.strategy_setup import make_strategy
from coordinator.strategies.base import Strategy
from coordinator.telemetry import run_telemetry
from edge_client.data import (Dataset, describe_partitions, evaluation_split, load_dataset, model_normalization,
                               partition_indices)
from edge_client.app import APP_KEY, App, app_identity, check_samples, run_app
from edge_client.models import federated_names
from edge_client.objectives import Objective
from edge_client.registry import build_model, describe_size, model_size
from edge_client.wire.transport import BrokerSettings, InprocHub, MqttTransport, Transport
from storage.checkpoint import checkpoint_rounds, latest_checkpoint, load_checkpoint
from storage.errors import FedgeError
from storage.state import ServerState

__all__ = ["RunResult", "RunInterrupted", "run_federated", "new_run_id"]

log = logging.getLogger("fedge.coordinator")


@dataclass(frozen=True)
class RunResult:
    out_dir: Path
    summary: dict[str, Any]


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run, with what is true afterwards: the directory kept (None: a start that
    had checkpointed nothing was removed) and the last checkpointed round (None: nothing to resume)."""

    def __init__(self, out_dir: Path | None, checkpointed_round: int | None) -> None:
        super().__init__(out_dir, checkpointed_round)
        self.out_dir = out_dir
        self.checkpointed_round = checkpointed_round


class _Terminated(KeyboardInterrupt):
    """SIGTERM (systemd, docker stop, kill): handled as Ctrl-C is, so the run stops cleanly and can resume."""


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """While the run goes, SIGTERM raises :class:`_Terminated` in the main thread, as SIGINT raises
    KeyboardInterrupt; elsewhere (a run on another thread) signals are left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: Any) -> None:
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def _setup_file_log(out_dir: Path) -> logging.Handler:
    handler = logging.FileHandler(out_dir / "coordinator.log", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    handler.setLevel(logging.INFO)
    root = logging.getLogger("fedge")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return handler


@contextlib.contextmanager
def _open_transport(config: RunConfig, run_id: str,
                    say: Callable[[str], None]) -> Iterator[tuple[Transport, dict[str, Any]]]:
    """The coordinator's transport plus what spawned clients need to reach the same broker."""
    t = config.transport
    if t.kind == "inproc":
        hub = InprocHub()
        transport = hub.connect("coordinator")
        try:
            yield transport, {"hub": hub}
        finally:
            transport.close()
        return
    broker = None
    if t.broker:
        url, username, password, protocol = t.broker, t.username or None, os.environ.get(t.password_env), t.protocol
    else:
        from coordinator.ops.broker import EmbeddedBroker

        spawned = [sim_client_id(i) for i in range(config.clients.spawn)]   # each its own login and topics
        broker = EmbeddedBroker(devices=spawned, prefix=t.prefix)
        endpoint = broker.start()
        url, username, password, protocol = endpoint.url, endpoint.username, endpoint.password, endpoint.protocol
        say(f"started the embedded MQTT broker at {url} (MQTT {protocol}, generated credentials)")
    try:
        settings = BrokerSettings(url=url, username=username, password=password, protocol=protocol,
                                  max_message_bytes=t.max_message_bytes, ca_file=t.ca_file or None,
                                  cert_file=t.cert_file or None, key_file=t.key_file or None,
                                  password_source=t.password_env)
        transport = MqttTransport(settings, f"fedge-coordinator-{run_id}", flow_control=True).connect()
        try:
            yield transport, {"url": url, "username": username, "password": password,
                              "protocol": transport.protocol or protocol,
                              "devices": endpoint.devices if broker is not None else {}}
        finally:
            transport.close()
    finally:
        if broker is not None:
            broker.stop()


def _prepare_out_dir(config: RunConfig, resume: bool) -> tuple[Path, str, int, bool]:
    """The run directory, run id, last checkpointed round, and whether this call created the directory."""
    if resume:
        if not config.run.out:
            raise ConfigError("--resume needs --out DIR of the run to continue")
        out = Path(config.run.out)
        ckpt = latest_checkpoint(out / "checkpoints")
        if ckpt is None:
            raise ConfigError(f"nothing to resume in {out}: it has no checkpoints/")
        state, info = load_checkpoint(ckpt)
        return out, info["run_id"], state.round, False
    run_id = new_run_id()
    out = Path(config.run.out or Path("runs") / run_id)
    if latest_checkpoint(out / "checkpoints") is not None:
        raise ConfigError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    return out, run_id, 0, created


def _close_log(handler: logging.Handler) -> None:
    logging.getLogger("fedge").removeHandler(handler)
    handler.close()


def run_federated(config: RunConfig, *, resume: bool = False, say: Callable[[str], None] = print,
                  on_round: Callable[[dict[str, Any]], None] | None = None,
                  strategy: Strategy | None = None,
                  on_progress: Callable[[dict[str, Any]], None] | None = None,
                  client_objectives: Callable[[str], Mapping[str, Objective]] | None = None) -> RunResult:
    """Run (or resume) the training run ``config`` describes; return its directory and summary.

    ``strategy``: one to use instead of the configured ``run.strategy`` (a method being
    developed, before it has a registry entry); the rest of the configuration applies as is.
    ``client_objectives(client_id)``: with in-process clients (``transport.kind = "inproc"``), the
    objectives a client runs instead of the registry's: a device that behaves otherwise, such as a
    hostile one in ``bench/poisoning.py``.
    ``on_round`` gets each round's metrics row; ``on_progress`` what happens in between (clients
    coming online, results coming in: :meth:`coordinator.runtime.engine.Coordinator.pump`).
    """
    strategy = strategy or make_strategy(config)   # a configuration it refuses leaves nothing behind
    swamped = noise_refusal(config)   # central DP's noise on the mean at this fleet size, before anything is made
    if swamped:
        raise ConfigError(swamped)
    if client_objectives is not None and not (config.transport.kind == "inproc" and config.clients.spawn):
        raise ConfigError("client objectives are for in-process clients: transport.kind = 'inproc' with "
                          "clients.spawn > 0")
    out, run_id, done, created = _prepare_out_dir(config, resume)
    if resume and done >= config.run.rounds and not RunRecords.pending(out, done):
        say(f"run {run_id} finished all {done} rounds already; nothing to resume (raise --rounds to train more)")
        summary_path = out / "summary.json"
        return RunResult(out, json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.is_file() else {})
    dump_config(config, out / "config.toml")
    handler = _setup_file_log(out)
    began: list[bool] = []   # not empty once the run is on the broker: its failures are the log's to explain
    try:
        with _sigterm_as_interrupt():
            return _run(config, out, run_id, resume, say, on_round or (lambda row: None), strategy, on_progress,
                        client_objectives, began)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            log.warning("run %s stopped by %s", run_id, "SIGTERM" if isinstance(exc, _Terminated) else "Ctrl-C")
        else:
            log.error("run %s failed: %s", run_id, exc, extra={"said": True})
        _close_log(handler)
        rounds = checkpoint_rounds(out / "checkpoints")
        failed = bool(began) and not isinstance(exc, KeyboardInterrupt)   # on the broker: the log says why
        if not rounds and created:   # a start that failed leaves no run directory behind, but for its logs
            if failed:
                _keep_only_logs(out)
            else:
                shutil.rmtree(out, ignore_errors=True)
        if failed:
            _name_the_log(exc, out, bool(rounds))
        if isinstance(exc, KeyboardInterrupt):
            kept = None if not rounds and created else out
            raise RunInterrupted(kept, max(rounds) if rounds else None) from None
        raise
    finally:
        _close_log(handler)


def _keep_only_logs(out: Path) -> None:
    """A run that failed on the broker before its first checkpoint: nothing in ``out`` can be resumed, but
    ``coordinator.log`` (and spawned clients' ``logs/``) say why it failed, so they stay."""
    for path in out.iterdir():
        if path.name in ("coordinator.log", "logs"):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _name_the_log(exc: BaseException, out: Path, checkpointed: bool) -> None:
    """Add where the run's log is to the error that ended it (a fedge error: its one line is what the user
    reads), and whether anything can be resumed."""
    if isinstance(exc, FedgeError) and exc.args and isinstance(exc.args[0], str):
        kept = "" if checkpointed else "nothing was checkpointed; "
        exc.args = (f"{exc.args[0]} ({kept}the coordinator's log: {out / 'coordinator.log'})", *exc.args[1:])


def _run(config: RunConfig, out: Path, run_id: str, resume: bool, say: Callable[[str], None],
         on_round: Callable[[dict[str, Any]], None], strategy: Strategy,
         on_progress: Callable[[dict[str, Any]], None] | None,
         client_objectives: Callable[[str], Mapping[str, Objective]] | None, began: list[bool]) -> RunResult:
    started = time.monotonic()
    app = run_app(config.app.module)
    dataset: Dataset | None = None
    if app is None:
        dataset = load_dataset(config.data.eval, train=config.clients.spawn > 0)   # spawned clients' partitions
        # As the clients see their data: attribute skew can change the channels (edge_client/attribute_skew.py).
        x_eval, y_eval = evaluation_split(dataset, config.data.partition)
        eval_data = EvalData(torch.from_numpy(x_eval), torch.from_numpy(y_eval))
    else:
        samples = check_samples(app.eval_data(config.data.eval), app, "eval_data")
        eval_data = EvalData(samples.x, samples.y)
    state = _starting_state(config, out, run_id, resume, strategy, dataset, eval_data.x, say, app)
    _say_setup(config, strategy, state, dataset, say)
    rows = RunRecords.read(out, state.round) if resume else []
    with (_open_transport(config, run_id, say) as (transport, reach),
          run_telemetry(config, run_id, say, app) as telemetry):
        coordinator = Coordinator(config, transport, run_id=run_id, out_dir=out, strategy=strategy, state=state,
                                  eval_data=eval_data, on_progress=on_progress)
        telemetry.watch(coordinator.roster, coordinator.profile_store)   # [metrics]: the fleet at each scrape
        # Async mode's driver takes over the intake before any message is handled: a resumed coordinator's
        # session may hold results to the stopped one's tasks, queued while it was down.
        driver = AsyncRun(coordinator, pump=coordinator.pump) if config.run.mode == "async" else None
        coordinator.announce("running")
        began.append(True)
        spawned = SpawnedClients()
        completed = False
        try:
            if coordinator.started_after < config.run.rounds:   # else only evaluations left undone are to do
                spawned = _spawn_clients(config, reach, dataset, out, client_objectives, app)
                _wait_for_clients(coordinator, spawned, say)
            _train(coordinator, rows, out, telemetry.observing(on_round), driver)
            completed = True
        finally:
            # "stopped": the run may be resumed; devices drop what it queued instead of training it. "finished"
            # carries the last round done (docs/protocol.md), not the next one a running status would name.
            if completed:
                coordinator.announce("finished", coordinator.state.round)
            else:
                coordinator.announce("stopped")
            spawned.stop(meanwhile=lambda seconds: _drop_arrivals(transport, seconds))
    summary = {**run_summary(config, run_id, out, rows, time.monotonic() - started, coordinator.state.spec,
                             coordinator.started_after), **strategy.summary(rows)}
    if config.export.enabled:
        summary["export"] = _export_final(out, say, app)
    (out / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    return RunResult(out, summary)


def _drop_arrivals(transport: Transport, seconds: float) -> None:
    """Take what arrives for ``seconds`` and drop it. Once the rounds are over nothing reads the
    transport, but what the leaving clients still send (their offline presence) must be taken all the
    same: the coordinator acknowledges a message when it takes it, and a broker left waiting gives up
    noisily (amqtt after 5 s, with a traceback for each message at its shutdown)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        transport.get(left)


def _starting_state(config: RunConfig, out: Path, run_id: str, resume: bool, strategy: Strategy,
                    dataset: Dataset | None, x_eval: torch.Tensor, say: Callable[[str], None],
                    app: App | None = None) -> ServerState:
    """The state round 1 starts from (its network fitted to the data), or the last checkpoint's on resume."""
    if resume:   # the network is the checkpoint's: a strategy may have changed it since round 1
        state, _ = load_checkpoint(latest_checkpoint(out / "checkpoints"))  # type: ignore[arg-type]
        say(f"resuming run {run_id} after round {state.round}")
        return state
    if app is not None:   # the app's model options: [model] as given (its default network name is fedge's own)
        options = {k: v for k, v in config.model.items() if k != "name" or "model.name" in config.explicit}
        spec = strategy.model_spec({**options, APP_KEY: app_identity(app).to_spec()})
    else:
        assert dataset is not None
        spec = strategy.model_spec({**config.model, "num_classes": dataset.num_classes,
                                    "in_channels": int(x_eval.shape[1]), "image_size": dataset.image_size,
                                    "normalization": model_normalization(dataset, config.data.partition).to_spec()})
    torch.manual_seed(config.run.seed)
    model = build_model(spec)
    params = {k: v.detach().clone() for k, v in model.state_dict().items() if k in set(federated_names(model))}
    return strategy.initialize(spec, params)


def _say_setup(config: RunConfig, strategy: Strategy, state: ServerState, dataset: Dataset | None,
               say: Callable[[str], None]) -> None:
    """What a person starting the run should know before it waits: the model's size, what the aggregation
    withstands, what central DP's noise does to the mean update, and the sizes of the spawned clients' partitions."""
    size = describe_size(model_size(state.spec))
    data = f"data {config.data.eval}" + (" (the default; --data names another)" if config.data.eval == "digits" else "")
    named = (f"app {state.spec[APP_KEY]['name']} {state.spec[APP_KEY]['version']}" if APP_KEY in state.spec
             else f"model {state.spec['name']}")
    log.info("%s: %s; %s", named, size, data, extra={"said": True})
    say(f"{named}: {size}; {data}")
    if strategy.capabilities.robust:
        _say_tolerance(config, say)
    noise, heavy = noise_note(config)
    if heavy:
        log.warning("%s", noise)
    elif noise:
        log.info("%s", noise, extra={"said": True})
        say(noise)
    spawn = config.clients.spawn
    if spawn and dataset is not None:
        parts = partition_indices(dataset.y_train, config.data.partition, spawn, config.run.seed)
        sizes = [d["size"] for d in describe_partitions(dataset.y_train, parts, dataset.num_classes)]
        log.info("partition %s over %d clients: sizes %s", config.data.partition, spawn, sizes, extra={"said": True})
        say(f"partition {config.data.partition}: client sizes {sizes}")


def _spawn_clients(config: RunConfig, reach: dict[str, Any], dataset: Dataset | None, out: Path,
                   client_objectives: Callable[[str], Mapping[str, Objective]] | None,
                   app: App | None = None) -> SpawnedClients:
    """The ``clients.spawn`` local clients: threads on the in-process hub, or processes on the broker."""
    spawn = config.clients.spawn
    if spawn and config.transport.kind == "inproc":
        return spawn_threads(config, spawn, hub=reach["hub"], dataset=dataset, out_dir=out,
                             objectives=client_objectives, app=app)
    if spawn:
        return spawn_processes(config, spawn, broker_url=reach["url"], protocol=reach["protocol"],
                               username=reach["username"], password=reach["password"], out_dir=out,
                               device_logins=reach["devices"])
    return SpawnedClients()


def _wait_for_clients(coordinator: Coordinator, spawned: SpawnedClients, say: Callable[[str], None]) -> None:
    """Wait for ``clients.expected`` clients, ending the wait at once if spawned clients die meanwhile."""
    config = coordinator.config

    def watchdog() -> None:
        failures = spawned.failures()
        if failures:
            raise RunError("spawned clients failed: " + "; ".join(failures))

    coordinator.watchdog = watchdog
    say(f"waiting for {config.clients.expected} clients on prefix '{config.transport.prefix}'")
    coordinator.wait_for_clients(config.clients.expected, config.clients.presence_timeout)
    coordinator.watchdog = lambda: None


def _train(coordinator: Coordinator, rows: list[dict[str, Any]], out: Path,
           on_round: Callable[[dict[str, Any]], None], driver: AsyncRun | None) -> None:
    """Round 0's row (a new run: the initial model's evaluation), or the evaluations a killed coordinator
    left undone (a resumed one), then the remaining rounds (``driver``: async mode's versions), each row
    appended to ``rows`` and written."""
    keep_all = coordinator.config.checkpoint.keep == "all"
    records = RunRecords(out, rows, checkpoint=lambda state: coordinator.checkpoint(state, keep_all=True),
                         keep_all=keep_all, on_round=on_round)
    if not rows:
        rows.append({"round": 0, **coordinator.evaluate(), "selected": 0, "returned": 0, "late": 0,
                     "rejected": 0, "bytes_down": 0, "bytes_up": 0, "seconds": 0.0})
        on_round(rows[-1])
    records.evaluate_pending(coordinator.evaluation.now)
    if driver is not None:   # model versions instead of rounds, each row whole at once
        driver.run(coordinator.config.run.rounds, records.complete)
    else:
        coordinator.run_rounds(coordinator.started_after + 1, coordinator.config.run.rounds, records)
    records.write()


def _say_tolerance(config: RunConfig, say: Callable[[str], None]) -> None:
    """How many hostile clients the configured aggregation tolerates at this round size, and the bound on a
    result's weight, said at start; a warning when a defence was asked for and tolerates nobody here."""
    a = config.aggregate
    defence = tolerance(a.rule, trim=a.trim, norm_bound=a.norm_bound, per_round=config.selected_per_round,
                        min_results=config.required_results)
    log.info(defence.message, extra={"said": True})
    say(defence.message)
    if defence.warning:
        log.warning(defence.warning)
    bound = WeightBound(config.clients.max_weight_ratio, config.clients.max_samples, tuple).describe()
    log.info(bound, extra={"said": True})
    say(bound)


def _export_final(out: Path, say: Callable[[str], None], app: App | None = None) -> dict[str, Any]:
    """The final global model as ONNX in OUT/export/ (``[export] enabled``); never fails the run."""
    try:   # the export extra (onnx, onnxruntime) is optional on a coordinator
        from export.app_export import export_app
        from export.errors import ExportError
        from export.pipeline import export_after_run
    except ImportError as exc:
        log.warning("not exporting the final model to ONNX (%s): install the export extra "
                    "(pip install 'fedge[export]') or set export.enabled = false", exc)
        return {"skipped": f"the export extra is not installed ({exc})"}
    if app is not None:
        try:
            card = export_app(out)
        except ExportError as exc:
            log.warning("the automatic ONNX export of %s failed: %s", out, exc)
            say(f"no ONNX export: {exc}")
            return {"error": str(exc)}
        name = f"test_{card['headline']}"
        say(f"exported the final model to {card['onnx']} ({name} {card[name]:.4f} served by ONNX Runtime)")
        return {"onnx": card["onnx"], "bytes": card["bytes"], name: card[name],
                "parity_max_abs_diff": card["parity"]["max_abs_diff"]}
    result = export_after_run(out)
    if "onnx" in result:
        say(f"exported the final model to {result['onnx']} (test accuracy {result['test_accuracy']:.4f})")
    else:
        say(f"no ONNX export: {result.get('skipped') or result.get('error')}")
    return result
