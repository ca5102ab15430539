"""SphereFed with Fast Federated Calibration (FFC): the coordinator's side.

Training is FedAvg on the feature extractor only (FedProx's proximal term with
``spherefed.mu``): the classifier of a ``head = "sphere"`` model is a fixed
orthonormal matrix that every party rebuilds from the model spec's
``sphere_seed``, so it is in no download and no upload. After the last round (and
every ``ffc.every`` rounds) an ``ffc`` phase asks every online client for the sums
G, B and n of its features (the ``ffc_stats`` objective, :mod:`methods.spherefed.device`).
Their sum gives the least-squares classifier, which replaces the fixed one in the
global model that the coordinator evaluates and checkpoints. The next training
round starts again from the fixed classifier: it is the one clients train against.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from coordinator.errors import ConfigError
from coordinator.strategies.base import ClientResult, TaskPlan, WeightedSum, summarize_personalized
from coordinator.strategies.fedavg import FedProx
from methods.spherefed.device import (STAT_NAMES, WIRE_CODECS, WIRE_DTYPES, FfcStats, sphere_accuracies,
                                        sphere_head, wire_numbers, wire_shapes)
from methods.spherefed.model import CLASSIFIER, SphereError, fixed_classifier, with_sphere_seed
from storage.state import ServerState

if TYPE_CHECKING:
    from coordinator.config import RunConfig

__all__ = ["SphereFed", "SphereFedSection", "FfcSection"]

log = logging.getLogger("fedge.coordinator")

# Fields of the last calibration that summary.json repeats.
_SUMMARY_KEYS = ("ffc_accuracy_before", "ffc_accuracy_after", "ffc_clients", "ffc_samples", "ffc_ridge",
                 "ffc_singular", "ffc_stats_numbers", "ffc_stats_dtype", "ffc_bytes_up", "ffc_coordinator_seconds",
                 "ffc_client_seconds_max", "ffc_personalized_accuracy_mean", "ffc_personalized_fixed_accuracy_mean")


@dataclass(frozen=True)
class SphereFedSection:
    """``[spherefed]``: local training of SphereFed (docs/spherefed.md)."""

    mu: float = 0.0                 # FedProx's proximal weight in local training (0: off)

    def checks(self, config: RunConfig) -> list[tuple[bool, str]]:
        return [(self.mu >= 0, "spherefed.mu must be >= 0")]


@dataclass(frozen=True)
class FfcSection:
    """``[ffc]``: SphereFed's Fast Federated Calibration of the classifier (docs/spherefed.md)."""

    enabled: bool = True            # calibrate after the last round
    every: int = 0                  # ... and every this many rounds (0: only after the last)
    ridge: float = 0.0              # lambda in W^T = (G + lambda I)^-1 B; a singular G falls back to a small one
    dtype: str = "float64"          # statistics on the wire: float64 (exact) or float32 (half the bytes)
    personalize: bool = False       # clients also solve their own classifier (kept in their state dir), scored locally

    def checks(self, config: RunConfig) -> list[tuple[bool, str]]:
        return [
            (self.every >= 0 and self.ridge >= 0, "ffc.every and ffc.ridge must be >= 0"),
            (self.enabled or self.every == 0, "ffc.every needs ffc.enabled = true"),
            (self.dtype in WIRE_DTYPES, "ffc.dtype must be float64 or float32"),
            (not self.personalize or config.data.local_test_fraction > 0 or config.clients.spawn == 0,
             "ffc.personalize needs data.local_test_fraction > 0 for spawned clients"),
        ]


