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

FedAvg + FFC (:class:`FedAvgFfc`, ``run.strategy = "fedavg_ffc"``) is the same calibration
after plain FedAvg with a cross-entropy model and its trained linear head: the control that
separates what SphereFed's fixed head does from what a calibration on every client does.
Both strategies take the ``ffc`` phase from :class:`FfcPhase`.

Under central DP (``privacy.mode = "central"``) the pass is private too: each device scales its
statistics to the L2 bound ``ffc.clip``, the coordinator holds each to it again, adds Gaussian
noise of std ``ffc.noise_multiplier`` x that bound to the sums once, raises the noisy Gram
matrix's eigenvalues to the noise's scale and solves; the pass is composed into the run's
account (:meth:`coordinator.privacy.CentralPrivacy.release_sum`, docs/privacy.md).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from coordinator.errors import ConfigError
from coordinator.privacy import CentralPrivacy, release_epsilon
from coordinator.strategies.base import ClientResult, TaskPlan, WeightedSum, summarize_personalized
from coordinator.strategies.fedavg import FedAvg, FedProx
from methods.spherefed.device import (BOUNDED_NAMES, STAT_NAMES, WIRE_CODECS, WIRE_DTYPES, FfcStats, clip_stats,
                                      floor_eigenvalues, noise_floor, solve_classifier,
                                      sphere_accuracies, sphere_head, unpack_upper, wire_numbers, wire_shapes)
from methods.spherefed.model import CLASSIFIER, SphereError, fixed_classifier, with_sphere_seed
from methods.spherefed.settings import FEDAVG_FFC, FfcSection, SphereFedSection, planned_passes
from storage.state import ServerState

if TYPE_CHECKING:
    from coordinator.config import RunConfig

__all__ = ["SphereFed", "FedAvgFfc", "FfcPhase", "SphereFedSection", "FfcSection"]

log = logging.getLogger("fedge.coordinator")

# Fields of the last calibration that summary.json repeats.
# The extra pass's participations and bytes are there too: a comparison with a strategy without it must count them.
_SUMMARY_KEYS = ("ffc_accuracy_before", "ffc_accuracy_after", "ffc_clients", "ffc_samples", "ffc_ridge",
                 "ffc_singular", "ffc_stats_numbers", "ffc_stats_dtype", "ffc_selected", "ffc_returned",
                 "ffc_bytes_down", "ffc_bytes_up", "ffc_coordinator_seconds",
                 "ffc_client_seconds_max", "ffc_personalized_accuracy_mean", "ffc_personalized_fixed_accuracy_mean")


# The trained linear head FedAvg + FFC replaces, kept (never sent, never exported) to score it in the same round.
TRAINED_HEAD = "ffc.trained_head."


