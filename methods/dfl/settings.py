"""The ``[dfl]`` config section, apart from the strategy (which imports torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.config import RunConfig

__all__ = ["DflSection", "NAME", "backbone_problem"]

NAME = "dfl"   # its run.strategy and the two-branch model's model.name


@dataclass(frozen=True)
class DflSection:
    """``[dfl]``: disentangled FL (run.strategy = "dfl"); docs/dfl.md."""

    local_epochs: int = 1           # local stage: specific extractor + predictor, invariant frozen; DFL does not
                                # use train.epochs
    global_epochs: int = 1          # global stage: invariant extractor, the rest frozen
    mi_min_weight: float = 1.0      # MI(invariant; specific), minimized
    mi_max_weight: float = 1.0      # MI(invariant; received global invariant), maximized
    specific_width: float = 1.0     # the specific extractor's width relative to the backbone
    mi_hidden: int = 128            # hidden width of the MI critics
    diversity: int = 0              # other clients' specific extractors relayed to each client (0: off, private)
                                # each round; 0 keeps every specific extractor on its device (docs/dfl.md, "What
                                # leaves the device")

    def checks(self, config: RunConfig) -> list[tuple[bool, str]]:
        ours = config.run.strategy == NAME
        return [
            (not ours or config.clients.spawn == 0 or config.data.local_test_fraction > 0,
             "dfl reports personalized accuracy on each client's held-out split: data.local_test_fraction must be "
             "> 0 (leave it unset for dfl's default, 0.2)"),
            (not ours or not backbone_problem(config.model.get("name", "")), backbone_problem(NAME)),
            (min(self.local_epochs, self.global_epochs, self.diversity) >= 0
             and self.local_epochs + self.global_epochs >= 1,
             "dfl.local_epochs and dfl.global_epochs must be >= 0 (not both 0), dfl.diversity >= 0"),
            (min(self.mi_min_weight, self.mi_max_weight) >= 0 and self.specific_width > 0 and self.mi_hidden >= 1,
             "dfl MI weights must be >= 0, dfl.specific_width > 0, dfl.mi_hidden >= 1"),
        ]


def backbone_problem(model_name: str) -> str:
    """What is wrong with ``model.name`` under DFL ("" when nothing): it names the backbone to wrap."""
    if model_name != NAME:
        return ""
    return (f"with run.strategy = {NAME}, set model.name to the backbone (cnn, mlp, vgg9); the strategy builds the "
            "two-branch model around it from the [dfl] settings")
