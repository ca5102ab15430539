"""The ``[fedavgm]`` config section, apart from the server step's code (which imports torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.config import RunConfig

__all__ = ["FedAvgMSection"]


@dataclass(frozen=True)
class FedAvgMSection:
    """``[fedavgm]``: the server's momentum step (server.optimizer = "fedavgm", or run.strategy = "fedavgm").
    With lr 1 and momentum 0 it is FedAvg's step."""

    lr: float = 1.0         # the server learning rate
    momentum: float = 0.9   # the server momentum (beta)

    def checks(self, config: RunConfig) -> list[tuple[bool, str]]:
        return [(self.lr > 0, f"fedavgm.lr (the server learning rate) must be > 0, got {self.lr}"),
                (0 <= self.momentum < 1, f"fedavgm.momentum must be in [0, 1), got {self.momentum}")]
