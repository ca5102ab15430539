"""FedMA (Wang et al., ICLR 2020): layer-wise matched averaging with a global model that may grow.

One engine round is one **phase**; a **pass** has one phase per weight layer
(``cnn``: 4, ``vgg9``: 9, ``mlp``: hidden layers + 1), so ``run.rounds`` is a whole
number of passes (the paper's FedMA with communication repeats the pass).

- Phase 1: ``clients.per_round`` of the online clients, sampled afresh for each pass
  (all of them with 0), get the global model (cut to its own width with its
  assignments of the last pass, once it has them), trains it for ``train.epochs``
  and sends layer 1.
- Phase ``l`` (a hidden layer): the coordinator matched layer ``l - 1`` in the
  phase before (:func:`methods.fedma.matching.match_layer`: BBP-MAP, Hungarian
  assignment, ``fedma.sweeps`` sweeps, width capped at ``fedma.max_growth`` times the
  layer's first width); each client that sent it gets the global layer and its own
  assignment, re-indexes its layer ``l``, freezes the layers below and retrains the
  rest for ``fedma.retrain_epochs``, and sends layer ``l``.
- The last phase (the classifier): clients retrain only the classifier (three times
  the epochs at a tenth of the learning rate, the reference's rule) and send it with
  their label histograms; row ``c`` is averaged with weights ``n_kc / sum_j n_jc``.
  The matched layers and the classifier become the new global model, whose spec
  carries every layer's width, so every party rebuilds it, checkpoints hold it and
  the export reads it like any other model.

The server state between phases: ``params`` is the last complete global model,
plus the layers matched so far in this pass under ``fedma/NAME``; ``extra`` holds the
pass's assignments, the clients still in the pass (those that sent every phase so
far) and each client's assignments from the last pass. A resumed run repeats the
phase after its last checkpoint (up to two behind what the devices did, since the
checkpoint trails the training by a round); the devices answer a repeated phase from
the file they saved for it.

Matching runs in the engine's aggregation step; MQTT keepalives are answered by
paho's own network thread meanwhile, and results that arrive wait in the receive queue.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from coordinator.errors import ConfigError
from coordinator.strategies.base import ClientResult, Strategy, TaskPlan
from edge_client.registry import build_aside
from methods.common import histogram_problem, label_histogram
from methods.fedma.device import client_slice, weight_layers
from methods.fedma.matching import (combine_classifier, layer_from_vectors, match_layer, neuron_vectors,
                                    prior_mean_vector)
from methods.fedma.settings import FedmaSection
from storage.state import ServerState

if TYPE_CHECKING:
    from coordinator.config import RunConfig

__all__ = ["FedMA", "FedmaSection", "MATCHED"]

MATCHED = "fedma/"    # state names of the layers matched so far in the current pass


class FedMA(Strategy):
    name = "fedma"

    def __init__(self, train: dict[str, Any], settings: FedmaSection, *, seed: int, per_pass: int = 0) -> None:
        self.train = dict(train)
        self.settings = settings
        self.seed = seed
        self.per_pass = per_pass      # clients sampled for a pass; 0: every online client

    @classmethod
    def from_config(cls, config: RunConfig) -> "FedMA":
        model = config.model
        phases = _phases(json.dumps({**model, "num_classes": 10, "in_channels": 1, "image_size": 32},
                                    sort_keys=True))
        if config.run.rounds % phases:
            raise ConfigError(f"with fedma a round is one phase and a pass has {phases} ({model['name']}'s weight "
                              f"layers): set run.rounds to a multiple of {phases} (e.g. {phases * 2} for two passes)")
        return cls(dataclasses.asdict(config.train), config.fedma, seed=config.run.seed,
                   per_pass=config.clients.per_round)

    # -- shape of the pass ------------------------------------------------------
    def initialize(self, spec: dict[str, Any], params: dict[str, torch.Tensor]) -> ServerState:
        """Every width in the spec, so that a grown model is described the same way as the first."""
        widths = _widths(json.dumps(spec, sort_keys=True))
        spec = _with_widths(spec, widths)
        return ServerState(round=0, params=params, spec=spec,
                           extra={"first_widths": widths, "assignments": {}, "current": {}, "members": []})

    def selects_all(self, phase: str) -> bool:
        return True    # the strategy picks a pass's clients itself: every phase of a pass needs the same ones

    def _phase(self, round: int, spec: dict[str, Any]) -> tuple[int, int, int]:
        """(pass, layer, layers per pass) of ``round`` (1-based)."""
        count = _phases(json.dumps(spec, sort_keys=True))
        return (round - 1) // count, (round - 1) % count + 1, count

    # -- phases -------------------------------------------------------------------
    def configure_train(self, round: int, state: ServerState, clients: list[str]) -> list[TaskPlan]:
        pass_index, layer, count = self._phase(round, state.spec)
        names = weight_layers(_model(json.dumps(state.spec, sort_keys=True)))
        current, extra = state.extra["current"], state.extra
        if layer == 1:
            k = min(self.per_pass or len(clients), len(clients))
            members = sorted(random.Random(f"{self.seed}/{pass_index}").sample(sorted(clients), k))
        else:
            members = [c for c in clients if c in extra["members"]]
        matched = _matched_widths(state, names)
        up = [f"{names[layer - 1]}.weight", f"{names[layer - 1]}.bias"]
        plans = []
        for c in members:
            own = self._own_widths(state, c)
            local = _with_widths(state.spec, matched + own[len(matched):])
            hyper: dict[str, Any] = {"train": self._train_hyper(layer, count),
                                     "fedma": {"pass": pass_index, "layer": layer}}
            if layer == 1:
                down = state.params if c not in extra["assignments"] else self._sliced(state, c)
                down = {k: v for k, v in down.items() if not k.startswith(MATCHED)}
            else:
                below = names[layer - 2]
                down = {f"{below}.{p}": state.params[f"{MATCHED}{below}.{p}"] for p in ("weight", "bias")}
                hyper["fedma"]["assignment"] = current[c][layer - 2]
            shapes = _shapes(json.dumps(local, sort_keys=True))
            plans.append(TaskPlan(client_id=c, objective="fedma_train", hyper=hyper, down=down, up=up,
                                  expect={k: shapes[k] for k in up}, update="raw", model=local))
        return plans

    def _train_hyper(self, layer: int, count: int) -> dict[str, Any]:
        train = dict(self.train)
        if layer == count:          # the classifier alone: 3x the epochs at lr / 10, as the reference does
            train.update(epochs=3 * self.settings.retrain_epochs, lr=train["lr"] / 10)
        elif layer > 1:
            train.update(epochs=self.settings.retrain_epochs)
        return train

    def _own_widths(self, state: ServerState, client: str) -> list[int]:
        """The client's widths in this pass: its assignments' sizes from the last pass, else the global ones."""
        last = state.extra["assignments"].get(client)
        return [len(a) for a in last] if last else _widths(json.dumps(state.spec, sort_keys=True))

    def _sliced(self, state: ServerState, client: str) -> dict[str, torch.Tensor]:
        """The global model cut back to the client's own neurons (FedMA with communication)."""
        names = weight_layers(_model(json.dumps(state.spec, sort_keys=True)))
        out = dict(state.params)
        previous: torch.Tensor | None = None
        for i, name in enumerate(names):
            weight, bias = state.params[f"{name}.weight"], state.params[f"{name}.bias"]
            if previous is not None:
                per_channel = weight.shape[1] // state.params[f"{names[i - 1]}.weight"].shape[0]
                weight = client_slice(weight, previous, per_channel)
            if i < len(names) - 1:
                rows = torch.tensor(state.extra["assignments"][client][i], dtype=torch.int64)
                weight, bias, previous = weight[rows], bias[rows], rows
            out[f"{name}.weight"], out[f"{name}.bias"] = weight.contiguous(), bias.contiguous()
        return out

    def check_result(self, plan: TaskPlan, result: ClientResult, spec: dict[str, Any]) -> str | None:
        """A classifier phase's result must carry a sound label histogram: the rows are weighted by it."""
        if plan.objective != "fedma_train" or plan.up[0] != "classifier.weight":
            return None
        return histogram_problem(result.metrics, result.num_samples, int(plan.expect["classifier.weight"][0]))

    def aggregate(self, phase: str, round: int, state: ServerState, results: list[ClientResult],
                  partial: Any = None) -> tuple[ServerState, dict[str, Any]]:
        if phase != "train":
            return super().aggregate(phase, round, state, results, partial)
        pass_index, layer, count = self._phase(round, state.spec)
        names = weight_layers(_model(json.dumps(state.spec, sort_keys=True)))
        name = names[layer - 1]
        weights = [r.tensors[f"{name}.weight"] for r in results]
        biases = [r.tensors[f"{name}.bias"] for r in results]
        members = [r.client_id for r in results]
        started = time.monotonic()
        if layer == count:
            counts = [label_histogram(r.metrics, r.client_id) for r in results]
            weight, bias = combine_classifier(weights, biases, counts)
            seconds = time.monotonic() - started
            return self._finish_pass(round, state, names, weight, bias, members), {
                "fedma_layer": layer, "fedma_match_seconds": seconds, "fedma_clients": len(results),
                "fedma_widths": _matched_widths(state, names)}
        s = self.settings
        vectors = [neuron_vectors(w, b) for w, b in zip(weights, biases)]
        cap = math.ceil(state.extra["first_widths"][layer - 1] * s.max_growth)
        matching = match_layer(vectors, sigma=s.sigma, sigma0=s.sigma0, gamma=s.gamma,
                               prior_mean=prior_mean_vector(vectors[0].shape[1]), sweeps=s.sweeps,
                               max_width=max(cap, max(len(v) for v in vectors)),
                               seed=self.seed * 100_003 + round)
        seconds = time.monotonic() - started
        weight, bias = layer_from_vectors(matching.global_vectors, tuple(weights[0].shape[1:]))
        current = {c: list(a) for c, a in state.extra["current"].items() if c in members} if layer > 1 else {}
        for c, assignment in zip(members, matching.assignments):
            current.setdefault(c, []).append([int(i) for i in assignment])
        params = {**state.params, f"{MATCHED}{name}.weight": weight.to(torch.float32),
                  f"{MATCHED}{name}.bias": bias.to(torch.float32)}
        extra = {**state.extra, "current": current, "members": members}
        new = dataclasses.replace(state, round=round, params=params, extra=extra)
        return new, {"fedma_layer": layer, "fedma_match_seconds": seconds, "fedma_width": matching.width,
                     "fedma_clients": len(results)}

    def _finish_pass(self, round: int, state: ServerState, names: list[str], weight: torch.Tensor,
                     bias: torch.Tensor, members: list[str]) -> ServerState:
        """The matched layers and the combined classifier become the new global model."""
        hidden = names[:-1]
        params = {k: v for k, v in state.params.items()
                  if not k.startswith(MATCHED) and not any(k.startswith(f"{n}.") for n in names)}
        for name in hidden:
            for p in ("weight", "bias"):
                params[f"{name}.{p}"] = state.params[f"{MATCHED}{name}.{p}"]
        params[f"{names[-1]}.weight"], params[f"{names[-1]}.bias"] = weight.to(torch.float32), bias.to(torch.float32)
        spec = _with_widths(state.spec, _matched_widths(state, names))
        assignments = {**state.extra["assignments"],
                       **{c: a for c, a in state.extra["current"].items() if c in members}}
        extra = {**state.extra, "assignments": assignments, "current": {}, "members": []}
        return ServerState(round=round, params=params, spec=spec, extra=extra)

    def evaluate(self, state: ServerState, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        """Only a finished pass has a whole global model; in between there is nothing new to test."""
        if state.round % _phases(json.dumps(state.spec, sort_keys=True)):
            return {}
        return super().evaluate(state, model, x, y)

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        widths = [r["fedma_widths"] for r in rows if "fedma_widths" in r]
        seconds = sum(r.get("fedma_match_seconds", 0.0) for r in rows)
        return {"fedma_passes": len(widths), "fedma_final_widths": widths[-1] if widths else None,
                "fedma_match_seconds": seconds}


def _matched_widths(state: ServerState, names: list[str]) -> list[int]:
    """Widths of the layers matched so far in this pass, in order."""
    out = []
    for name in names[:-1]:
        key = f"{MATCHED}{name}.weight"
        if key not in state.params:
            break
        out.append(int(state.params[key].shape[0]))
    return out


@functools.lru_cache(maxsize=16)
def _model(spec_json: str) -> nn.Module:
    return build_aside(json.loads(spec_json))


def _phases(spec_json: str) -> int:
    return len(weight_layers(_model(spec_json)))


def _widths(spec_json: str) -> list[int]:
    model = _model(spec_json)
    return [int(model.get_submodule(n).weight.shape[0]) for n in weight_layers(model)[:-1]]


@functools.lru_cache(maxsize=64)
def _shapes(spec_json: str) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in _model(spec_json).state_dict().items()}


def _with_widths(spec: dict[str, Any], widths: list[int]) -> dict[str, Any]:
    """The spec with every hidden width explicit (``hidden`` for mlp, ``widths`` for the others)."""
    key = "hidden" if spec["name"] == "mlp" else "widths"
    return {**spec, key: [int(w) for w in widths]}
