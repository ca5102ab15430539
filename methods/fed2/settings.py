"""The ``[fed2]`` config section, apart from the strategy (which imports torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.config import RunConfig

PAIRINGS = ("all", "holders")

__all__ = ["Fed2Section", "PAIRINGS"]


@dataclass(frozen=True)
class Fed2Section:
    """``[fed2]``: Fed2's class-to-group allocation (run.strategy = "fed2"); docs/fed2.md."""

    allocation: list[int] = field(default_factory=list)   # group of each class; empty: class c to group c mod G,
                                    # e.g. [0, 0, 1, 1, 2, 2, 3, 3, 4, 4] with 5 groups; G is model.fed2_groups;
                                    # every group needs a class
    pairing: str = "all"            # "all": each group over every client; "holders": over its classes' holders.
                                # all: sample-weighted over every client of the round (the paper's pairing when the
                                # allocation is fixed); holders: group g weighted by each client's samples of g's
                                # classes, clients without them skipped (devices then report their label histograms;
                                # diverges under label skew: docs/fed2.md)

    def checks(self, config: RunConfig) -> list[tuple[bool, str]]:
        return [*self._model_checks(config),
                (all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in self.allocation),
                 "fed2.allocation lists a group index (>= 0) for every class, e.g. [0, 0, 1, 1, 2, ...]"),
                (self.pairing in PAIRINGS, f"fed2.pairing is one of {', '.join(PAIRINGS)}")]

    @staticmethod
    def _model_checks(config: RunConfig) -> list[tuple[bool, str]]:
        """The model Fed2 trains: its grouped classifier, not a fixed head."""
        if config.run.strategy != "fed2":
            return []
        head, groups = config.model.get("head", "linear"), config.model.get("fed2_groups", 0)
        return [(head == "linear", f"fed2 decouples the classifier into class groups; model.head = {head!r} "
                                   "replaces it with a fixed one: remove model.head (or use run.strategy = spherefed)"),
                (isinstance(groups, int) and not isinstance(groups, bool) and groups >= 1,
                 f"fed2 needs the Fed2 structure: model.fed2_groups >= 1 (leave it unset for 10), got {groups!r}")]
