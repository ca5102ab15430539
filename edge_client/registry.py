"""Every learning method fedge runs, each registered here and only here.

An entry names the whole method by import paths (``"module:attribute"``, as Python entry
points do): the coordinator's strategy and its config sections, the device objectives its
tasks ask for, the model hook that changes the networks every party builds, the export hook,
the commands it adds to ``fedge-coordinator``, the model options it needs, the defaults it
brings and what its strategy can run with (:class:`Capabilities`). A method may be a model hook alone, which any
strategy trains with. Nothing registers itself by being imported, and naming a part imports
nothing: this module imports no torch, so a command line lists the methods at once, and a
device, which installs no coordinator, never resolves a strategy. A part is imported the first
time it is used, and only once (:func:`resolve`).

Adding a method: a folder under ``methods/`` and one entry in :data:`METHODS` (``docs/methods.md``).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from edge_client.models import ModelHook
    from edge_client.objectives import Objective

__all__ = ["Method", "Capabilities", "Condition", "AVERAGES", "METHODS",
           "OBJECTIVES", "resolve", "strategies", "optimizers", "commands", "model_options", "model_hooks",
           "build_model", "build_builtin", "build_aside", "example_sample", "model_size", "describe_size"]


@dataclass(frozen=True)
class Condition:
    """Capabilities that differ under some settings: ``changes`` (field -> value) hold while every ``when``
    setting (``"section.key"`` -> value) has its value."""

    when: Mapping[str, Any]
    changes: Mapping[str, Any]


@dataclass(frozen=True)
class Capabilities:
    """What a method's strategy can run with, declared once, in its entry: the checks of a configuration, the
    refusals' lists of the strategies that can, the compatibility table (docs/methods.md) and the strategy
    classes (``Strategy.capabilities``) all read it, before any torch is imported. The defaults are a
    strategy's that combines results its own way."""

    # A training round ends in one combined update of the model that ``server_step`` applies, so that any
    # server optimizer ([server] optimizer, coordinator/strategies/server.py) can take that step.
    aggregates_deltas: bool = False
    # It averages what clients send as updates of what it sent, so that aggregate.rule and aggregate.norm_bound
    # apply (coordinator/aggregation.py).
    robust: bool = False
    # Why it cannot run with run.mode = "async" (docs/async.md), "" when it can: buffered asynchronous versions
    # need every result to fold into one weighted update of the model that ``server_step`` applies, whenever it comes.
    sync_only: str = "its aggregation needs every client's result of a phase at once"
    # Why it cannot run with privacy.mode = "central" or "local" or secagg.enabled = true (docs/privacy.md), ""
    # when it can: each needs every result to be one clipped update of the model sent, folded into one sum.
    central_dp: str = "it does not fold one update per device into a single sum"
    # Settings under which it can do otherwise (``Fed2``'s pairing, a personal classifier's accuracy).
    conditions: tuple[Condition, ...] = ()

    def under(self, setting: Callable[[str], Any]) -> Capabilities:
        """These capabilities under the settings ``setting`` reads (``"section.key"`` -> value): each condition
        whose settings hold applied, in order."""
        held = self
        for condition in self.conditions:
            if all(setting(key) == value for key, value in condition.when.items()):
                held = replace(held, **condition.changes)
        return held

    @property
    def runs_async(self) -> bool:
        """Every result folds into one update of the model for ``server_step``, whenever it comes: run.mode =
        "async" runs with it."""
        return self.aggregates_deltas and not self.sync_only

    @property
    def one_update_per_device(self) -> bool:
        """Every training result is one update of the model it was sent, which a device can clip and noise and a
        secure sum can add up: central and local DP and SecAgg run with it."""
        return self.aggregates_deltas and not self.central_dp

    @property
    def folds_updates(self) -> bool:
        """Besides, every phase folds its results into one weighted sum whenever they come: aggregation workers
        run with it."""
        return self.one_update_per_device and not self.sync_only


# FedAvg's: one sample-weighted sum of the clients' updates, whenever they come, stepped by ``server_step``.
AVERAGES = Capabilities(aggregates_deltas=True, robust=True, sync_only="", central_dp="")


@dataclass(frozen=True)
class Method:
    """One learning method, end to end; every part is an import path resolved on first use."""

    name: str
    strategy: str = ""          # "module:Class" of its coordinator strategy; "" for a model hook alone
    objectives: str = ""        # "module:MAPPING": objective name -> function, what its tasks ask devices to run
    model: str = ""             # "module:HOOK": an edge_client.models.ModelHook
    export: str = ""            # "module:HOOK": an export.hooks.ExportHook
    # fedge-coordinator subcommand -> "module:function" that adds it: function(subparsers, name)
    commands: Mapping[str, str] = field(default_factory=dict)
    sections: Mapping[str, str] = field(default_factory=dict)   # config section -> "module:Dataclass"
    # Model options the strategy needs: applied when the user set none, an error when the user set another.
    model_options: Mapping[str, Any] = field(default_factory=dict)
    # "section.key" -> value: a default of the method's own, applied when the user set none.
    defaults: Mapping[str, Any] = field(default_factory=dict)
    # It trains any app's model (edge_client.app): it needs nothing of the network's structure.
    takes_apps: bool = False
    # "module:Class" of a server optimizer (coordinator.strategies.server.ServerOptimizer): ``[server] optimizer``
    # names it for any strategy that combines model deltas; its strategy is FedAvg with it.
    optimizer: str = ""
    # What its strategy can run with: modes, privacy, server optimizers, robust rules (a model hook alone: unused).
    capabilities: Capabilities = Capabilities()


