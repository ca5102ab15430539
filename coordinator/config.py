"""Run configuration: TOML file, command-line flags and ``--set KEY=VALUE`` overrides.

Sections are frozen dataclasses so a typo is an error naming the valid keys, not a
silently ignored setting. The sections here are the runtime's; each method brings
its own (``[fedprox]``, ``[dfl]``, ...), named in its registry entry
(:mod:`edge_client.registry`) and defined beside its strategy, along with the model
options it needs and the defaults it brings. The resolved configuration is written
to ``OUT/config.toml``, which is also what ``--resume`` reads back.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.aggregation import DEFAULT_TRIM
from coordinator.errors import ConfigError
from coordinator.methods import method_sections, requirements
from coordinator.selection import SELECTIONS
from edge_client.device import DeviceError, resolve_device
from edge_client.hyper import LocalTraining
from edge_client.wire.chunking import MIN_MESSAGE_BYTES
from edge_client.wire.codec import CodecError, parse_codec
from edge_client.wire.transport import BrokerUrlError, parse_broker_address

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["ConfigError", "RunConfig", "load_config", "apply_overrides", "with_method_requirements", "parse_override",
           "dump_config"]


@dataclass(frozen=True)
class RunSection:
    strategy: str = "fedavg"
    rounds: int = 5
    seed: int = 0
    out: str = ""                   # empty: runs/<run id>
    diagnostics: bool = False       # record per-layer weight divergence of each round's client models


@dataclass(frozen=True)
class DataSection:
    eval: str = "digits"            # the coordinator's evaluation data (its test split)
    partition: str = "iid"          # for clients the coordinator spawns
    local_test_fraction: float = 0.0  # share of each spawned client's data held out for personalized evaluation


@dataclass(frozen=True)
class ClientsSection:
    expected: int = 4               # how many clients the run waits for
    per_round: int = 0              # 0: all expected clients
    min_results: int = 0            # 0: as many as were selected
    round_timeout: float = 300.0    # seconds a round waits for results
    presence_timeout: float = 300.0  # seconds to wait for enough clients to be online
    max_attempts: int = 3           # retries of a round that got too few results
    max_misses: int = 2             # tasks left unanswered in a row that take a client out of selection (0: never)
    resend_every: float = 10.0      # how often a client re-sends an unacknowledged result
    spawn: int = 0                  # local client processes (or threads with inproc)
    torch_threads: int = 1          # per spawned client, to avoid oversubscription
    selection: str = "random"       # random | deadline (skip clients predicted to miss round_timeout)


TrainSection = LocalTraining   # [train]: the local training every task's hyperparameters start from


@dataclass(frozen=True)
class TransportSection:
    kind: str = "mqtt"              # mqtt | inproc
    broker: str = ""                # mqtt://HOST:PORT or mqtts://HOST:PORT (TLS); empty: the embedded broker
    protocol: str = "auto"          # 5 | 3.1.1 | auto
    prefix: str = "fedge"
    username: str = ""
    password_env: str = "FEDGE_MQTT_PASSWORD"   # the password is read from this variable, never stored
    max_message_bytes: int = 256 * 1024          # largest publish; longer messages go in chunks (broker limit)
    max_decoded_bytes: int = 64 * 1024 * 1024    # largest whole message accepted (reassembled, decompressed)
    chunking: bool = True                        # off: a message over max_message_bytes is an error
    # Chunk data the coordinator holds for results still arriving, all clients together; past it the
    # oldest incomplete ones are dropped (and re-sent by their devices). 0: the larger of 64 MiB,
    # max_decoded_bytes and clients per round x the float32 model, so a round's results all fit.
    max_partial_bytes: int = 0
    # TLS, with an mqtts:// broker: the CA that signed the broker's certificate (empty: the system's CAs),
    # and a client certificate and key for brokers that require one.
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    # A directory written by `fedge-coordinator provision`: spawned clients log in with its device bundles
    # (one user each), as a broker with use_username_as_clientid requires.
    provision_dir: str = ""


@dataclass(frozen=True)
class CodecSection:
    up: str = "fp32"                # codec of results, e.g. int8, topk:0.1+int8+zstd (docs/codecs.md)
    down: str = "fp32"              # codec of the global model sent down (no topk)
    error_feedback: bool = True     # keep what a lossy upload codec dropped and send it next time
    broadcast: bool = True          # tensors common to all of a round's tasks go once, as a retained message


@dataclass(frozen=True)
class EvalSection:
    """When rounds are evaluated: the coordinator's test split (in the background while the next round
    trains; round 0 before training) and, with ``personalized``, the clients' local splits."""

    personalized: bool = False      # also ask clients for accuracy on their local test split
    every: int = 1                  # both evaluations every this many rounds, and always in the last round
    finetune_epochs: int = 0        # local fine-tuning epochs before the personalized evaluation (0: none)
    device: str = "auto"            # torch device of the test-set evaluation: auto (CUDA if torch sees it), cpu, cuda