class FfcPhase:
    """The ``ffc`` phase, for a FedAvg-based strategy whose model ends in ``classifier.weight`` (C x d).

    After the last round (and every ``ffc.every``-th) every online client receives the
    extractor and answers with the sums of its unit features (``ffc_stats``); the coordinator
    sums them and solves the least-squares classifier. A strategy says what goes down
    (:meth:`ffc_down`) and how the solved classifier enters its state (:meth:`calibrated`).
    Put it before the FedAvg class in the bases, so its phase methods come first.
    """

    ffc: FfcSection
    rounds: int = 0    # run.rounds (0: unknown, then one pass is assumed still to come)

    def calibrates(self, round: int, last: bool) -> bool:
        return self.ffc.enabled and (last or (self.ffc.every > 0 and round % self.ffc.every == 0))

    def phases(self, round: int, last: bool) -> list[str]:
        phases = super().phases(round, last)   # type: ignore[misc]  # train, and evaluate when due
        return [phases[0], "ffc", *phases[1:]] if self.calibrates(round, last) else phases

    def selects_all(self, phase: str) -> bool:
        return phase == "ffc" or super().selects_all(phase)   # type: ignore[misc]

    @staticmethod
    def ffc_down(state: ServerState) -> dict[str, torch.Tensor]:
        """What an ffc task sends: the extractor, everything but the classifier (its features are all FFC reads)."""
        return {k: v for k, v in state.params.items() if not k.startswith("classifier.")}

    def calibrated(self, state: ServerState, weight: torch.Tensor, round: int) -> ServerState:
        """The state with the solved classifier (float64, C x d) in place of the model's own."""
        raise NotImplementedError

    def configure(self, phase: str, round: int, state: ServerState, clients: list[str]) -> list[TaskPlan]:
        if phase != "ffc":
            return super().configure(phase, round, state, clients)   # type: ignore[misc]
        classes, dim = state.params[CLASSIFIER].shape
        hyper: dict[str, Any] = {"dtype": self.ffc.dtype, "personalize": self.ffc.personalize, "ridge": self.ffc.ridge}
        central = self.central_privacy()
        if central is not None:
            hyper["clip"] = self.ffc.clip
        down = self.ffc_down(state)
        return [TaskPlan(client_id=c, objective="ffc_stats", hyper=hyper, down=down, up=list(STAT_NAMES),
                         expect=wire_shapes(dim, classes), codec=WIRE_CODECS[self.ffc.dtype]) for c in clients]

    def central_privacy(self) -> CentralPrivacy | None:
        """The run's central DP (set on the FedAvg base by the strategy setup), None without it."""
        privacy = getattr(self, "privacy", None)
        return privacy if isinstance(privacy, CentralPrivacy) else None

    def stop_before(self, round: int, state: ServerState) -> str:
        """Under central DP with a target epsilon, the check before each round counts in the FFC passes
        still to come (the last round's included), not only the round's training."""
        central = self.central_privacy()
        if central is None or not self.ffc.enabled:
            return super().stop_before(round, state)   # type: ignore[misc]
        last = self.rounds if self.rounds >= round else round
        return central.stop_before(state, [self.ffc.noise_multiplier] * max(planned_passes(self.ffc, round, last), 1))

    def aggregate_ffc(self, round: int, state: ServerState,
                      results: list[ClientResult]) -> tuple[ServerState, dict[str, Any]]:
        """Sum the clients' statistics (in the engine's fixed order) and solve the least-squares classifier;
        under central DP, each held to the bound and the sums noised first (:meth:`_private_sums`)."""
        classes, dim = state.params[CLASSIFIER].shape
        started = time.perf_counter()
        parts, kept = [], []
        for r in results:
            try:
                stats = FfcStats.from_wire(r.tensors, dim, classes)
                if stats.count != r.num_samples:
                    raise SphereError(f"ffc.count is {stats.count} but num_samples is {r.num_samples}")
                parts.append(stats)
                kept.append(r)
            except SphereError as exc:   # counted and logged; the others still calibrate
                log.warning("round %d: discarded the FFC statistics of %s: %s", round, r.client_id, exc)
        numbers = wire_numbers(dim, classes)
        metrics: dict[str, Any] = {"ffc_clients": len(parts), "ffc_discarded": len(results) - len(parts),
                                   "ffc_stats_numbers": numbers, "ffc_stats_dtype": self.ffc.dtype,
                                   "ffc_stats_tensor_bytes": numbers * WIRE_DTYPES[self.ffc.dtype].itemsize}
        if not parts:
            log.error("round %d: no usable FFC statistics; the classifier stays the model's own", round)
            return state, metrics
        total = FfcStats.reduce(parts)
        central = self.central_privacy()
        gram = total.gram
        if central is not None:
            total, state, dp_row, floor = self._private_sums(state, kept, total.count, dim)
            gram = floor_eigenvalues(total.gram, floor) if floor > 0 else total.gram
            metrics.update({**dp_row, "dp_ffc_eigenvalue_floor": floor})
        try:
            calibration = solve_classifier(gram, total.cross, self.ffc.ridge, precision=WIRE_DTYPES[self.ffc.dtype])
        except SphereError as exc:   # sums that are no Gram matrix (a faulty client): keep the model's classifier
            log.error("round %d: FFC failed, the classifier stays the model's own: %s", round, exc)
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
        new = self.calibrated(state, calibration.weight, round)
        return dataclasses.replace(new, extra={**new.extra, "ffc_round": round}), metrics

    def _private_sums(self, state: ServerState, results: list[ClientResult], count: int,
                      dim: int) -> tuple[FfcStats, ServerState, dict[str, Any], float]:
        """The private release of an FFC pass: each device's packed G and B held to ``ffc.clip`` again
        (it may not have scaled them, or a float32 rounding may have pushed them over), summed, noised once
        (:meth:`CentralPrivacy.release_sum`), G unpacked (mirrored, so symmetric); the state with the pass
        accounted, the row's ``dp_*`` columns, and the eigenvalue floor for the noisy G (0 without noise)."""
        central = self.central_privacy()
        assert central is not None
        sums: dict[str, torch.Tensor] = {}
        clipped = 0
        for r in results:
            bounded, was = clip_stats({k: r.tensors[k].to(torch.float64) for k in BOUNDED_NAMES}, self.ffc.clip)
            clipped += int(was or r.metrics.get("ffc_clipped", 0.0) == 1.0)
            for k, v in bounded.items():
                sums[k] = v if k not in sums else sums[k] + v
        z, bound = self.ffc.noise_multiplier, self.ffc.clip
        noisy, state, row = central.release_sum(state, sums, bound, z)
        passes = len(central.releases(state))   # this method's only unsampled release
        row.update({"dp_ffc_passes": passes, "dp_ffc_epsilon": release_epsilon([z] * passes, delta=central.delta),
                    "dp_ffc_clip": bound, "dp_ffc_noise_std": z * bound,
                    "dp_ffc_clipped_fraction": clipped / len(results) if results else 0.0})
        total = FfcStats(unpack_upper(noisy["ffc.gram"], dim), noisy["ffc.cross"], count)
        return total, state, row, noise_floor(z * bound, dim)

    @staticmethod
    def ffc_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
        """The last calibration's figures, for summary.json."""
        calibrated = [r for r in rows if "ffc_accuracy_after" in r]
        if not calibrated:
            return {}
        last = calibrated[-1]
        out = {"ffc_round": last["round"], **{k: last[k] for k in _SUMMARY_KEYS if k in last}}
        private = [r for r in rows if "dp_ffc_passes" in r]
        if private:
            out.update({k: private[-1][k] for k in ("dp_ffc_passes", "dp_ffc_epsilon", "dp_ffc_clip",
                                                    "dp_ffc_noise_std")})
        return out


