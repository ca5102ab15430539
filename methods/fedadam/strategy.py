"""FedAdam (Reddi et al., 2021): Adam on the server, over the clients' mean update."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from coordinator.strategies.server import AdaptiveSection, AdaptiveServer

__all__ = ["FedAdam", "FedAdamSection"]


@dataclass(frozen=True)
class FedAdamSection(AdaptiveSection):
    """``[fedadam]``: the server's Adam step (run.strategy = "fedadam")."""

    section: ClassVar[str] = "fedadam"


class FedAdam(AdaptiveServer):
    name = "fedadam"
    section = "fedadam"

    def second_moment(self, v: torch.Tensor, square: torch.Tensor) -> torch.Tensor:
        """An exponential average of the squared update."""
        b = self.settings.beta2
        return b * v + (1 - b) * square
