"""The runtime's configuration sections (``[run]``, ``[clients]``, ``[transport]``, ...): frozen dataclasses,
so a typo is an error naming the valid keys, not a silently ignored setting.

Each method brings its own sections beside its strategy (:mod:`edge_client.registry`);
:class:`coordinator.config.RunConfig` holds them all.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

from edge_client.hyper import LocalTraining
from edge_client.privacy_account import DEFAULT_ACCOUNTANT

__all__ = ["AppSection", "ServerSection", "RunSection", "DataSection", "ClientsSection", "TrainSection", "TransportSection", "CodecSection",
           "EvalSection", "CheckpointSection", "ExportSection", "SimSection", "AggregateSection", "WorkersSection",
           "AsyncSection", "MODES", "WEIGHTINGS", "SLOW_POLICIES", "SelectionSection", "PrivacySection",
           "PRIVACY_MODES", "SecAggSection", "MetricsSection", "ScheduleSection", "LR_SCHEDULES", "SELECTIONS", "SPENT_DEVICES", "RULES",
           "DEFAULT_TRIM"]

ORDERS = ("arrival", "sorted")   # aggregate.order: how a streamed phase folds its results
SELECTIONS = ("random", "deadline", "profile")   # clients.selection (coordinator/runtime/selection.py)
MODES = ("sync", "async")   # run.mode: rounds that wait for their clients, or buffered asynchronous versions
WEIGHTINGS = ("fedbuff", "normalized")   # async.weighting: how a buffer combines its results (async_buffer.py)
SLOW_POLICIES = ("shorten", "rest", "send")   # async.slow: a device predicted too stale (async_pace.py)
RULES = ("mean", "median", "trimmed_mean", "clipped_mean")   # aggregate.rule (coordinator/aggregation.py)
# Drops 2 of a round's 10 values at each end: the 2 hostile clients of 10 that docs/robustness.md measures.
DEFAULT_TRIM = 0.2


@dataclass(frozen=True)
class RunSection:
    strategy: str = "fedavg"        # the learning method (docs/methods.md); fedge-coordinator --help lists them.
                                # Each is one entry in edge_client/registry.py, and may set other keys' defaults
                                # (model options, the held-out share, ...), refuse some, or count run.rounds in
                                # phases: docs/configuration.md, "What a method changes"; `fedge-coordinator config
                                # show` marks the values a method set
    rounds: int = 5                 # federated rounds (model versions in run.mode = "async"); with --resume, the last
                                # round to reach
    seed: int = 0                   # seeds model initialization, client selection, spawned clients' partitions and
                                # local shuffling
    out: str = ""                   # the run directory (docs/run-directory.md); empty: runs/<run id>
    diagnostics: bool = False       # record per-layer weight divergence of each round's client models: adds
                                # weight_divergence and weight_divergence_mean to each round's row
    mode: str = "sync"              # sync | async (buffered asynchronous aggregation, docs/async.md)


@dataclass(frozen=True)
class ServerSection:
    """``[server]``: the stages of the coordinator's step that compose with any strategy combining model deltas."""

    optimizer: str = ""             # "": the strategy's own; "fedavg" (plain step) or a method's optimizer, each with
                                # its settings in its own section (docs/server-optimizers.md); for any strategy that
                                # combines model deltas


@dataclass(frozen=True)
class AppSection:
    module: str = ""                # the app the run trains: an installed app's name or "package.module:attribute";
                                # "": vision, fedge's own networks and data sets (docs/apps.md)


@dataclass(frozen=True)
class DataSection:
    eval: str = "digits"            # the coordinator's data (a data spec, docs/data.md): its test split evaluates
                                # the model, its shape and classes size the model, and spawned clients train on
                                # partitions of its train split
    partition: str = "iid"          # how the clients the coordinator spawns split data.eval (a partition spec,
                                # docs/data.md)
    local_test_fraction: float = 0.0  # share of each spawned client's data held out for personalized evaluation,
                                # in [0, 1); a method that evaluates on it may default it higher