@dataclass(frozen=True)
class CheckpointSection:
    keep: str = "all"               # all | last


@dataclass(frozen=True)
class ExportSection:
    """ONNX export of the final global model into RUN_DIR/export/ (docs/export.md)."""

    enabled: bool = True            # after the last round; skipped with a warning without the export extra


@dataclass(frozen=True)
class SimSection:
    """How this process runs the clients it spawns with the inproc transport (coordinator/simulation.py)."""

    workers: int = 0                # tasks run on this many workers; 0: one per core; -1: a thread per client


@dataclass(frozen=True)
class AggregateSection:
    """How results are combined when some clients may be wrong or hostile (coordinator/aggregation.py)."""

    rule: str = "mean"              # mean | median | trimmed_mean | clipped_mean
    trim: float = DEFAULT_TRIM      # trimmed_mean: floor(trim x results) dropped at each end (0.2: 2 of 10)
    norm_bound: float = 0.0         # reject updates above this multiple of the round's median norm; 0: off


@dataclass(frozen=True)
class WorkersSection:
    """Aggregation workers (``fedge-coordinator worker``): processes sharing the devices' results through
    an MQTT 5 shared subscription, each checking and folding its share (docs/scale.md)."""

    count: int = 0                  # workers the coordinator waits for before round 1; 0: it takes every result itself
    group: str = "fedge-aggregators"   # the shared subscription's group name
    flush_timeout: float = 30.0     # seconds to wait for the workers' partial sums once a round's results are in