_STRATEGIES = "coordinator.strategies"
_FFC_PHASE = "its FFC calibration sums every client's feature statistics in a phase of its own"

METHODS: dict[str, Method] = {m.name: m for m in (
    Method("fedavg", f"{_STRATEGIES}.fedavg:FedAvg", takes_apps=True, capabilities=AVERAGES),
    Method("fedprox", f"{_STRATEGIES}.fedavg:FedProx",
           sections={"fedprox": f"{_STRATEGIES}.settings:FedProxSection"}, takes_apps=True, capabilities=AVERAGES),
    Method("spherefed", "methods.spherefed.strategy:SphereFed", objectives="methods.spherefed.device:OBJECTIVES",
           model="methods.spherefed.model:HOOK", export="methods.spherefed.export:HOOK",
           sections={"spherefed": "methods.spherefed.settings:SphereFedSection",
                     "ffc": "methods.spherefed.settings:FfcSection"},
           model_options={"head": "sphere"},
           # Central DP covers the FFC pass (its own bound and noise); personal classifiers' accuracies it does not.
           capabilities=replace(AVERAGES, sync_only=_FFC_PHASE, conditions=(Condition(
               {"ffc.enabled": True, "ffc.personalize": True},
               {"central_dp": "ffc.personalize reports every device's own classifier's accuracy without noise "
                              "(set ffc.personalize = false)"}),))),
    # FedAvg + FFC: FedAvg's training, then SphereFed's calibration (the control for SphereFed + FFC)
    Method("fedavg_ffc", "methods.spherefed.strategy:FedAvgFfc", objectives="methods.spherefed.device:OBJECTIVES",
           sections={"ffc": "methods.spherefed.settings:FfcSection"},
           capabilities=replace(AVERAGES, sync_only=_FFC_PHASE)),
    Method("dfl", "methods.dfl.strategy:DFL", objectives="methods.dfl.device:OBJECTIVES",
           model="methods.dfl.model:HOOK", export="methods.dfl.export:HOOK",
           sections={"dfl": "methods.dfl.settings:DflSection"},
           defaults={"data.local_test_fraction": 0.2},
           # the invariant extractor's mean update takes the server's step (any [server] optimizer)
           capabilities=Capabilities(aggregates_deltas=True,
                                     sync_only="its rounds alternate local and global stages and end in every "
                                               "client's personalized evaluation")),
    Method("fed2", "methods.fed2.strategy:Fed2", objectives="methods.fed2.device:OBJECTIVES",
           model="methods.fed2.model:HOOK", commands={"fed2-depth": "methods.fed2.cli:add_command"},
           sections={"fed2": "methods.fed2.settings:Fed2Section"},
           defaults={"model.fed2_groups": 10},
           capabilities=replace(
               AVERAGES, sync_only="its paired averaging weighs each group's rows by the clients of one round "
                                   "(fed2.pairing)",
               central_dp="its paired averaging weighs each group's rows by each device's class counts",
               conditions=(Condition({"fed2.pairing": "holders"}, {"robust": False}),))),   # its rows, its weights
    Method("fedma", "methods.fedma.strategy:FedMA", objectives="methods.fedma.device:OBJECTIVES",
           sections={"fedma": "methods.fedma.settings:FedmaSection"},
           model_options={"norm": "none"},
           capabilities=Capabilities(sync_only="matching a layer's neurons needs every client's layer at once")),
    Method("pans", model="methods.pans.model:HOOK", export="methods.pans.export:HOOK"),
    Method("fedadam", "methods.fedadam.strategy:FedAdam",
           sections={"fedadam": "methods.fedadam.settings:FedAdamSection"}, takes_apps=True,
           optimizer="methods.fedadam.strategy:FedAdamStep", capabilities=AVERAGES),
    Method("fedyogi", "methods.fedyogi.strategy:FedYogi",
           sections={"fedyogi": "methods.fedyogi.settings:FedYogiSection"}, takes_apps=True,
           optimizer="methods.fedyogi.strategy:FedYogiStep", capabilities=AVERAGES),
    Method("fedadagrad", "methods.fedadagrad.strategy:FedAdagrad",
           sections={"fedadagrad": "methods.fedadagrad.settings:FedAdagradSection"}, takes_apps=True,
           optimizer="methods.fedadagrad.strategy:FedAdagradStep", capabilities=AVERAGES),
    Method("fedavgm", "methods.fedavgm.strategy:FedAvgM",
           sections={"fedavgm": "methods.fedavgm.settings:FedAvgMSection"}, takes_apps=True,
           optimizer="methods.fedavgm.strategy:FedAvgMStep", capabilities=AVERAGES),
)}