@dataclass(frozen=True)
class ClientsSection:
    expected: int = 4               # how many clients must be online before round 1
    per_round: int = 0              # clients selected for training each round; 0: all expected clients
    min_results: int = 0            # results needed to aggregate; 0: as many as were selected
    # Over-selection (docs/selection.md#over-selection): draw ceil(per_round x this) devices and close the round as
    # soon as per_round results are in; the others' results then count as late. 1.0: draw per_round, wait for all.
    over_select: float = 1.0
    round_timeout: float = 300.0    # seconds an attempt waits for results (up to twice as long for devices
                                # measured to need it: docs/protocol.md, "A round"); also how long a client keeps
                                # re-sending an unacknowledged result
    presence_timeout: float = 300.0  # seconds to wait for enough clients to be online, before round 1 and
                                # whenever fewer than needed are online
    max_attempts: int = 3           # attempts at a phase that got too few results (each with a fresh selection)
                                # before the run fails
    max_misses: int = 2             # tasks left unanswered in a row that take a client out of selection (0: never),
                                # until it answers or announces itself again
    max_rejected: int = 2           # tasks in a row whose results were rejected that do the same (0: never),
                                # until it announces itself again; one more rejected result benches it again
                                # (docs/protocol.md)
    max_weight_ratio: float = 10.0  # a result weighs at most this times the online devices' median announced count
                                # (the lower median; capped results are counted as weight_capped); 0: no such bound,
                                # else at least 1
    max_samples: int = 0            # ... and at most this many samples, a fixed cap (0: no fixed bound)
    presence_interval: float = 5.0  # seconds after a presence re-sent a task in which presences re-send nothing
                                # (counted as presence_ignored); 0: every presence does
    resend_every: float = 10.0      # how often a client re-sends an unacknowledged result: seconds before the first
                                # re-send, each later wait doubled (at least 0.5)
    spawn: int = 0                  # local client processes (or threads with inproc)
    torch_threads: int = 1          # torch threads of each spawned client process, to avoid oversubscription
    selection: str = "random"       # random | deadline (skip clients predicted to miss round_timeout) | profile.
                                # deadline: leave out first the clients whose recent round times (median of the last
                                # 3, x 1.25) predict they would miss round_timeout, never fewer than the round needs
                                # results, and try a skipped client again after 5 skips in a row unless it still works
                                # on an earlier task (at most 10 x round_timeout), and those likely to go offline
                                # before they finish; profile: Oort-style, by the devices' own reports (memory,
                                # heat, battery, speed, loss, presence; the [selection] keys, docs/selection.md)


TrainSection = LocalTraining   # [train]: the local training every task's hyperparameters start from

LR_SCHEDULES = ("constant", "cosine")   # schedule.lr


@dataclass(frozen=True)
class ScheduleSection:
    """``[schedule]``: the local learning rate round by round, ``train.lr`` being its peak.

    The coordinator writes each round's rate into the tasks (every strategy's, every task whose
    hyperparameters carry ``lr``), so devices keep no schedule of their own: a device that restarts or joins
    late trains at the fleet's rate, and the rate a round ran at is in its row (``train_lr``).
    """

    lr: str = "constant"            # constant | cosine: lr (1 + cos(pi (r - 1) / R)) / 2 in round r of run.rounds R;
                                # the coordinator writes each round's rate into the tasks of every strategy (each
                                # task's lr scaled, so a method's own rates keep their ratio), and the row records
                                # train_lr
    warmup_rounds: int = 0          # the rate rises linearly, train.lr x r / W, over the first W rounds, before any
                                # decay

    @property
    def scheduled(self) -> bool:
        return self.lr != "constant" or self.warmup_rounds > 0

    def factor(self, round: int, rounds: int) -> float:
        """What ``train.lr`` is multiplied by in ``round`` (1-based) of ``rounds``: never 0 (a device refuses a
        rate of 0), 1 when nothing is scheduled."""
        warm = min(1.0, round / self.warmup_rounds) if self.warmup_rounds > 0 else 1.0
        decay = (1.0 + math.cos(math.pi * (round - 1) / max(rounds, 1))) / 2.0 if self.lr == "cosine" else 1.0
        return warm * decay


