"""The ``[fedyogi]`` config section, apart from the server step's code (which imports torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from coordinator.strategies.settings import AdaptiveSection

__all__ = ["FedYogiSection"]


@dataclass(frozen=True)
class FedYogiSection(AdaptiveSection):
    """``[fedyogi]``: the server's Yogi step (server.optimizer = "fedyogi", or run.strategy = "fedyogi")."""

    section: ClassVar[str] = "fedyogi"