@dataclass(frozen=True)
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    model: dict[str, Any] = field(default_factory=lambda: {"name": "cnn"})
    data: DataSection = field(default_factory=DataSection)
    clients: ClientsSection = field(default_factory=ClientsSection)
    train: TrainSection = field(default_factory=TrainSection)
    transport: TransportSection = field(default_factory=TransportSection)
    codec: CodecSection = field(default_factory=CodecSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)
    export: ExportSection = field(default_factory=ExportSection)
    sim: SimSection = field(default_factory=SimSection)
    aggregate: AggregateSection = field(default_factory=AggregateSection)
    workers: WorkersSection = field(default_factory=WorkersSection)
    # The methods' own sections (name -> dataclass), read as attributes: ``config.dfl.diversity``.
    methods: Mapping[str, Any] = field(default_factory=lambda: {k: cls() for k, cls in method_sections().items()})
    # "section.key" the user set (file or flags): a method's defaults never override these.
    explicit: frozenset[str] = field(default=frozenset(), compare=False)

    def __getattr__(self, name: str) -> Any:
        methods = self.__dict__.get("methods", {})
        if name in methods:
            return methods[name]
        raise AttributeError(f"{type(self).__name__} has no section {name!r}")

    def _workers_checks(self) -> list[tuple[bool, str]]:
        w = self.workers
        if w.count == 0:
            return [(w.flush_timeout > 0, "workers.flush_timeout must be > 0")]
        need = "aggregation workers (workers.count > 0) need"
        return [
            (w.count >= 0, "workers.count must be >= 0"),
            (w.flush_timeout > 0, "workers.flush_timeout must be > 0"),
            (bool(w.group) and not any(ch in w.group for ch in "/+#"), "workers.group must be a name without / + #"),
            (self.transport.kind == "mqtt" and bool(self.transport.broker),
             f"{need} a broker they can reach too: set transport.broker (mqtt://HOST:PORT)"),
            (self.run.strategy in ("fedavg", "fedprox"),
             f"{need} a strategy whose every result folds into one weighted sum: fedavg or fedprox, "
             f"not {self.run.strategy!r}"),
            (self.aggregate.rule == "mean" and self.aggregate.norm_bound == 0,
             f"{need} aggregate.rule = 'mean' and aggregate.norm_bound = 0 (the others need every result at once)"),
            (not self.run.diagnostics, f"{need} run.diagnostics = false (it reads every result's tensors)"),
            (self.codec.broadcast, f"{need} codec.broadcast = true: they read the model results are differences from"),
        ]

    def validate(self) -> "RunConfig":
        c, r, t = self.clients, self.run, self.transport
        checks = [
            (r.rounds >= 1, "run.rounds must be at least 1"),
            (c.max_attempts >= 1, "clients.max_attempts must be at least 1"),
            (c.max_misses >= 0, "clients.max_misses must be 0 (never leave a client out) or more"),
            (self.train.epochs >= 1 and self.train.batch_size >= 1, "train.epochs and train.batch_size must be >= 1"),
            (self.train.lr > 0 and self.train.momentum >= 0, "train.lr must be > 0 and train.momentum >= 0"),
            (0.0 <= self.data.local_test_fraction < 1.0, "data.local_test_fraction must be in [0, 1)"),
            (self.eval.every >= 1 and self.eval.finetune_epochs >= 0, "eval.every must be >= 1, eval.finetune_epochs >= 0"),
            (self.aggregate.rule in ("mean", "median", "trimmed_mean", "clipped_mean"),
             "aggregate.rule is one of mean, median, trimmed_mean, clipped_mean"),
            (0 <= self.aggregate.trim < 0.5 and self.aggregate.norm_bound >= 0,
             "aggregate.trim must be in [0, 0.5) and aggregate.norm_bound >= 0 (0 turns the bound off)"),
            (not self.eval.personalized or self.data.local_test_fraction > 0 or self.clients.spawn == 0,
             "eval.personalized needs data.local_test_fraction > 0 for spawned clients"),
            (c.expected >= 1, "clients.expected must be at least 1"),
            (0 <= c.per_round <= c.expected, "clients.per_round must be between 0 (all) and clients.expected"),
            (c.min_results >= 0, "clients.min_results must be >= 0"),
            (c.round_timeout > 0 and c.presence_timeout > 0, "timeouts must be positive"),
            (c.spawn >= 0, "clients.spawn must be >= 0"),
            (self.sim.workers >= -1, "sim.workers must be >= 1, 0 (one per core) or -1 (a thread per client)"),
            (c.selection in SELECTIONS, f"clients.selection must be one of {', '.join(SELECTIONS)}"),
            (t.kind in ("mqtt", "inproc"), "transport.kind must be mqtt or inproc"),
            (t.kind == "mqtt" or c.spawn > 0, "the inproc transport needs spawned clients (--spawn-clients N)"),
            (t.protocol in ("auto", "5", "3.1.1"), "transport.protocol must be auto, 5 or 3.1.1"),
            (_broker_problem(t) == "", _broker_problem(t)),
            (t.max_message_bytes >= MIN_MESSAGE_BYTES, f"transport.max_message_bytes must be at least "
                                                       f"{MIN_MESSAGE_BYTES}"),
            (t.max_decoded_bytes >= MIN_MESSAGE_BYTES, f"transport.max_decoded_bytes must be at least "
                                                       f"{MIN_MESSAGE_BYTES}"),
            (t.max_partial_bytes == 0 or t.max_partial_bytes >= t.max_decoded_bytes,
             "transport.max_partial_bytes must be 0 (sized by the run) or at least transport.max_decoded_bytes, "
             "or the largest accepted result could never be reassembled"),
            (self.checkpoint.keep in ("all", "last"), "checkpoint.keep must be all or last"),
            *self._workers_checks(),
            ("name" in self.model, "model.name is required"),
            *(check for section in self.methods.values() for check in section.checks(self)),
        ]
        model_options, _ = requirements(r.strategy, self.model, self.explicit)   # an unknown strategy fails here
        checks += [(self.model.get(k) == v, f"run.strategy = {r.strategy!r} needs model.{k} = {v!r}")
                   for k, v in model_options.items()]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        self._check_codecs()
        try:
            resolve_device(self.eval.device)
        except DeviceError as exc:
            raise ConfigError(f"eval.device: {exc}") from None
        if self.selected_per_round < self.required_results:
            raise ConfigError(f"clients.min_results={c.min_results} exceeds the {self.selected_per_round} "
                              f"clients selected per round")
        return self

    def _check_codecs(self) -> None:
        specs = {}
        for key in ("up", "down"):
            try:
                specs[key] = parse_codec(getattr(self.codec, key))
            except CodecError as exc:
                raise ConfigError(f"codec.{key}: {exc}") from None
        if specs["down"].topk is not None:
            raise ConfigError("codec.down cannot use topk: it would zero most weights of the model sent down; "
                              "use topk in codec.up")

    @property
    def selected_per_round(self) -> int:
        return self.clients.per_round or self.clients.expected

    @property
    def required_results(self) -> int:
        return self.clients.min_results or self.selected_per_round


