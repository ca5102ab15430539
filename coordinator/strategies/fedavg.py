"""FedAvg (McMahan et al.) and FedProx (Li et al.): the baselines.

Both send the whole global model down and ask for the whole model back; FedProx
only adds the proximal weight ``mu`` to the clients' local objective.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from coordinator.aggregation import Aggregator
from coordinator.privacy import CentralPrivacy, LocalPrivacy
from coordinator.strategies.base import ClientResult, Strategy, TaskPlan, WeightedSum
from coordinator.strategies.server import ServerOptimizer
from coordinator.strategies.settings import FedProxSection
from storage.state import ServerState

if TYPE_CHECKING:
    from coordinator.config import RunConfig

__all__ = ["FedAvg", "OptimizerShorthand", "FedProx", "FedProxSection"]


class FedAvg(Strategy):
    name = "fedavg"
    objective = "train"     # the device objective its training tasks run
    aggregator = Aggregator()
    # [privacy] mode = "central" or "local" (coordinator/strategy_setup.py)
    privacy: CentralPrivacy | LocalPrivacy | None = None

    def __init__(self, train: dict[str, Any]) -> None:
        self.train = dict(train)

    @classmethod
    def from_config(cls, config: RunConfig) -> "FedAvg":
        return cls(dataclasses.asdict(config.train))

    def hyper(self) -> dict[str, Any]:
        return dict(self.train)

    def configure_train(self, round: int, state: ServerState, clients: list[str]) -> list[TaskPlan]:
        names = sorted(state.params)
        clip, noise = (None, None) if self.privacy is None else self.privacy.upload(state)
        return [TaskPlan(client_id=c, objective=self.objective, hyper=self.hyper(), down=state.params, up=names,
                         clip_norm=clip, noise_multiplier=noise) for c in clients]

    def streams(self, phase: str) -> bool:
        """The mean streams; so does a subclass whose ``aggregate_train`` takes the partial (one written
        without it gets every result, as before)."""
        return (phase == "train" and self.aggregator.streams
                and "partial" in inspect.signature(self.aggregate_train).parameters)

    def fold(self, phase: str, partial: WeightedSum | None, result: ClientResult) -> WeightedSum:
        part = WeightedSum.of(result.deltas, self._weight(result))
        return part if partial is None else partial + part

    def _weight(self, result: ClientResult) -> float:
        """A result's weight in the mean: its sample count, or 1 under differential privacy, where a device's say
        must not grow with what it claims (the noise is calibrated to one clipped update per device; under local DP
        the coordinator no longer clips, and equal weights are what keep a device's say to 1 / answers)."""
        return 1.0 if self.privacy is not None else result.num_samples

    def aggregate(self, phase: str, round: int, state: ServerState, results: list[ClientResult],
                  partial: WeightedSum | None = None) -> tuple[ServerState, dict[str, Any]]:
        """Under central DP, training's folded sum becomes the noisy mean over the devices selected
        (:meth:`CentralPrivacy.release`), then the server's step, with the row's ``dp_*`` columns. Under local DP
        the noisy updates are combined by ``aggregate.rule`` with equal weights (the plain mean of the answers by
        default; no clipping, no noise here), then the server's step, with the row's ``dp_*`` columns.
        Otherwise :meth:`aggregate_train`."""
        if phase != "train" or self.privacy is None:
            return super().aggregate(phase, round, state, results, partial)
        if isinstance(self.privacy, LocalPrivacy):
            update = (partial.mean(torch.float64) if partial is not None
                      else self.aggregator.combine([(r.deltas, 1.0) for r in results]))
            return self.server_step(round, state, update), self.privacy.row(state)
        if partial is not None:
            total = partial
        elif results:
            total = WeightedSum.reduce(WeightedSum.of(r.deltas, 1.0) for r in results)
        else:   # a Poisson-sampled round that drew nobody, or heard from nobody: the release is noise alone
            names = self.configure_train(round, state, ["-"])[0].up   # the tensors a training task sends back
            total = WeightedSum({n: torch.zeros_like(state.params[n], dtype=torch.float64) for n in names}, 0.0)
        update, state, row = self.privacy.release(state, total, results)
        return self.server_step(round, state, update), row

    def check_result(self, plan: TaskPlan, result: ClientResult, spec: dict[str, Any]) -> str | None:
        if (plan.clip_norm is not None and plan.noise_multiplier is None
                and result.metrics.get("clipped") not in (0.0, 1.0)):
            return "a task with a clip norm needs metrics.clipped = 0 or 1 (whether the update was clipped)"
        return None

    def stop_before(self, round: int, state: ServerState) -> str:
        return "" if self.privacy is None else self.privacy.stop_before(state)

    @property
    def counts_tasks(self) -> bool:
        """Local DP, and central DP over a seeded draw, count every device given a training task (:meth:`tasked`)."""
        return isinstance(self.privacy, LocalPrivacy) or (isinstance(self.privacy, CentralPrivacy)
                                                          and self.privacy.account.per_device)

    def not_drawn(self, state: ServerState) -> frozenset[str]:
        """Under local DP with ``privacy.spent_devices = "skip"``, the devices whose budget is spent."""
        return self.privacy.spent(state) if isinstance(self.privacy, LocalPrivacy) else frozenset()

    def tasked(self, phase: str, state: ServerState, clients: frozenset[str]) -> ServerState:
        """Under local DP (and central DP over a seeded draw), one more participation for every device given a
        training task (docs/privacy.md)."""
        return self.privacy.took_part(state, clients) if phase == "train" and self.privacy is not None else state

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        if self.privacy is None:
            return {}
        last = next((r for r in reversed(rows) if "dp_epsilon" in r), {})
        out = {"dp_mode": self.privacy.mode,
               "dp_epsilon": last.get("dp_epsilon", 0.0), "dp_delta": self.privacy.delta,
               "dp_rounds": sum(1 for r in rows if "dp_epsilon" in r)}
        for key in ("dp_max_participations", "dp_sampling", "dp_spent_devices"):
            if key in last:
                out[key] = last[key]
        return out

    def aggregate_train(self, round: int, state: ServerState, results: list[ClientResult],
                        partial: WeightedSum | None = None) -> ServerState:
        """The clients' updates combined by ``aggregate.rule`` (FedAvg's sample-weighted mean by default),
        in the order given (the engine sorts), or the mean of the updates the engine streamed in; then
        the server's step on it (:meth:`server_step`)."""
        if partial is not None:
            update = partial.mean(torch.float64)
        else:
            update = self.aggregator.combine([(r.deltas, r.num_samples) for r in results])
        return self.server_step(round, state, update)


class OptimizerShorthand(FedAvg):
    """FedAvg with a named server optimizer: the strategies named after one (``run.strategy = NAME``), the
    same as ``run.strategy = "fedavg"`` with ``server.optimizer = NAME``."""

    step: ClassVar[type[ServerOptimizer]]

    def __init__(self, train: dict[str, Any], settings: Any) -> None:
        super().__init__(train)
        self.settings = settings
        self.optimizer = self.step(settings)

    @classmethod
    def from_config(cls, config: RunConfig) -> OptimizerShorthand:
        return cls(dataclasses.asdict(config.train), getattr(config, cls.step.section))


class FedProx(FedAvg):
    name = "fedprox"

    def __init__(self, train: dict[str, Any], mu: float) -> None:
        super().__init__(train)
        if mu < 0:
            raise ValueError(f"fedprox.mu must be >= 0, got {mu}")
        self.mu = mu

    @classmethod
    def from_config(cls, config: RunConfig) -> "FedProx":
        return cls(dataclasses.asdict(config.train), config.fedprox.mu)

    def hyper(self) -> dict[str, Any]:
        return {**self.train, "mu": self.mu}
