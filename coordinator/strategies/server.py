"""Server optimizers: what the coordinator does with a round's combined update.

An optimizer is a stage of its own (:class:`ServerOptimizer`), not a strategy: any strategy that
combines model deltas into one update and ends its round with ``server_step`` takes any optimizer
(``[server] optimizer``), so FedProx with an adaptive step, or a method's own training with server
momentum, are a setting, not a class. The strategies named after an optimizer are FedAvg
with that optimizer.

FedAvg adds the clients' mean update to the model: a server step of learning rate 1. The
adaptive federated optimizers (Reddi et al., "Adaptive Federated Optimization", ICLR 2021,
Algorithm 2) treat that update as a pseudo-gradient and scale each coordinate by moments
kept across rounds, so coordinates that every round moves the same way get a steadier step
than a noisy client sample gives them. Each optimizer is a plug-in of its own (one folder
under ``methods/``) that only says how its second moment follows the squared update; the
step, the moments' storage and the checks are here, once.

The moments live in ``ServerState.buffers``: checkpointed with the parameters, never sent to
devices, read back on ``--resume``, so a resumed run takes the same steps as an unbroken one.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from coordinator.strategies.settings import AdaptiveSection
from storage.state import ServerState

__all__ = ["AdaptiveSection", "AdaptiveStep", "ServerOptimizer", "PlainStep", "moment"]


def moment(state: ServerState, name: str, like: torch.Tensor, start: float = 0.0) -> torch.Tensor:
    """The buffer ``name`` (float64), or ``start`` everywhere when there is none or the tensor's shape changed."""
    kept = state.buffers.get(name)
    if kept is None or kept.shape != like.shape:
        return torch.full_like(like, start, dtype=torch.float64)
    return kept.to(torch.float64)


class ServerOptimizer:
    """The server's step: the state after a round's combined update (float64, by tensor name).

    A pure function of the state and the update; what it carries between rounds lives in
    ``state.buffers``, checkpointed with the parameters, so a resumed run takes the same steps."""

    name: ClassVar[str] = "fedavg"
    section: ClassVar[str] = ""   # the config section of its settings, "" for none

    def step(self, round: int, state: ServerState, update: dict[str, torch.Tensor]) -> ServerState:
        raise NotImplementedError


class PlainStep(ServerOptimizer):
    """FedAvg's step: the model plus the update (a server learning rate of 1)."""

    def __init__(self, settings: object = None) -> None:
        pass

    def step(self, round: int, state: ServerState, update: dict[str, torch.Tensor]) -> ServerState:
        params = {k: (state.params[k].to(torch.float64) + u).to(torch.float32) for k, u in update.items()}
        return dataclasses.replace(state, round=round, params={**state.params, **params})


class AdaptiveStep(ServerOptimizer):
    """An adaptive step on the combined update ``d``:

    m = beta1 m + (1 - beta1) d;  v = second_moment(v, d^2);  x = x + lr m / (sqrt(v) + tau),

    with m starting at 0 and v at tau^2 (the paper's v_{-1}). Subclasses set ``name``, ``section`` and
    :meth:`second_moment`.
    """

    def __init__(self, settings: AdaptiveSection) -> None:
        self.settings = settings

    def second_moment(self, v: torch.Tensor, square: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def step(self, round: int, state: ServerState, update: dict[str, torch.Tensor]) -> ServerState:
        s = self.settings
        params, buffers = dict(state.params), dict(state.buffers)
        for name, d in update.items():
            m = s.beta1 * moment(state, f"m/{name}", d) + (1 - s.beta1) * d
            v = self.second_moment(moment(state, f"v/{name}", d, s.tau ** 2), d * d)
            params[name] = (state.params[name].to(torch.float64) + s.lr * m / (v.sqrt() + s.tau)).to(torch.float32)
            buffers[f"m/{name}"], buffers[f"v/{name}"] = m, v
        return dataclasses.replace(state, round=round, params=params, buffers=buffers)