def _broker_problem(t: TransportSection) -> str:
    """What is wrong with the broker URL and its TLS and provisioning files ("" when nothing): checked before
    the run directory exists, so a typo costs no cleanup and no retry loop."""
    if t.broker:
        try:
            tls = parse_broker_address(t.broker).tls
        except BrokerUrlError as exc:
            return f"transport.broker: {exc}"
    else:
        tls = False
    tls_keys = [f"transport.{key}" for key in ("ca_file", "cert_file", "key_file") if getattr(t, key)]
    if tls_keys and not tls:
        return (f"{', '.join(tls_keys)} need a TLS broker: set transport.broker = \"mqtts://HOST:8883\" "
                "(the embedded broker and mqtt:// URLs do not use TLS)")
    if t.key_file and not t.cert_file:
        return "transport.key_file needs transport.cert_file (the client certificate it belongs to)"
    for key in ("ca_file", "cert_file", "key_file"):
        path = getattr(t, key)
        if path and not Path(path).is_file():
            return f"transport.{key}: {path} does not exist; give the path of a PEM file"
    if t.provision_dir:
        if not t.broker:
            return ("transport.provision_dir needs transport.broker (the provisioned broker); the embedded broker "
                    "makes its own credentials")
        if not (Path(t.provision_dir) / "devices").is_dir():
            return (f"transport.provision_dir: {t.provision_dir} has no devices/ directory; give the --out "
                    "directory of fedge-coordinator provision")
    return ""


class OverrideText(str):
    """A ``--set`` value as typed: read as TOML unless the key it sets holds text."""

    def parsed(self) -> Any:
        try:
            return tomllib.loads(f"v = {self}")["v"]
        except tomllib.TOMLDecodeError:
            return str(self)


def _coerce(section: str, key: str, value: Any, default: Any) -> Any:
    expected = type(default)
    if isinstance(value, OverrideText):
        parsed = value.parsed()
        value = parsed if expected is not str or isinstance(parsed, str) else str(value)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise ConfigError(f"{section}.{key} must be {expected.__name__}, got {value!r}")
    return value


_NOT_SECTIONS = ("methods", "explicit")