class SphereFed(FedProx):
    name = "spherefed"
    sync_only = "its FFC calibration sums every client's feature statistics in a phase of its own"

    def __init__(self, train: dict[str, Any], *, mu: float = 0.0, sphere_seed: int = 0,
                 ffc: FfcSection = FfcSection(), broadcast: bool = True) -> None:
        super().__init__(train, mu)
        self.sphere_seed = sphere_seed
        self.ffc = ffc
        # Calibration ships each device's feature statistics, exactly: nothing the noise covers.
        self.central_dp = "its FFC calibration sends every device's feature statistics (set ffc.enabled = false)" \
            if ffc.enabled else ""
        self.broadcast = broadcast      # the download goes once per round as a broadcast, not per task
        self._fixed: torch.Tensor | None = None

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "SphereFed":
        return cls(dataclasses.asdict(cfg.train), mu=cfg.spherefed.mu, ffc=cfg.ffc, broadcast=cfg.codec.broadcast,
                   sphere_seed=with_sphere_seed(cfg.model, cfg.run.seed)["sphere_seed"])

    # -- the classifier ---------------------------------------------------------
    def fixed(self, state: ServerState) -> torch.Tensor:
        """The fixed classifier (float32), rebuilt from the seed like every client does."""
        classes, dim = state.params[CLASSIFIER].shape
        if self._fixed is None or tuple(self._fixed.shape) != (classes, dim):
            self._fixed = fixed_classifier(classes, dim, self.sphere_seed).to(torch.float32)
        return self._fixed

    def model_spec(self, spec: dict[str, Any]) -> dict[str, Any]:
        """The configured network with the seed of its fixed classifier: every party rebuilds the same one."""
        return with_sphere_seed(spec, self.sphere_seed)

    @staticmethod
    def extractor(state: ServerState) -> dict[str, torch.Tensor]:
        """What travels: everything but the classifier."""
        return {k: v for k, v in state.params.items() if k != CLASSIFIER}

    def initialize(self, spec: dict[str, Any], params: dict[str, torch.Tensor]) -> ServerState:
        state = ServerState(round=0, params=params, spec=spec)
        if CLASSIFIER not in params:
            raise ConfigError('spherefed needs a model with head = "sphere" (its state has no classifier.weight)')
        if not torch.equal(params[CLASSIFIER], self.fixed(state)):
            raise ConfigError(f"the model's sphere classifier was not built from sphere_seed {self.sphere_seed}; "
                              "build the network from the spec this strategy's model_spec returns, which "
                              "carries the seed")
        return state

    # -- phases -----------------------------------------------------------------
    def calibrates(self, round: int, last: bool) -> bool:
        return self.ffc.enabled and (last or (self.ffc.every > 0 and round % self.ffc.every == 0))

    def phases(self, round: int, last: bool) -> list[str]:
        phases = super().phases(round, last)   # train, and evaluate when personalized evaluation is due
        return [phases[0], "ffc", *phases[1:]] if self.calibrates(round, last) else phases

    def selects_all(self, phase: str) -> bool:
        return phase == "ffc" or super().selects_all(phase)

    def configure_train(self, round: int, state: ServerState, clients: list[str]) -> list[TaskPlan]:
        down = self.extractor(state)
        return [TaskPlan(client_id=c, objective="sphere_train", hyper=self.hyper(), down=down, up=sorted(down))
                for c in clients]

    def configure(self, phase: str, round: int, state: ServerState, clients: list[str]) -> list[TaskPlan]:
        if phase != "ffc":
            return super().configure(phase, round, state, clients)
        classes, dim = state.params[CLASSIFIER].shape
        hyper = {"dtype": self.ffc.dtype, "personalize": self.ffc.personalize, "ridge": self.ffc.ridge}
        down = self.extractor(state)
        return [TaskPlan(client_id=c, objective="ffc_stats", hyper=hyper, down=down, up=list(STAT_NAMES),
                         expect=wire_shapes(dim, classes), codec=WIRE_CODECS[self.ffc.dtype]) for c in clients]

    # -- aggregation ------------------------------------------------------------
    def aggregate(self, phase: str, round: int, state: ServerState, results: list[ClientResult],
                  partial: Any = None) -> tuple[ServerState, dict[str, Any]]:
        if phase == "ffc":
            return self.aggregate_ffc(round, state, results)
        new, metrics = super().aggregate(phase, round, state, results, partial)
        if phase == "train":
            metrics = {**metrics, "classifier_bytes_saved": self.classifier_bytes_saved(state, len(results))}
        return new, metrics

    def classifier_bytes_saved(self, state: ServerState, returned: int) -> int:
        """Float32 bytes of the classifier this round did not move: once down (per task without the
        broadcast) and once up per result."""
        nbytes = 4 * state.params[CLASSIFIER].numel()
        return nbytes * ((1 if self.broadcast else returned) + returned)

    def aggregate_train(self, round: int, state: ServerState, results: list[ClientResult],
                        partial: WeightedSum | None = None) -> ServerState:
        """FedAvg of the extractors; the classifier is the fixed one again, the one clients trained against."""
        new = super().aggregate_train(round, state, results, partial)
        return dataclasses.replace(new, params={**new.params, CLASSIFIER: self.fixed(state)})

    def aggregate_ffc(self, round: int, state: ServerState,
                      results: list[ClientResult]) -> tuple[ServerState, dict[str, Any]]:
        """Sum the clients' statistics (in the engine's fixed order) and solve the least-squares classifier."""
        classes, dim = state.params[CLASSIFIER].shape
        started = time.perf_counter()
        parts = []
        for r in results:
            try:
                stats = FfcStats.from_wire(r.tensors, dim, classes)
                if stats.count != r.num_samples:
                    raise SphereError(f"ffc.count is {stats.count} but num_samples is {r.num_samples}")
                parts.append(stats)
            except SphereError as exc:   # counted and logged; the others still calibrate
                log.warning("round %d: discarded the FFC statistics of %s: %s", round, r.client_id, exc)
        numbers = wire_numbers(dim, classes)
        metrics: dict[str, Any] = {"ffc_clients": len(parts), "ffc_discarded": len(results) - len(parts),
                                   "ffc_stats_numbers": numbers, "ffc_stats_dtype": self.ffc.dtype,
                                   "ffc_stats_tensor_bytes": numbers * WIRE_DTYPES[self.ffc.dtype].itemsize}
        if not parts:
            log.error("round %d: no usable FFC statistics; the classifier stays the fixed one", round)
            return state, metrics
        total = FfcStats.reduce(parts)
        try:
            calibration = total.solve(self.ffc.ridge, precision=WIRE_DTYPES[self.ffc.dtype])
        except SphereError as exc:   # sums that are no Gram matrix (a faulty client): keep the fixed classifier
            log.error("round %d: FFC failed, the classifier stays the fixed one: %s", round, exc)
            return state, {**metrics, "ffc_failed": str(exc)}
        seconds = time.perf_counter() - started
        client_seconds = [float(r.metrics["ffc_seconds"]) for r in results if "ffc_seconds" in r.metrics]
        metrics.update({
            "ffc_samples": total.count, "ffc_ridge": calibration.ridge, "ffc_singular": calibration.singular,
            "ffc_rank": calibration.rank, "ffc_coordinator_seconds": seconds,
            "ffc_client_seconds_mean": statistics.fmean(client_seconds) if client_seconds else None,
            "ffc_client_seconds_max": max(client_seconds, default=None),
            **summarize_personalized(results, "ffc_local_accuracy", "ffc_personalized"),
            **summarize_personalized(results, "ffc_local_accuracy_fixed", "ffc_personalized_fixed"),
        })
        log.info("round %d: FFC calibrated the classifier from %d clients (%d samples), ridge %.3g, in %.3f s",
                 round, len(parts), total.count, calibration.ridge, seconds)
        params = {**state.params, CLASSIFIER: calibration.weight.to(torch.float32)}
        return dataclasses.replace(state, params=params, extra={**state.extra, "ffc_round": round}), metrics

    # -- evaluation -------------------------------------------------------------
    def evaluate(self, state: ServerState, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        """Test metrics of the global model; after a calibration, also the fixed classifier's accuracy."""
        metrics = super().evaluate(state, model, x, y)
        if state.round > 0 and state.extra.get("ffc_round") == state.round:
            (before,) = sphere_accuracies(model, x, y, [sphere_head(model).fixed])
            metrics.update(ffc_accuracy_before=before, ffc_accuracy_after=metrics["test_accuracy"])
        return metrics

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """The classifier bytes saved over the run and the last calibration's figures."""
        out: dict[str, Any] = {"classifier_bytes_saved": sum(r.get("classifier_bytes_saved", 0) for r in rows)}
        calibrated = [r for r in rows if "ffc_accuracy_after" in r]
        if calibrated:
            last = calibrated[-1]
            out.update({"ffc_round": last["round"], **{k: last[k] for k in _SUMMARY_KEYS if k in last}})
        return out