@functools.cache
def resolve(path: str) -> Any:
    """The object an import path ``"package.module:attribute"`` names, imported once."""
    module, _, attribute = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"the method registry names {path!r}, which does not import ({exc}); fix the entry in "
                          "edge_client/registry.py or install the package that provides it") from exc


def strategies() -> list[str]:
    """The names ``run.strategy`` takes, in registry order."""
    return [name for name, entry in METHODS.items() if entry.strategy]


def optimizers() -> list[str]:
    """The names ``server.optimizer`` takes besides FedAvg's plain step (``"fedavg"``), in registry order."""
    return [name for name, entry in METHODS.items() if entry.optimizer]


def commands() -> dict[str, str]:
    """The methods' ``fedge-coordinator`` subcommands: name -> import path of the function that adds it."""
    return {name: path for entry in METHODS.values() for name, path in entry.commands.items()}


def model_options() -> list[str]:
    """The methods that are a model hook alone: options any strategy trains with."""
    return [name for name, entry in METHODS.items() if entry.model and not entry.strategy]


@functools.cache
def _objectives() -> dict[str, Objective]:
    from edge_client.objectives import OBJECTIVES as PLAIN

    return {**PLAIN, **{k: v for m in METHODS.values() if m.objectives for k, v in resolve(m.objectives).items()}}


class _Objectives(Mapping[str, "Objective"]):
    """Every objective a task can name: plain training and evaluation, and each method's.

    A mapping that imports the methods' device code when first read, not when the registry is imported.
    """

    def __getitem__(self, name: str) -> Objective:
        return _objectives()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(_objectives())

    def __len__(self) -> int:
        return len(_objectives())


OBJECTIVES: Mapping[str, Objective] = _Objectives()


@functools.cache
def model_hooks() -> tuple[ModelHook, ...]:
    """Every method's model hook, in registry order (the order their layer plans compose in)."""
    hooks = tuple(resolve(m.model) for m in METHODS.values() if m.model)
    owned = [key for hook in hooks for key in hook.options]
    twice = sorted({key for key in owned if owned.count(key) > 1})
    if twice:
        raise TypeError(f"model options {twice} are claimed by two model hooks; give each its own")
    return hooks


def build_model(spec: Mapping[str, Any]) -> nn.Module:
    """The network a model spec names, a backbone or a method's; every party builds it the same way.

    Building draws from torch's global generator, so it holds that generator (edge_client.seeding). A spec
    that names an app (edge_client.app) is built by the app's own factory, once the installed app is checked
    to be the one the spec was made with.
    """
    from edge_client.app import app_options, spec_app
    from edge_client.finetune import prepare_app_model
    from edge_client.seeding import global_rng

    app = spec_app(spec)
    if app is None:
        return build_builtin(spec)
    with global_rng():
        return prepare_app_model(app, app.model(app_options(spec)))


def example_sample(spec: Mapping[str, Any]) -> torch.Tensor:
    """A batch of one zero sample of the input the spec's network takes: its app's example input, or fedge's
    own networks' square image."""
    import torch

    from edge_client.app import app_options, example_input, spec_app

    app = spec_app(spec)
    if app is not None:
        return example_input(app, app_options(spec)).tensor(1)
    size = int(spec["image_size"])
    return torch.zeros(1, int(spec["in_channels"]), size, size)


def build_builtin(spec: Mapping[str, Any]) -> nn.Module:
    """fedge's own network a spec names (the ``vision`` app's model): the one place it is built, so that
    :func:`build_model` can dispatch to other apps without the built-in app coming back to it."""
    from edge_client import models
    from edge_client.seeding import global_rng

    with global_rng():
        return models.build_model(spec, model_hooks())


def build_aside(spec: Mapping[str, Any]) -> nn.Module:
    """``build_model`` leaving torch's global generator as it was: for a network only measured, or
    whose tensors are all loaded next, so that building it does not move a run's seeded stream."""
    from edge_client.seeding import private_rng

    with private_rng():
        return build_model(spec)


def model_size(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Parameters and multiply-adds per image of the network a spec builds, and, for a model a
    method adapted, of the original beside it (``original``)."""
    from edge_client import models

    def cost(s: Mapping[str, Any]) -> dict[str, int]:
        return models.model_cost(build_aside(s), example_sample(s))

    size: dict[str, Any] = cost(spec)
    original = dict(spec)
    for hook in model_hooks():
        original = hook.original(original) if hook.original is not None else original
    if original != dict(spec):
        size["original"] = cost(original)
    return size


def describe_size(size: Mapping[str, Any]) -> str:
    """``model_size`` in words, for run logs."""
    def words(c: Mapping[str, Any]) -> str:
        return f"{c['parameters']:,} parameters, {c['multiply_adds']:,} multiply-adds per image"

    text = words(size)
    return f"{text} (the original model: {words(size['original'])})" if "original" in size else text