@dataclass(frozen=True)
class TransportSection:
    kind: str = "mqtt"              # mqtt | inproc (the clients as threads through an in-memory broker; needs
                                # clients.spawn)
    broker: str = ""                # mqtt://HOST:PORT or mqtts://HOST:PORT (TLS); empty: the embedded broker, on
                                # 127.0.0.1 (reachable from this machine only)
    protocol: str = "auto"          # 5 | 3.1.1 | auto (try 5, then 3.1.1); the embedded broker always uses 3.1.1
    prefix: str = "fedge"           # the first level of every topic: fleets on one broker use different ones; no
                                # +, # or trailing /
    username: str = ""              # the broker login, when it asks for one (its password from password_env);
                                # empty: connect without credentials
    password_env: str = "FEDGE_MQTT_PASSWORD"   # the password is read from this variable, never stored
    max_message_bytes: int = 256 * 1024          # largest publish; longer messages go in chunks (broker limit);
                                # at least 1024; spawned clients get the same
    max_decoded_bytes: int = 64 * 1024 * 1024    # largest whole message accepted (reassembled, decompressed)
    chunking: bool = True                        # off: a message over max_message_bytes is an error (on the
                                # coordinator it ends the run)
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
    up: str = "fp32"                # codec of results, e.g. int8, topk:0.1+int8+zstd (docs/codecs.md): a value
                                # format fp32, fp16, bf16, int8 or int8:stochastic, optionally one of
                                # topk:FRACTION, eden[:FRACTION] or lowrank:RANK, and zstd[:LEVEL] or lz4[:LEVEL], joined with +
    down: str = "fp32"              # codec of tasks and the model broadcast sent down: the same forms without
                                # topk, eden or lowrank
    error_feedback: bool = True     # with a lossy codec.up, clients keep what encoding dropped and add it to the
                                # next update
    broadcast: bool = True          # tensors common to all of a round's tasks go once, as a retained message
    down_delta: str = ""            # delta broadcasts: beside each model broadcast, the difference from the model
                                # devices rebuilt from the one before, in this codec (int8+zstd; the same forms as
                                # codec.up, topk too); devices holding that model fetch it instead (docs/codecs.md).
                                # "" (default): none. Needs codec.broadcast and an fp32 codec.down


@dataclass(frozen=True)
class EvalSection:
    """When rounds are evaluated: the coordinator's test split (in the background while the next round
    trains; round 0 before training) and, with ``personalized``, the clients' local splits."""

    personalized: bool = False      # also ask clients for accuracy on their local test split: an evaluate phase
                                # for every online client (needs data.local_test_fraction > 0 with spawned clients,
                                # --local-test-fraction on devices)
    every: int = 1                  # both evaluations every this many rounds, and always in the last round
                                # (round 0 is always tested); rows of other rounds have no test_accuracy, test_loss.
                                # The test-set evaluation runs beside the next round (not in its seconds); the round's
                                # row and checkpoint are written once it is aggregated, the row marked "evaluation":
                                # "pending" until the evaluation replaces the mark, so --resume after a crash
                                # evaluates that checkpoint again instead of training the round again
                                # (docs/robustness.md)
    finetune_epochs: int = 0        # local fine-tuning epochs before the personalized evaluation (0: none), with
                                # [train]'s settings; a method with parts that stay on the device may use them to
                                # refresh those parts instead (its page says how)
    device: str = "auto"            # torch device of the test-set evaluation: auto (CUDA if torch sees it), cpu, cuda
                                # or cuda:N; one the machine lacks is a configuration error


@dataclass(frozen=True)
class CheckpointSection:
    keep: str = "all"               # all | last: keep every checkpoint or only the last


@dataclass(frozen=True)
class ExportSection:
    """ONNX export of the final global model into RUN_DIR/export/ (docs/export.md)."""

    enabled: bool = True            # after the last round; skipped with a warning without the export extra.
                                # Exports the final global model to RUN_DIR/export/model.onnx with its model card,
                                # parity-checked; none for a method with no global model


@dataclass(frozen=True)
class SimSection:
    """How this process runs the clients it spawns with the inproc transport (coordinator/runtime/simulation.py)."""

    workers: int = 0                # tasks run on this many workers; 0: one per core; -1: a thread per client;
                                # each worker with cores / workers torch threads, through the device's client code; -1
                                # runs them as separate devices would


