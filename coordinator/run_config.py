"""The resolved run configuration: one frozen dataclass per section, the methods' own sections beside them.

Read, overridden and checked by :mod:`coordinator.config`; kept apart so that the checks
(:mod:`coordinator.config_checks`) can name it without importing the reader that calls them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from coordinator.config_sections import (AggregateSection, AppSection, AsyncSection, CheckpointSection,
                                         ClientsSection, CodecSection, DataSection, EvalSection, ExportSection,
                                         MetricsSection, PrivacySection, RunSection, ScheduleSection, SecAggSection, SelectionSection,
                                         ServerSection,
                                         SimSection, TrainSection, TransportSection, WorkersSection)
from coordinator.methods import method, method_sections
from edge_client.registry import Capabilities

__all__ = ["RunConfig", "FIELD_OF"]

FIELD_OF = {"async": "asynchronous"}   # sections whose name is a Python keyword -> their RunConfig field


@dataclass(frozen=True)
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    server: ServerSection = field(default_factory=ServerSection)
    model: dict[str, Any] = field(default_factory=lambda: {"name": "cnn"})
    app: AppSection = field(default_factory=AppSection)
    data: DataSection = field(default_factory=DataSection)
    clients: ClientsSection = field(default_factory=ClientsSection)
    train: TrainSection = field(default_factory=TrainSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    transport: TransportSection = field(default_factory=TransportSection)
    codec: CodecSection = field(default_factory=CodecSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)
    export: ExportSection = field(default_factory=ExportSection)
    sim: SimSection = field(default_factory=SimSection)
    aggregate: AggregateSection = field(default_factory=AggregateSection)
    workers: WorkersSection = field(default_factory=WorkersSection)
    asynchronous: AsyncSection = field(default_factory=AsyncSection)   # the [async] section
    selection: SelectionSection = field(default_factory=SelectionSection)
    privacy: PrivacySection = field(default_factory=PrivacySection)
    secagg: SecAggSection = field(default_factory=SecAggSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    # The methods' own sections (name -> dataclass), read as attributes: ``config.fedprox.mu``.
    methods: Mapping[str, Any] = field(default_factory=lambda: {k: cls() for k, cls in method_sections().items()})
    # "section.key" the user set (file or flags): a method's defaults never override these.
    explicit: frozenset[str] = field(default=frozenset(), compare=False)

    def __getattr__(self, name: str) -> Any:
        if name in FIELD_OF:
            return getattr(self, FIELD_OF[name])
        methods = self.__dict__.get("methods", {})
        if name in methods:
            return methods[name]
        raise AttributeError(f"{type(self).__name__} has no section {name!r}")

    def setting(self, key: str) -> Any:
        """The value of ``"section.key"`` (``"privacy.mode"``, ``"model.head"``: None when unset), for
        declarations that name a setting (edge_client.registry.Condition)."""
        section, _, name = key.partition(".")
        holder = getattr(self, section)
        return holder.get(name) if isinstance(holder, Mapping) else getattr(holder, name)

    @property
    def capabilities(self) -> Capabilities:
        """What the configured strategy can run with: its entry's declaration under these settings."""
        return method(self.run.strategy).capabilities.under(self.setting)

    @property
    def selected_per_round(self) -> int:
        return self.clients.per_round or self.clients.expected

    @property
    def required_results(self) -> int:
        return self.clients.min_results or self.selected_per_round

    @property
    def over_selected_per_round(self) -> int:
        """``selected_per_round`` times ``clients.over_select``, rounded up: what over-selection asks to draw."""
        return math.ceil(self.selected_per_round * self.clients.over_select - 1e-9)

    @property
    def drawn_per_round(self) -> int:
        """The devices a sampled phase gives tasks to: :attr:`over_selected_per_round`, at most ``clients.expected``;
        the phase closes once ``selected_per_round`` results are in."""
        return min(self.clients.expected, self.over_selected_per_round)

    @property
    def closes_early(self) -> bool:
        """Whether sampled phases draw more devices than they count and close at ``selected_per_round`` results."""
        return self.drawn_per_round > self.selected_per_round
