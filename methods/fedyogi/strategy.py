"""FedYogi (Reddi et al., 2021): Yogi on the server, over the clients' mean update."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from coordinator.strategies.server import AdaptiveSection, AdaptiveServer

__all__ = ["FedYogi", "FedYogiSection"]


@dataclass(frozen=True)
class FedYogiSection(AdaptiveSection):
    """``[fedyogi]``: the server's Yogi step (run.strategy = "fedyogi")."""

    section: ClassVar[str] = "fedyogi"


class FedYogi(AdaptiveServer):
    name = "fedyogi"
    section = "fedyogi"

    def second_moment(self, v: torch.Tensor, square: torch.Tensor) -> torch.Tensor:
        """Moves toward the squared update by a fixed fraction of it, in the direction of the gap:
        unlike Adam's average, a sudden large update cannot shrink the step of every coordinate at once."""
        return v - (1 - self.settings.beta2) * square * torch.sign(v - square)