class SphereFed(FfcPhase, FedProx):
    name = "spherefed"

    def __init__(self, train: dict[str, Any], *, mu: float = 0.0, sphere_seed: int = 0,
                 ffc: FfcSection = FfcSection(), broadcast: bool = True, rounds: int = 0) -> None:
        super().__init__(train, mu)
        self.rounds = rounds
        self.sphere_seed = sphere_seed
        self.ffc = ffc
        # Central DP covers the FFC pass; personal classifiers' accuracies it does not (the registry's condition).
        self.capabilities = self.capabilities.under({f"ffc.{f.name}": getattr(ffc, f.name)
                                                     for f in dataclasses.fields(ffc)}.get)
        self.broadcast = broadcast      # the download goes once per round as a broadcast, not per task
        self._fixed: torch.Tensor | None = None

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "SphereFed":
        return cls(dataclasses.asdict(cfg.train), mu=cfg.spherefed.mu, ffc=cfg.ffc, broadcast=cfg.codec.broadcast,
                   sphere_seed=with_sphere_seed(cfg.model, cfg.run.seed)["sphere_seed"], rounds=cfg.run.rounds)

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
    def configure_train(self, round: int, state: ServerState, clients: list[str]) -> list[TaskPlan]:
        down = self.extractor(state)
        return [TaskPlan(client_id=c, objective="sphere_train", hyper=self.hyper(), down=down, up=sorted(down))
                for c in clients]

    def calibrated(self, state: ServerState, weight: torch.Tensor, round: int) -> ServerState:
        """The calibrated classifier replaces the fixed one in the sphere head (the next round resets it)."""
        return dataclasses.replace(state, params={**state.params, CLASSIFIER: weight.to(torch.float32)})

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
        return {**super().summary(rows), **out, **self.ffc_summary(rows)}