@dataclass(frozen=True)
class AggregateSection:
    """How results are combined when some clients may be wrong or hostile (coordinator/aggregation.py)."""

    rule: str = "mean"              # mean | median | trimmed_mean | clipped_mean:
                                # how the strategies that average (fedavg, fedprox and the methods docs/methods.md's
                                # compatibility table marks) combine updates: mean (sample-weighted), median or
                                # trimmed_mean (coordinate-wise), clipped_mean (each update scaled to at most the
                                # round's median norm); other strategies refuse another rule (docs/robustness.md)
    trim: float = DEFAULT_TRIM      # trimmed_mean: floor(trim x results) dropped at each end (0.2: 2 of 10),
                                # in [0, 0.5); 0.2 drops none of 4
    norm_bound: float = 0.0         # reject updates above this multiple of the round's median norm; 0: off;
                                # counted as norm_rejected
    # The order a streamed phase folds its results in: "arrival" (as they come; float64 sums then differ in
    # their last bits with thread and network timing) or "sorted" (by client id, whatever the timing: the same
    # bits as the unstreamed sum; benchmarks use it so that a cell can be re-run bit for bit). Streamed phases are
    # the mean of fedavg and fedprox, the server optimizers and central DP; sorted holds each result only until
    # every client before it has answered or failed, needs workers.count = 0 and run.mode = "sync", and changes
    # nothing under secure aggregation (exact integer sums).
    order: str = "arrival"


@dataclass(frozen=True)
class WorkersSection:
    """Aggregation workers (``fedge-coordinator worker``): processes sharing the devices' results through
    an MQTT 5 shared subscription, each checking and folding its share (docs/scale.md)."""

    count: int = 0                  # workers the coordinator waits for before round 1; 0: it takes every result itself;
                                # they take the devices' results through a shared subscription and send it partial
                                # sums (FedAvg and FedProx with the mean; needs transport.broker, codec.broadcast and
                                # results unchunked: docs/scale.md)
    group: str = "fedge-aggregators"   # the shared subscription's group name
    flush_timeout: float = 30.0     # seconds to wait for the workers' partial sums once a round's results are in;
                                # results a worker folded but never sent are then counted as worker_lost
    # The coordinator also takes the results that reach its own broker (devices on it, and sites without an
    # aggregator), while the workers, site aggregators on the sites' brokers, take their sites' (docs/sites.md).
    direct_results: bool = False


