"""The ``[fedma]`` config section, apart from the strategy (which imports torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.config import RunConfig

__all__ = ["FedmaSection"]


@dataclass(frozen=True)
class FedmaSection:
    """``[fedma]``: FedMA's matching and retraining (run.strategy = "fedma"); docs/fedma.md."""

    retrain_epochs: int = 1        # epochs of the layers above the matched ones in phases 2 .. L-1; the classifier
                                   # phase trains 3x as many at train.lr / 10, phase 1 trains train.epochs
    max_growth: float = 1.5        # a matched layer holds at most this multiple of its first width
    sweeps: int = 5                # rematching sweeps in random client order
    sigma: float = 1.0             # client neurons' noise (precision 1 / sigma)
    sigma0: float = 1.0            # prior spread of a global neuron
    gamma: float = 7.0             # how readily new global neurons open (the matching: docs/fedma.md, "Matching")

    def checks(self, config: RunConfig) -> list[tuple[bool, str]]:
        return [*self._run_checks(config),
                (self.retrain_epochs >= 1 and self.sweeps >= 0, "fedma.retrain_epochs >= 1, fedma.sweeps >= 0"),
                (self.max_growth >= 1.0, "fedma.max_growth is a multiple of a layer's width, >= 1"),
                (min(self.sigma, self.sigma0, self.gamma) > 0, "fedma.sigma, fedma.sigma0 and fedma.gamma must be > 0")]

    @staticmethod
    def _run_checks(config: RunConfig) -> list[tuple[bool, str]]:
        """What FedMA cannot match: neurons tied to positions or classes, layers a top-k codec zeroed. (A pass's
        length in rounds needs the network's layers, so the strategy checks run.rounds when it is built.)"""
        if config.run.strategy != "fedma":
            return []
        model = config.model
        return [*((model.get(key, plain) == plain, f"fedma matches neurons by their weights alone; model.{key} = "
                                                    f"{model.get(key)!r} ties them to positions or classes: remove "
                                                    f"model.{key}")
                  for key, plain in (("pan", "none"), ("head", "linear"), ("fed2_groups", 0))),
                ("topk" not in config.codec.up, "fedma matches the layers as the clients send them; a top-k codec.up "
                                                 "zeroes most weights: use fp32, fp16, bf16 or int8")]
