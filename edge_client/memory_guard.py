"""A device refuses a task that would run it out of memory, before the task starts.

Running out of memory on a device does not fail a task cleanly: the kernel kills the
client (or its container), the coordinator waits for the round's whole timeout and
learns nothing. So before a task runs, the device compares what the task will need
with what it may still take (:func:`profiling.memory.memory_available_bytes`: the
cgroup's limit minus its usage inside a container, else the host's available memory)
and answers with an error whose reason starts with ``memory:`` and says the numbers.

What the task will need:

- when this device already ran a task on this model and batch size: the peak resident
  memory it measured then, minus what the process holds now (memory the process kept
  from that task is already in use, and not needed twice);
- otherwise :func:`estimate_task_bytes`: the parameters five times over (weights,
  gradients, momentum, the received copy, the update) plus every layer's output for a
  batch three times over (kept for the backward pass, its gradient, workspace), plus
  :data:`SLACK`.

The estimate is checked in two steps. Before the network is built, its parameters alone
(counted on torch's ``meta`` device, which allocates nothing), so a network far too big
is refused before building it could exhaust the device. Once built, with the layers'
outputs too (one sample through the network). Either figure is multiplied by the margin
(:data:`MARGIN`) before the comparison.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import psutil
import torch
from torch import nn

from edge_client.hyper import ObjectiveError, TrainHyper
from edge_client.registry import build_aside, example_sample
from profiling.memory import memory_available_bytes
from profiling.units import human_bytes

__all__ = ["MemoryRefusal", "MemoryGuard", "estimate_task_bytes", "parameter_count", "MARGIN", "SLACK",
           "REFUSAL_PREFIX"]

MARGIN = 1.2                 # the need times this must fit: allocator fragmentation, the data's batch copies
SLACK = 16 * 1024 * 1024     # autograd's and the allocator's own bookkeeping on top of the tensors
REFUSAL_PREFIX = "memory:"   # how a refusal's reason starts: the coordinator counts these apart
_FLOAT = 4
_KEEP = 16                   # models remembered (a method may change the network every round)


class MemoryRefusal(ObjectiveError):
    """The task would need more memory than this device has left; the reason starts with ``memory:``."""


def _leaf_outputs(model: nn.Module, sample: torch.Tensor) -> int:
    """Elements of every leaf module's output for ``sample`` (a batch of one)."""
    total = 0

    def count(_module: nn.Module, _inputs: Any, output: Any) -> None:
        nonlocal total
        if isinstance(output, torch.Tensor):
            total += output.numel()

    hooks = [m.register_forward_hook(count) for m in model.modules() if not list(m.children())]
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(sample)
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return total


def parameter_count(spec: Mapping[str, Any]) -> int:
    """The parameters of the network ``spec`` names, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return sum(p.numel() for p in build_aside(spec).parameters())


def estimate_task_bytes(model: nn.Module, spec: Mapping[str, Any], batch_size: int) -> int:
    """Bytes a training task on ``model`` (built from ``spec``) with ``batch_size`` needs, by the rule in
    the module's docstring."""
    parameters = sum(p.numel() for p in model.parameters())
    device = next(model.parameters(), torch.zeros(0)).device
    sample = example_sample(spec).to(device)
    return 5 * _FLOAT * parameters + 3 * _FLOAT * _leaf_outputs(model, sample) * batch_size + SLACK


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


class MemoryGuard:
    """Checks each task against the memory left and remembers the peaks measured per model and batch size.

    ``available`` and ``rss`` are what the device reads (the process's available memory, its resident
    memory now); a test may give its own.
    """

    def __init__(self, *, available: Callable[[], int] = memory_available_bytes, rss: Callable[[], int] = _rss,
                 margin: float = MARGIN) -> None:
        self.available = available
        self.rss = rss
        self.margin = margin
        self._peaks: dict[str, int] = {}   # model and batch key -> peak RSS of the last task with them
        self._estimates: dict[str, int] = {}   # the same key -> estimated bytes

    @staticmethod
    def key(spec: Mapping[str, Any], hyper: Mapping[str, Any]) -> str:
        return json.dumps([spec, _batch_size(hyper)], sort_keys=True)

    def before_build(self, spec: Mapping[str, Any], hyper: Mapping[str, Any]) -> None:
        """Raise :class:`MemoryRefusal` when the measured peak, or else the parameters alone, do not fit."""
        peak = self._peaks.get(self.key(spec, hyper))
        if peak is not None:
            self._check(max(0, peak - self.rss()), f"measured peak {human_bytes(peak)} of an earlier task on "
                                                   "this model")
            return
        parameters = parameter_count(spec)
        self._check(5 * _FLOAT * parameters + SLACK, f"{parameters:,} parameters, before their activations")

    def before_training(self, model: nn.Module, spec: Mapping[str, Any], hyper: Mapping[str, Any]) -> None:
        """Raise :class:`MemoryRefusal` when the built network's estimate does not fit (no measured peak yet)."""
        key = self.key(spec, hyper)
        if key in self._peaks:
            return   # checked against the measured peak already
        if key not in self._estimates:
            self._estimates[key] = estimate_task_bytes(model, spec, _batch_size(hyper))
            while len(self._estimates) > _KEEP:
                self._estimates.pop(next(iter(self._estimates)))
        self._check(self._estimates[key], f"estimate for {sum(p.numel() for p in model.parameters()):,} "
                                          f"parameters at batch size {_batch_size(hyper)}")

    def _check(self, need: int, how: str) -> None:
        available = self.available()
        if need * self.margin > available:
            raise MemoryRefusal(f"{REFUSAL_PREFIX} this task needs about {human_bytes(need)} ({how}), times "
                                f"{self.margin} for safety, but only {human_bytes(available)} are available on "
                                "this device; give the device more memory or use a smaller model or "
                                "train.batch_size")

    def measured(self, spec: Mapping[str, Any], hyper: Mapping[str, Any], peak_rss: Any) -> None:
        """A task on ``spec`` ran with this peak resident memory (the profile's ``peak_rss_bytes``)."""
        if isinstance(peak_rss, int) and peak_rss > 0:
            self._peaks[self.key(spec, hyper)] = peak_rss
            while len(self._peaks) > _KEEP:
                self._peaks.pop(next(iter(self._peaks)))


def _batch_size(hyper: Mapping[str, Any]) -> int:
    """The task's batch size; the training default when it names none (an evaluation, a method's own
    objective with other keys)."""
    value = hyper.get("batch_size")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else TrainHyper().batch_size