def _core_sections() -> dict[str, Any]:
    """The runtime's own sections: name -> default value (a dataclass, or the model dict)."""
    return {f.name: f.default_factory() for f in dataclasses.fields(RunConfig)  # type: ignore[misc]
            if f.name not in _NOT_SECTIONS}


def _from_dict(raw: dict[str, Any], explicit: frozenset[str] = frozenset()) -> RunConfig:
    core, methods = _core_sections(), method_sections()
    sections: dict[str, Any] = {}
    method_values = {name: cls() for name, cls in methods.items()}
    for name, values in raw.items():
        if name not in core and name not in methods:
            raise ConfigError(f"unknown config section [{name}]; valid: {', '.join([*core, *methods])}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{name}] must be a table")
        if name == "model":
            model = {k: v.parsed() if isinstance(v, OverrideText) and k != "name" else v for k, v in values.items()}
            sections[name] = {"name": "cnn", **{k: str(v) if k == "name" else v for k, v in model.items()}}
            continue
        default = method_values[name] if name in methods else core[name]
        known = {f.name: getattr(default, f.name) for f in dataclasses.fields(default)}
        for key in values:
            if key not in known:
                raise ConfigError(f"unknown key {name}.{key}; valid: {', '.join(known)}")
        value = dataclasses.replace(default, **{k: _coerce(name, k, v, known[k]) for k, v in values.items()})
        if name in methods:
            method_values[name] = value
        else:
            sections[name] = value
    return RunConfig(**sections, methods=method_values, explicit=explicit)


def _to_dict(config: RunConfig) -> dict[str, Any]:
    core = {name: dict(config.model) if name == "model" else dataclasses.asdict(getattr(config, name))
            for name in _core_sections()}
    return {**core, **{name: dataclasses.asdict(value) for name, value in config.methods.items()}}


def parse_override(item: str) -> tuple[str, str, OverrideText]:
    """``section.key=value`` -> (section, key, text); the text is typed by the key it sets.

    A text key keeps the value as typed (``transport.protocol=5`` stays "5"); any other
    key reads it as TOML (``model.hidden=[256,128]``, ``train.lr=0.01``).
    """
    path, sep, text = item.partition("=")
    section, dot, key = path.strip().partition(".")
    if not sep or not dot or not key.strip():
        raise ConfigError(f"--set expects SECTION.KEY=VALUE, got {item!r}")
    return section.strip(), key.strip(), OverrideText(text.strip())


def apply_overrides(config: RunConfig, overrides: list[tuple[str, str, Any]], *, explicit: bool = True) -> RunConfig:
    """``config`` with (section, key, value) overrides; ``explicit``: the user set them (a method's
    defaults never replace what the user set)."""
    raw = _to_dict(config)
    for section, key, value in overrides:
        raw.setdefault(section, {})[key] = value
    marked = {f"{section}.{key}" for section, key, _ in overrides} if explicit else set()
    return _from_dict(raw, config.explicit | marked)


def with_method_requirements(config: RunConfig) -> RunConfig:
    """``config`` with the model options its strategy needs and the defaults it brings, where the user
    set none (``--strategy spherefed`` alone gets ``model.head = "sphere"``); a conflicting value the
    user set is an error that names both."""
    model_options, defaults = requirements(config.run.strategy, config.model, config.explicit)
    overrides = [("model", k, v) for k, v in model_options.items() if k not in config.model]
    overrides += [(*key.split(".", 1), value) for key, value in defaults.items()]   # type: ignore[misc]
    return apply_overrides(config, overrides, explicit=False) if overrides else config


def load_config(path: Path | None = None, overrides: list[tuple[str, str, Any]] | None = None) -> RunConfig:
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    given = frozenset(f"{name}.{key}" for name, values in raw.items() if isinstance(values, dict) for key in values)
    return with_method_requirements(apply_overrides(_from_dict(raw, given), overrides or [])).validate()


def dump_config(config: RunConfig, path: Path) -> None:
    import tomli_w

    path.write_text(tomli_w.dumps(_to_dict(config)), encoding="utf-8")
