"""What a strategy is: it plans each round's tasks and combines the results.

Strategies never touch the network. The round engine hands them the clients it
sampled and the decoded results; they hand back task plans and a new server state.
Aggregation is an associative reduce of (weighted sum, total weight), so results
can be folded in one at a time, in any grouping, with the same answer. The server
state itself is a plain value of its own (:class:`storage.state.ServerState`), so the
checkpoint and the export read it without this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from edge_client.app import Samples, evaluate_metrics, spec_app
from edge_client.objectives import evaluate as evaluate_model
from coordinator.strategies.server import PlainStep, ServerOptimizer
from edge_client.registry import METHODS, Capabilities
from storage.state import ServerState
from storage.errors import FedgeError

__all__ = ["TaskPlan", "ClientResult", "WeightedSum", "RowWeightedSum", "Strategy", "AggregationError",
           "PersonalizedEval", "summarize_personalized"]


class AggregationError(FedgeError, ValueError):
    """Results that cannot be combined (no weight, mismatched tensors)."""


@dataclass(frozen=True)
class TaskPlan:
    """What one selected client is asked to do this round."""

    client_id: str
    objective: str
    hyper: dict[str, Any]
    down: dict[str, torch.Tensor]     # tensors sent to the client
    up: list[str]                     # names of the tensors the client must send back
    # Shapes of what comes back when it is not model parameters (e.g. statistics);
    # None: the model's own shapes for the names in ``up``.
    expect: dict[str, tuple[int, ...]] | None = None
    # "delta": parameters sent down come back as differences (compact with lossy codecs), in
    # ClientResult.deltas; "raw": as values, dense, in ClientResult.tensors (e.g. layers a
    # method matches as they are).
    update: str = "delta"
    # The upload codec for this task instead of the run's ``codec.up``: statistics that
    # must arrive exactly (e.g. "fp64" for a calibration's sums of feature products).
    # None: ``codec.up``.
    codec: str | None = None
    # The network this client builds for the task when it is not the global one (a method
    # whose clients hold layers of their own widths while layers are matched one by one).
    # None: the state's spec.
    model: dict[str, Any] | None = None
    # Differential privacy (docs/privacy.md): the L2 norm the device clips its whole update to before
    # encoding it, and (central DP) the coordinator holds the decoded update to. None: no clipping.
    clip_norm: float | None = None
    # A stage of a secure round (the task body's ``secagg`` object, edge_client/secagg/stages.py); set by
    # coordinator/runtime/secure_round.py, never by a strategy. None: an ordinary task.
    secagg: dict[str, Any] | None = None
    # Local differential privacy: the device adds N(0, (noise_multiplier x clip_norm)^2) per coordinate to
    # its clipped update; the coordinator then neither clips it again nor adds noise. None: no device noise.
    noise_multiplier: float | None = None


@dataclass(frozen=True)
class ClientResult:
    """One client's decoded, checked answer.

    The parameters a task sent come back as ``deltas`` (trained minus sent, as the device computed
    them): strategies average updates and a server optimizer steps on them. Everything else
    (statistics, parameters the task did not send, tasks that asked for ``update = "raw"``) is in
    ``tensors`` as values. ``sent`` is what the task sent, for :meth:`values`.
    """

    client_id: str
    num_samples: int
    tensors: dict[str, torch.Tensor]
    metrics: dict[str, Any] = field(default_factory=dict)
    deltas: dict[str, torch.Tensor] = field(default_factory=dict)
    sent: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def values(self) -> dict[str, torch.Tensor]:
        """Every tensor as a value: what was sent plus its difference (float32), the rest as it came."""
        return {**self.tensors, **{k: self.sent[k].to(torch.float32) + d for k, d in self.deltas.items()}}


@dataclass(frozen=True)
class WeightedSum:
    """A partial aggregate: sum of weight * tensor (float64) and the divisor of its mean.

    The divisor is the total weight (a weighted mean) unless the parts were given another share of it
    (:meth:`of`); either way parts add up associatively.
    """

    sums: dict[str, torch.Tensor]
    weight: float     # the divisor of :meth:`mean`: the total weight, or the total of the shares given

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor], weight: float, share: float | None = None) -> "WeightedSum":
        """``weight * tensors``, adding ``share`` (``weight`` unless given) to the divisor of :meth:`mean`.

        A weighted mean counts each part by its weight in both places. A rule that scales each part but
        divides by how many there are, as FedBuff's buffer does (coordinator/runtime/async_buffer.py),
        gives every part share 1: the mean is then the scaled sum over the count.
        """
        share = weight if share is None else share
        if not weight > 0:
            raise AggregationError(f"a result needs a positive weight, got {weight}")
        if not share > 0:
            raise AggregationError(f"a result needs a positive share of the divisor, got {share}")
        return cls({k: v.to(torch.float64) * weight for k, v in tensors.items()}, float(share))

    def __add__(self, other: "WeightedSum") -> "WeightedSum":
        if self.sums.keys() != other.sums.keys():
            raise AggregationError("cannot add partial aggregates over different tensors")
        return WeightedSum({k: v + other.sums[k] for k, v in self.sums.items()}, self.weight + other.weight)

    def mean(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        return {k: (v / self.weight).to(dtype) for k, v in self.sums.items()}

    @staticmethod
    def reduce(parts: Iterable["WeightedSum"]) -> "WeightedSum":
        return _sum(parts)


@dataclass(frozen=True)
class RowWeightedSum:
    """A partial aggregate in which every row (dimension 0) of a tensor has its own weight.

    What methods need when a client's say differs by part of a layer: a method whose
    upper layers are split into groups of classes weights a group's rows by the client's
    samples of that group's classes, a per-class last layer weights row ``c`` by class
    ``c``'s count (docs/methods.md). Rows no client gave weight keep their previous value
    (:meth:`mean`). Associative like :class:`WeightedSum`.
    """

    sums: dict[str, torch.Tensor]       # sum of row weight * tensor (float64)
    weights: dict[str, torch.Tensor]    # sum of row weights, one per row (float64)

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor], row_weights: Mapping[str, torch.Tensor]) -> "RowWeightedSum":
        weights = {k: row_weights[k].to(torch.float64) for k in tensors}
        if any(bool((w < 0).any()) or len(w) != tensors[k].shape[0] for k, w in weights.items()):
            raise AggregationError("row weights must be >= 0, one per row of each tensor")
        return cls({k: v.to(torch.float64) * _rows(weights[k], v) for k, v in tensors.items()}, weights)

    def __add__(self, other: "RowWeightedSum") -> "RowWeightedSum":
        if self.sums.keys() != other.sums.keys():
            raise AggregationError("cannot add partial aggregates over different tensors")
        return RowWeightedSum({k: v + other.sums[k] for k, v in self.sums.items()},
                              {k: v + other.weights[k] for k, v in self.weights.items()})

    def mean(self, previous: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The weighted mean of every row with weight, ``previous`` for rows without."""
        out = {}
        for k, total in self.sums.items():
            w = _rows(self.weights[k], total)
            out[k] = torch.where(w > 0, total / w.clamp_min(1e-300), previous[k].to(torch.float64)).to(dtype)
        return out

    @staticmethod
    def reduce(parts: Iterable["RowWeightedSum"]) -> "RowWeightedSum":
        return _sum(parts)