@torch.no_grad()
def linear_accuracy(model: nn.Module, weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                    batch_size: int = 1024) -> float:
    """Accuracy of the linear head ``(weight, bias)`` on the model's (raw) features of (x, y)."""
    model.eval()
    correct = 0
    for start in range(0, len(x), batch_size):
        h = model.features(x[start:start + batch_size]).flatten(1).to(weight.dtype)
        correct += int(((h @ weight.t() + bias).argmax(1) == y[start:start + batch_size]).sum())
    return correct / max(len(y), 1)


class FedAvgFfc(FfcPhase, FedAvg):
    """FedAvg + FFC: plain FedAvg of a cross-entropy model with a linear head, then FFC.

    The control row for SphereFed + FFC: the same training as FedAvg (so its models are
    FedAvg's, seed for seed) and the same calibration as SphereFed (the same statistics of the
    L2-normalized features from every client, the same solve). After the last round the solved
    classifier replaces the trained linear head: the state's spec gains ``head = "sphere"``
    (scores ``W z`` on unit features, no bias), so the checkpoint, the evaluation and the
    export all hold the calibrated model without knowing how it was made. The trained head
    is kept in the state's buffers (checkpointed, never sent or exported) for that round's
    ``ffc_accuracy_before``. **fedge choice**: normalized features, as FFC is stated; the
    calibrated model therefore needs no bias and is a sphere-head model.
    """

    name = FEDAVG_FFC

    def __init__(self, train: dict[str, Any], *, ffc: FfcSection = FfcSection(), sphere_seed: int = 0,
                 rounds: int = 0) -> None:
        super().__init__(train)
        self.rounds = rounds
        if not ffc.enabled or ffc.every or ffc.personalize:
            raise ConfigError(f"{FEDAVG_FFC} calibrates once after the last round: it needs ffc.enabled = true, "
                              "ffc.every = 0 and ffc.personalize = false")
        self.ffc = ffc
        self.sphere_seed = sphere_seed   # the calibrated head's seed (its fixed classifier is never used)

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "FedAvgFfc":
        return cls(dataclasses.asdict(cfg.train), ffc=cfg.ffc, sphere_seed=cfg.run.seed, rounds=cfg.run.rounds)

    def initialize(self, spec: dict[str, Any], params: dict[str, torch.Tensor]) -> ServerState:
        weight, bias = params.get(CLASSIFIER), params.get("classifier.bias")
        if spec.get("head", "linear") != "linear" or weight is None or bias is None or weight.dim() != 2:
            raise ConfigError(f"{FEDAVG_FFC} trains a model whose last layer is a plain linear `classifier` "
                              "(weight and bias); set model.head = \"linear\" and remove the model option that "
                              "replaced the last layer")
        return super().initialize(spec, params)

    def calibrated(self, state: ServerState, weight: torch.Tensor, round: int) -> ServerState:
        """A sphere head with the solved classifier in place of the trained linear head, which the buffers keep."""
        spec = with_sphere_seed({**state.spec, "head": "sphere"}, self.sphere_seed)
        trained = {TRAINED_HEAD + k.removeprefix("classifier."): v for k, v in state.params.items()
                   if k.startswith("classifier.")}
        params = {**self.ffc_down(state), CLASSIFIER: weight.to(torch.float32)}
        return dataclasses.replace(state, spec=spec, params=params, buffers={**state.buffers, **trained})

    def aggregate(self, phase: str, round: int, state: ServerState, results: list[ClientResult],
                  partial: Any = None) -> tuple[ServerState, dict[str, Any]]:
        if phase == "ffc":
            return self.aggregate_ffc(round, state, results)
        return super().aggregate(phase, round, state, results, partial)

    def evaluate(self, state: ServerState, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        """Test metrics of the global model; after the calibration, also the trained linear head's accuracy
        on the same extractor (``ffc_accuracy_before``: FedAvg's own model of that round)."""
        metrics = super().evaluate(state, model, x, y)
        weight, bias = state.buffers.get(TRAINED_HEAD + "weight"), state.buffers.get(TRAINED_HEAD + "bias")
        if state.round > 0 and state.extra.get("ffc_round") == state.round and weight is not None \
                and bias is not None:
            before = linear_accuracy(model, weight, bias, x, y)
            metrics.update(ffc_accuracy_before=before, ffc_accuracy_after=metrics["test_accuracy"])
        return metrics

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {**super().summary(rows), **self.ffc_summary(rows)}
