"""Every learning method fedge runs, each registered here and only here.

An entry names the whole method: the coordinator's strategy, the device objectives
its tasks ask for, the networks it adds around the backbones, its config sections,
the model options it needs and the defaults it brings. Nothing registers itself
by being imported. Devices install only ``edge_client``, so the coordinator's
parts (the strategy class and the config dataclasses) are named by import path
(``"module:attribute"``, as Python entry points do) and resolved by the
coordinator alone (:mod:`coordinator.methods`).

Adding a method: a device module in :mod:`edge_client.methods`, a strategy module in
``coordinator/strategies/``, and an entry in :data:`METHODS` (``docs/methods.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from edge_client import models
from edge_client.methods import dfl, fed2, fedma, sphere
from edge_client.methods.dfl_model import two_branch
from edge_client.models import ModelFactory
from edge_client.objectives import OBJECTIVES as PLAIN_OBJECTIVES
from edge_client.objectives import Objective
from edge_client.seeding import global_rng, private_rng

__all__ = ["Method", "METHODS", "OBJECTIVES", "NETWORKS", "build_model", "build_aside", "model_size", "describe_size"]


@dataclass(frozen=True)
class Method:
    """One learning method, end to end."""

    name: str
    strategy: str                                        # "module:Class" of its coordinator strategy
    objectives: Mapping[str, Objective] = field(default_factory=dict)   # what its tasks ask devices to run
    networks: Mapping[str, ModelFactory] = field(default_factory=dict)  # model names it adds to the backbones
    sections: Mapping[str, str] = field(default_factory=dict)   # config section -> "module:Dataclass"
    # Model options the strategy needs: applied when the user set none, an error when the user set another.
    model_options: Mapping[str, Any] = field(default_factory=dict)
    # "section.key" -> value: a default of the method's own, applied when the user set none.
    defaults: Mapping[str, Any] = field(default_factory=dict)


_STRATEGIES = "coordinator.strategies"

METHODS: dict[str, Method] = {m.name: m for m in (
    Method("fedavg", f"{_STRATEGIES}.fedavg:FedAvg"),
    Method("fedprox", f"{_STRATEGIES}.fedavg:FedProx",
           sections={"fedprox": f"{_STRATEGIES}.fedavg:FedProxSection"}),
    Method("spherefed", f"{_STRATEGIES}.spherefed:SphereFed", objectives=sphere.OBJECTIVES,
           sections={"spherefed": f"{_STRATEGIES}.spherefed:SphereFedSection",
                     "ffc": f"{_STRATEGIES}.spherefed:FfcSection"},
           model_options={"head": "sphere"}),
    Method("dfl", f"{_STRATEGIES}.dfl:DFL", objectives=dfl.OBJECTIVES, networks={"dfl": two_branch},
           sections={"dfl": f"{_STRATEGIES}.dfl:DflSection"},
           defaults={"data.local_test_fraction": 0.2}),
    Method("fed2", f"{_STRATEGIES}.fed2:Fed2", objectives=fed2.OBJECTIVES,
           sections={"fed2": f"{_STRATEGIES}.fed2:Fed2Section"},
           defaults={"model.fed2_groups": 10}),
    Method("fedma", f"{_STRATEGIES}.fedma:FedMA", objectives=fedma.OBJECTIVES,
           sections={"fedma": f"{_STRATEGIES}.fedma:FedmaSection"},
           model_options={"norm": "none"}),
    Method("fedadam", "methods.fedadam.strategy:FedAdam", sections={"fedadam": "methods.fedadam.strategy:FedAdamSection"}),
    Method("fedyogi", "methods.fedyogi.strategy:FedYogi", sections={"fedyogi": "methods.fedyogi.strategy:FedYogiSection"}),
    Method("fedadagrad", "methods.fedadagrad.strategy:FedAdagrad",
           sections={"fedadagrad": "methods.fedadagrad.strategy:FedAdagradSection"}),
    Method("fedavgm", "methods.fedavgm.strategy:FedAvgM", sections={"fedavgm": "methods.fedavgm.strategy:FedAvgMSection"}),
)}

OBJECTIVES: dict[str, Objective] = {**PLAIN_OBJECTIVES,
                                    **{k: v for m in METHODS.values() for k, v in m.objectives.items()}}
NETWORKS: dict[str, ModelFactory] = {**models.MODELS,
                                     **{k: v for m in METHODS.values() for k, v in m.networks.items()}}


def build_model(spec: Mapping[str, Any]) -> nn.Module:
    """The network a model spec names, a backbone or a method's; every party builds it the same way.

    Building draws from torch's global generator, so it holds that generator (edge_client.seeding).
    """
    with global_rng():
        return models.build_model(spec, NETWORKS)


def build_aside(spec: Mapping[str, Any]) -> nn.Module:
    """``build_model`` leaving torch's global generator as it was: for a network only measured, or
    whose tensors are all loaded next, so that building it does not move a run's seeded stream."""
    with private_rng():
        return build_model(spec)


def model_size(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Parameters and multiply-adds per image of the network a spec builds, and, for a model a
    method adapted (Fed2's groups), of the original beside it (``original``)."""
    def cost(s: Mapping[str, Any]) -> dict[str, int]:
        return models.model_cost(build_aside(s), int(s["in_channels"]), int(s["image_size"]))

    size: dict[str, Any] = cost(spec)
    original = models.without_fed2(spec)
    if original != dict(spec):
        size["original"] = cost(original)
    return size


def describe_size(size: Mapping[str, Any]) -> str:
    """``model_size`` in words, for run logs."""
    def words(c: Mapping[str, Any]) -> str:
        return f"{c['parameters']:,} parameters, {c['multiply_adds']:,} multiply-adds per image"

    text = words(size)
    return f"{text} (the original model: {words(size['original'])})" if "original" in size else text
