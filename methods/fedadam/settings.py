"""The ``[fedadam]`` config section, apart from the server step's code (which imports torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from coordinator.strategies.settings import AdaptiveSection

__all__ = ["FedAdamSection"]


@dataclass(frozen=True)
class FedAdamSection(AdaptiveSection):
    """``[fedadam]``: the server's Adam step (server.optimizer = "fedadam", or run.strategy = "fedadam")."""

    section: ClassVar[str] = "fedadam"
