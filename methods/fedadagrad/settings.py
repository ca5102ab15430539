"""The ``[fedadagrad]`` config section, apart from the server step's code (which imports torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from coordinator.strategies.settings import AdaptiveSection

__all__ = ["FedAdagradSection"]


@dataclass(frozen=True)
class FedAdagradSection(AdaptiveSection):
    """``[fedadagrad]``: the server's Adagrad step (server.optimizer = "fedadagrad", or run.strategy = "fedadagrad"); ``beta2`` is unused."""

    beta1: float = 0.0      # Adagrad keeps no momentum unless asked
    section: ClassVar[str] = "fedadagrad"