@dataclass(frozen=True)
class AsyncSection:
    """``[async]``: buffered asynchronous aggregation (``run.mode = "async"``, docs/async.md). Devices train
    without waiting for each other; every ``buffer_size`` results make the next model version."""

    concurrency: int = 0            # devices training at once; 0: clients.per_round
    buffer_size: int = 0            # results per model version (FedBuff's K); 0: half the concurrency (at least 1)
    # fedbuff: the sum of the deltas, each times its staleness discount, over the buffer's count (FedBuff as
    # published); normalized: sample-weighted and discounted, over the total weight (the discount cancels
    # when every result is equally stale)
    weighting: str = "fedbuff"
    max_staleness: int = 0          # results more versions behind than this are dropped (and counted); 0: none
    staleness_exponent: float = 0.5  # a result s versions behind is discounted by (1 + s) ** -staleness_exponent
    server_lr: float = 1.0          # FedBuff's server learning rate: scales the buffer's update before server_step
    # what a device gets whose next result is predicted (its recent seconds per local step x the steps x the
    # versions made per second lately) to come more than max_staleness versions behind, where it would be dropped
    # (docs/async.md, "Slow devices"); acts only with max_staleness > 0. shorten: a task capped at fewer local steps,
    # sized to arrive within max_staleness (rested as below if not even one step would); rest: no task while so
    # predicted, a probe task after every 4 x max_staleness versions of rest; send: its tasks as they are (and
    # its results dropped when late)
    slow: str = "shorten"

    def sizes(self, selected_per_round: int) -> tuple[int, int]:
        """(concurrency, buffer size) with the defaults resolved."""
        concurrency = self.concurrency or selected_per_round
        return concurrency, self.buffer_size or max(1, concurrency // 2)


@dataclass(frozen=True)
class SelectionSection:
    """``clients.selection = "profile"``: Oort-style selection from the devices' own reports
    (coordinator/runtime/profile_selection.py, docs/selection.md); ``availability`` and ``min_sessions`` also serve
    ``deadline``. ``random`` ignores the section."""

    explore: float = 0.9            # exploration share epsilon of round 1: the share of a draw given to devices never
                                # selected (Oort's 0.9); decays by explore_decay a round down to explore_min
    explore_decay: float = 0.98     # epsilon's factor per round (Oort's)
    explore_min: float = 0.2        # the floor epsilon decays to (Oort's; an explore below it is kept as is)
    alpha: float = 2.0              # system penalty (T/t)^alpha for a device whose estimated time t exceeds T
    preferred_seconds: float = 0.0  # T; 0: clients.round_timeout / 1.25, the deadline selection's margin
    staleness: float = 0.1          # weight of the bonus sqrt(staleness x ln(round) / L) for a device last selected in
                                # round L: devices not selected for a while come back
    cutoff: float = 0.95            # the places left after exploring go to a seeded draw, weighted by utility, among
                                # the devices whose utility is at least this times the last place's (Oort's); 1: the
                                # highest utilities exactly
    max_share: float = 2.0          # fairness bound: a device selected more than this many times the mean of the
                                # devices known is not exploited until the others catch up (0: no bound)
    availability: bool = True       # leave out a device expected to go offline before it would finish its task (its
                                # mean residual online session, from its presence history, below its task time);
                                # profile and deadline selection
    min_sessions: int = 2           # completed online sessions of a device before its remaining session is predicted
    memory_margin: float = 1.2      # a device's memory need times this must fit its memory
    max_temperature_c: float = 80.0  # a device reporting a hotter CPU (or throttling now) is rested
    min_battery_percent: float = 20.0  # a discharging device below this battery level is rested
    rest_rounds: int = 3            # rounds a hot or low-battery device rests before it may be selected again


PRIVACY_MODES = ("off", "central", "local")
SPENT_DEVICES = ("stop", "skip")   # privacy.spent_devices


@dataclass(frozen=True)
class PrivacySection:
    """``[privacy]``: differential privacy at the level of a device's whole update per round
    (coordinator/privacy.py, docs/privacy.md). Central: devices clip, the coordinator adds Gaussian noise to
    the sum once and keeps the privacy account. Local: devices clip and add the noise themselves, the
    coordinator keeps an account per device."""

    mode: str = "off"               # off | central | local.
                                # central: each device clips its whole update to clip_norm before encoding it, every
                                # update weighs the same, the coordinator adds Gaussian noise to the sum once and
                                # divides by the clients selected per round; rows get dp_epsilon, dp_clip_norm,
                                # dp_clipped_fraction. Needs clients.max_attempts = 1, clients.selection = "random",
                                # run.mode = "sync", aggregate.rule = "mean" and norm_bound = 0, no run.diagnostics or
                                # eval.personalized, and a strategy that folds one update per device (fedavg, fedprox,
                                # the server optimizers; the others as docs/privacy.md lists). local, for fleets
                                # that do not trust the coordinator: each device clips its update and adds the noise
                                # itself, reporting no loss and no clipped bit; the coordinator averages the answers
                                # with equal weights and keeps an account per device; rows get dp_mode, dp_epsilon
                                # (the largest over devices), dp_max_participations. Refuses adaptive_clip,
                                # aggregate.rule = "clipped_mean", aggregate.norm_bound, run.mode = "async",
                                # eval.personalized and the strategies central refuses (docs/privacy.md)
    clip_norm: float = 1.0          # L2 bound on a device's whole update per round, > 0 (the starting bound with
                                # adaptive_clip)
    # z: central, the noise on the sum of updates has std z x clip_norm; local, the noise each device adds to
    # its clipped update has std z x clip_norm; z >= 0 (0: no noise, epsilon infinite). `fedge-coordinator privacy
    # --epsilon E --rounds R --per-round M --expected N` (central) or `--mode local --participations K` prints the
    # z that ends a run (a device) at E.
    noise_multiplier: float = 1.0
    delta: float = 1e-5             # the delta epsilon is reported at, in (0, 1); keep it well below
                                # 1 / clients.expected
    target_epsilon: float = 0.0     # > 0: stop before a round that would take epsilon past it; 0: no target;
                                # the run logs why; local: past it for the device with the most participations, were
                                # it drawn
    adaptive_clip: bool = False     # follow a quantile of the update norms (Andrew et al. 2021);
                                # central only: each device reports one bit, clipped or not
    target_quantile: float = 0.5    # share of updates meant to be within the clip norm, in (0, 1)
    clip_lr: float = 0.2            # step of the geometric update C <- C exp(-clip_lr (b - target_quantile)),
                                # b the noisy share of updates within C
    # Noise on the count of updates within the bound, as a multiplier of that count's sensitivity (1/2 per
    # device, the bits being centred); 0: clients per round / 10 (Andrew et al.'s count noise of m / 20). It spends
    # budget too: the account uses (z^-2 + z_count^-2)^(-1/2).
    count_noise_multiplier: float = 0.0
    # Central: how a round's devices are drawn, and so what the account may claim (coordinator/privacy_account.py).
    # "poisson" (what "" means): each device on its own with probability q = per_round / expected, from the OS's
    # entropy, rounds of any size (empty ones too); "fixed": exactly per_round of them, uniformly, from the OS's
    # entropy, accounted under replace-one; "seeded": per_round of them drawn from run.seed (reproducible, and
    # known to every device): no amplification, each device's rounds composed, the account the most-drawn
    # device's. Poisson rounds may be empty (released as noise); fixed needs sensitivity 2C and is what secure
    # aggregation needs (docs/privacy.md, "How rounds are drawn and what the account claims").
    sampling: str = ""
    # The dp_accounting accountant the account and the calibration use: "pld" (privacy loss distributions,
    # tighter) or "rdp" (Renyi DP); rows carry dp_accountant.
    accountant: str = DEFAULT_ACCOUNTANT
    # Local, with target_epsilon: "stop" ends the run before a round in which the most-used device, if drawn,
    # would pass the target; "skip" draws only devices with room for one more round and stops when fewer than
    # a round's results have room.
    spent_devices: str = "stop"
    # Central: run even where the noise on the mean, z / per_round x the clip norm, is at or above 0.1 x the clip
    # norm, where it swamps the update (coordinator/privacy_noise.py); the run refuses it otherwise, before round 1,
    # and warns from 0.02 (docs/privacy.md, "How much noise a fleet can take").
    allow_swamping_noise: bool = False


@dataclass(frozen=True)
class SecAggSection:
    """``[secagg]``: secure aggregation (SecAgg+) of each training round (coordinator/runtime/secure_round.py,
    docs/privacy.md): the coordinator learns the sum of the round's updates and who dropped, not one update."""

    enabled: bool = False           # every training round aggregated securely
    degree: int = 0                 # neighbours per device; 0: about 2 log2 n (graph.suggested_degree)
    threshold: int = 0              # shares that recover a device's secrets; 0: degree // 2 + 1 (at least 2)
    clip: float = 1.0               # each weighted update entry is clipped to [-clip, clip]; privacy.clip_norm under DP
    bits: int = 32                  # the sum is taken mod 2^bits (32: 4 bytes a word; up to 64)
    stage_timeout: float = 60.0     # seconds each of the share, mask and unmask exchanges waits for answers

    def degree_and_threshold(self, num_clients: int) -> tuple[int, int]:
        """The graph's degree and the shares' threshold for a cohort of ``num_clients``: the configured ones, or the
        suggested degree and a majority of each device's neighbours. More than ``threshold`` devices must advertise."""
        from edge_client.secagg.graph import suggested_degree   # secure aggregation's modules load only when used

        degree = self.degree or suggested_degree(num_clients)
        k = min(degree, num_clients - 1)
        return degree, self.threshold or max(2, k // 2 + 1)


@dataclass(frozen=True)
class MetricsSection:
    """``[metrics]``: a Prometheus endpoint for the run, up while it runs (coordinator/telemetry.py,
    docs/monitoring.md). Off unless asked for, and bound to this machine unless ``host`` says otherwise."""

    enabled: bool = False           # serve /metrics while the run runs (also --metrics-port), at
                                # http://host:port/metrics; needs prometheus-client, in the coordinator extra
                                # (docs/monitoring.md)
    port: int = 9464                # 0: a free port, said at start and written to coordinator.log
    host: str = "127.0.0.1"         # the address to bind: "0.0.0.0" for a Prometheus on another machine; this
                                # machine only by default

    @staticmethod
    def missing_library() -> str:
        """What to install for metrics ("" when prometheus-client is there): checked with the configuration,
        so a run asked for metrics stops before it starts rather than once devices wait."""
        if importlib.util.find_spec("prometheus_client") is None:
            return ("metrics need the prometheus-client package: pip install prometheus-client (it comes with "
                    "pip install 'fedge[coordinator]'), or turn metrics off")
        return ""