def _sum(parts: Iterable[Any]) -> Any:
    """Partial aggregates added up in the order given (any grouping gives the same answer)."""
    total = None
    for part in parts:
        total = part if total is None else total + part
    if total is None:
        raise AggregationError("nothing to aggregate")
    return total


def _rows(weights: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-row weights shaped to broadcast over a tensor's other dimensions."""
    return weights.view(-1, *([1] * (like.dim() - 1)))


@dataclass(frozen=True)
class PersonalizedEval:
    """Ask every online client how the global model does on its own held-out split."""

    every: int = 1
    finetune_epochs: int = 0
    train: dict[str, Any] = field(default_factory=dict)   # local hyperparameters for fine-tuning


def summarize_personalized(results: list[ClientResult], key: str = "local_accuracy",
                           prefix: str = "personalized") -> dict[str, Any]:
    """Mean, minimum and spread of the clients' local accuracies (metric ``key``), as ``PREFIX_accuracy_*``."""
    accs = torch.tensor([float(r.metrics.get(key, float("nan"))) for r in results], dtype=torch.float64)
    accs = accs[torch.isfinite(accs)]
    if len(accs) == 0:
        return {}
    return {f"{prefix}_accuracy_mean": float(accs.mean()), f"{prefix}_accuracy_min": float(accs.min()),
            f"{prefix}_accuracy_std": float(accs.std(unbiased=False)), f"{prefix}_clients": len(accs)}


class Strategy:
    """Base class: FedAvg-shaped defaults that concrete strategies override in part.

    Every strategy gets the optional personalized-evaluation phase for free: set
    ``personalized`` (the registry does it from the ``[eval]`` config section).
    """

    name = "base"
    personalized: PersonalizedEval | None = None
    # round -> the factor on every training task's lr ([schedule], set by make_strategy); None: 1 in every round
    lr_factor: Callable[[int], float] | None = None
    # What it can run with: its registry entry's declaration (edge_client.registry.Capabilities), the one source
    # the configuration's checks read too; a subclass that names a registered method takes that method's, and
    # coordinator.strategy_setup sets an instance's under the configured settings.
    capabilities: Capabilities = Capabilities()
    # [server] optimizer: the step a round's combined update takes (set by coordinator/strategy_setup.py); only a
    # strategy that ``aggregates_deltas`` calls :meth:`server_step`.
    optimizer: ServerOptimizer = PlainStep()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        entry = METHODS.get(cls.__dict__.get("name", ""))
        if entry is not None and entry.strategy:
            cls.capabilities = entry.capabilities

    def server_step(self, round: int, state: ServerState, update: dict[str, torch.Tensor]) -> ServerState:
        """The state after the round's combined update (float64, by tensor name): the server optimizer's
        step (:mod:`coordinator.strategies.server`; FedAvg's adds it)."""
        return self.optimizer.step(round, state, update)

    def model_spec(self, spec: dict[str, Any]) -> dict[str, Any]:
        """The network every party builds, from the configured one (``[model]`` plus the data's
        shape); a method whose clients run another architecture around it (branches of their own
        beside the shared one) wraps it here."""
        return spec

    def initialize(self, spec: dict[str, Any], params: dict[str, torch.Tensor]) -> ServerState:
        """The state before round 1: the network ``spec`` builds and its freshly initialized ``params``."""
        return ServerState(round=0, params=params, spec=spec)

    def phases(self, round: int, last: bool) -> list[str]:
        """The exchanges of a round, in order; a strategy may add e.g. a calibration phase."""
        p = self.personalized
        return ["train", "evaluate"] if p is not None and (last or round % p.every == 0) else ["train"]

    def selects_all(self, phase: str) -> bool:
        """True when a phase goes to every online client instead of the round's sample."""
        return phase == "evaluate"

    def configure(self, phase: str, round: int, state: ServerState, clients: list[str]) -> list[TaskPlan]:
        if phase == "train":
            return self.scheduled(round, self.configure_train(round, state, clients))
        if phase == "evaluate":
            return self.configure_evaluate(round, state, clients)
        raise NotImplementedError(f"{self.name} has no phase {phase!r}")

    def scheduled(self, round: int, plans: list[TaskPlan]) -> list[TaskPlan]:
        """``plans`` with their learning rate scaled by ``[schedule]``'s factor for ``round``: every task that
        carries an ``lr``, so a method's own rates (a retraining pass at a tenth) keep their ratio to it."""
        factor = 1.0 if self.lr_factor is None else self.lr_factor(round)
        if factor == 1.0:
            return plans
        return [dataclasses.replace(p, hyper={**p.hyper, "lr": float(p.hyper["lr"]) * factor}) if "lr" in p.hyper
                else p for p in plans]

    def streams(self, phase: str) -> bool:
        """Whether this phase's results can be folded into a partial aggregate as they arrive
        (:meth:`fold`), so the engine drops each result's tensors at once and a round's memory
        is that of one model, however many clients answer. Methods that need every result at
        once (matching the clients' neurons, coordinate-wise medians) keep the default, False."""
        return False

    def fold(self, phase: str, partial: Any, result: ClientResult) -> Any:
        """``partial`` (None for the first result) with ``result`` folded in; only where :meth:`streams`.

        The fold must be an associative reduce, so that arrival order changes the aggregate only
        by floating-point rounding (float64 sums: far below float32's resolution)."""
        raise NotImplementedError(f"{self.name} does not stream its {phase!r} results")

    def aggregate(self, phase: str, round: int, state: ServerState, results: list[ClientResult],
                  partial: Any = None) -> tuple[ServerState, dict[str, Any]]:
        """New state plus any metrics the phase adds to the round's row.

        With ``partial`` (a streamed phase) the results' tensors are already folded into it and
        ``results`` carry only their client ids, sample counts and metrics."""
        if phase == "train":
            if partial is not None:
                return self.aggregate_train(round, state, results, partial), {}
            return self.aggregate_train(round, state, results), {}
        if phase == "evaluate":
            return state, summarize_personalized(results)
        raise NotImplementedError(f"{self.name} has no phase {phase!r}")

    def configure_evaluate(self, round: int, state: ServerState, clients: list[str]) -> list[TaskPlan]:
        """The global model to every client, evaluated (optionally after fine-tuning) on its local split."""
        p = self.personalized or PersonalizedEval()
        hyper = {"finetune_epochs": p.finetune_epochs, "train": p.train}
        return [TaskPlan(client_id=c, objective="evaluate", hyper=hyper, down=state.params, up=[], expect={})
                for c in clients]

    def check_result(self, plan: TaskPlan, result: ClientResult, spec: dict[str, Any]) -> str | None:
        """Why a decoded result cannot be used (its tensors are already checked), or None.

        The engine rejects such a result like a malformed message, before it reaches
        :meth:`aggregate`: a method that reads facts from the metrics checks them here.
        ``spec`` is the model spec of the network the task ran (``plan.model`` or the global one).
        """
        return None

    def evaluate(self, state: ServerState, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        """Metrics of the global model (already loaded with ``state.params``) on the test split.

        It runs on the coordinator's evaluation thread while the next round trains, so it must
        read only its arguments (a snapshot of the round's state and a model of its own)."""
        app = spec_app(state.spec)
        if app is not None:   # the app's loss and metrics, each a column test_NAME
            return {f"test_{k}": v for k, v in evaluate_metrics(app, model, Samples(x, y)).items()}
        loss, accuracy = evaluate_model(model, x, y)
        return {"test_accuracy": accuracy, "test_loss": loss}

    def stop_before(self, round: int, state: ServerState) -> str:
        """Why the run must end before ``round`` (a privacy budget spent, say), "" when it may go on."""
        return ""

    @property
    def counts_tasks(self) -> bool:
        """Whether :meth:`tasked` keeps an account that must see every training task sent, those of a round that
        never completed included (coordinator/runtime/task_journal.py)."""
        return False

    def not_drawn(self, state: ServerState) -> frozenset[str]:
        """Devices no exchange may draw now (their privacy budget spent, say), online or not."""
        return frozenset()

    def tasked(self, phase: str, state: ServerState, clients: frozenset[str]) -> ServerState:
        """The state once a phase's exchange is over, ``clients`` being every device given one of its tasks
        (in any attempt), before its aggregation: where a strategy counts who took part, such as local
        differential privacy's per-device account. A device that got a task may have sent its answer, on
        time or not, so it counts whether or not its result is aggregated."""
        return state

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Fields the strategy adds to ``summary.json`` from the run's metrics rows (e.g. its calibration)."""
        return {}

    def configure_train(self, round: int, state: ServerState, clients: list[str]) -> list[TaskPlan]:
        raise NotImplementedError

    def aggregate_train(self, round: int, state: ServerState, results: list[ClientResult]) -> ServerState:
        raise NotImplementedError
