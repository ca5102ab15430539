"""What the parts of the round engine share about the round in progress.

One :class:`RoundBook` per attempt at a phase of a round: the tasks given, the results
taken, what the aggregation workers hold, the bytes moved. The intake fills it, the task
sender and the worker exchange add to it, the round loop reads it. :class:`RoundNotes`
lasts a whole round (all its phases and attempts): why clients failed or were refused,
and the bytes each client moved, for the row and for the error that ends a run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from coordinator.strategies.base import ClientResult, TaskPlan
from edge_client.objectives import DIVERGED
from edge_client.wire.protocol import ManifestBody

__all__ = ["COUNTERS", "Network", "Tally", "SentModel", "RoundBook", "RoundNotes"]

COUNTERS = ("late", "rejected", "duplicates", "unexpected", "failed")   # outcomes counted in the row
# What to try when the global model diverged, whoever noticed it
_DIVERGED_FIX = ("the cause is a hostile or broken update (set aggregate.rule or aggregate.norm_bound, "
                 "docs/robustness.md) or a learning rate too high (lower train.lr); resume from an earlier "
                 "checkpoint once fixed")


@dataclass(frozen=True)
class Network:
    """The network results are checked against: the global state's model spec and its tensor shapes."""

    spec: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]


@dataclass
class Tally:
    """Outcomes and bytes of one attempt, or summed over a phase's attempts or a round's phases."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    bytes_down: int = 0
    bytes_up: int = 0
    bytes_broadcast: int = 0
    worker_lost: int = 0   # results acknowledged but lost with a worker's partial sum
    # Delta broadcasts (codec.down_delta): the delta broadcasts' bytes (also in bytes_broadcast), how each answering
    # device came by its model (MODEL_FROM: model_from_delta, model_from_no_base, ...) and what those fetches
    # cost together (bytes_fetched: the full or the delta broadcast per device, nothing for one that held it).
    bytes_delta: int = 0
    model_from: dict[str, int] = field(default_factory=dict)
    bytes_fetched: int = 0

    def add(self, other: Tally) -> None:
        for key, value in other.counts.items():
            self.counts[key] = self.counts.get(key, 0) + value
        self.bytes_down += other.bytes_down
        self.bytes_up += other.bytes_up
        self.bytes_broadcast += other.bytes_broadcast
        self.worker_lost += other.worker_lost
        self.bytes_delta += other.bytes_delta
        for key, value in other.model_from.items():
            self.model_from[key] = self.model_from.get(key, 0) + value
        self.bytes_fetched += other.bytes_fetched

    def fetched(self, model_from: str | None, sent: SentModel | None) -> None:
        """Count how one device came by the exchange's broadcast ``sent`` (a result's ``model_from``), and its bytes."""
        if model_from is None or sent is None:
            return
        self.model_from[model_from] = self.model_from.get(model_from, 0) + 1
        self.bytes_fetched += {"held": 0, "delta": sent.delta_bytes}.get(model_from, sent.full_bytes)

    def carried(self) -> Tally:
        """What strays between two exchanges leave to the next one: their counts and the bytes they came in."""
        return Tally(counts=dict(self.counts), bytes_up=self.bytes_up)

    def row(self) -> dict[str, int]:
        """The row's columns; ``worker_lost`` only when a worker lost results (runs without workers lack it)."""
        row = {**self.counts, "bytes_down": self.bytes_down, "bytes_up": self.bytes_up,
               "bytes_broadcast": self.bytes_broadcast}
        if self.worker_lost:
            row["worker_lost"] = self.worker_lost
        if self.bytes_delta or self.model_from:   # delta broadcasts (codec.down_delta) only
            row.update({"bytes_broadcast_delta": self.bytes_delta, "bytes_fetched": self.bytes_fetched,
                        **{f"model_from_{k}": v for k, v in sorted(self.model_from.items())}})
        return row


@dataclass(frozen=True)
class SentModel:
    """An exchange's model broadcast with delta broadcasts on (``codec.down_delta``): what its tasks name beside
    its hash, and the bytes a device fetches either way."""

    model_digest: str          # the digest of the model it carries (edge_client.wire.model_delta.model_digest)
    delta: str | None          # the SHA-256 of the delta broadcast that rebuilds it; None: full only this time
    base: str | None           # ... and the digest of the model that delta applies to
    full_bytes: int
    delta_bytes: int


@dataclass
class RoundBook:
    """Book-keeping for one attempt at one phase of a round (``attempt`` -1: between exchanges, collecting strays)."""

    round: int
    attempt: int
    phase: str = "train"
    streaming: bool = False        # results are folded into ``partial`` on arrival and their tensors dropped
    partial: Any = None            # the strategy's partial aggregate of the results so far (streaming only)
    # aggregate.order = "sorted": decoded results waiting to be folded until no client before them (by id) can
    # still answer (client id -> result, also in ``results``); ``held_peak``: the most held at once.
    held: dict[str, ClientResult] = field(default_factory=dict)
    held_peak: int = 0
    plans: dict[str, TaskPlan] = field(default_factory=dict)       # task id -> plan
    results: dict[str, ClientResult] = field(default_factory=dict)  # client id -> result (no tensors if streaming)
    # Clients whose answer to the task the attempt waits for brought no result: an error, or a result refused
    # with ``rejected``. Either way the device was told and sends nothing more for that task.
    failed: set[str] = field(default_factory=set)
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)               # left out by deadline selection
    carried: set[str] = field(default_factory=set)   # clients still working on an earlier attempt's task, waited for
    wait: float = 0.0                                 # seconds the attempt waits (0: not set, clients.round_timeout)
    # Over-selection (clients.over_select): the attempt closes once this many results are in (0: it waits for every
    # client), and the clients it then stopped waiting for, each told its task closed (their results count as late).
    close_at: int = 0
    closed: set[str] = field(default_factory=set)
    told_closed: bool = False   # the closing is done (a secure round closes its advertise stage, not its end)
    opened: float = field(default_factory=time.monotonic)   # when the attempt began
    tally: Tally = field(default_factory=Tally)
    # With aggregation workers: the exchange's id in their manifest, and the results a worker holds
    # folded whose partial sum has not arrived (task id -> (worker, the result without tensors)).
    manifest: ManifestBody | None = None
    granted: dict[str, tuple[str, ClientResult]] = field(default_factory=dict)
    shared: frozenset[str] = frozenset()   # the tensors the tasks leave to the model broadcast
    broadcast: str | None = None           # ... and its hash
    sent_model: SentModel | None = None    # ... and, with delta broadcasts, its delta
    columns: dict[str, Any] = field(default_factory=dict)   # what the phase adds to the row (a secure round's)

    @property
    def waiting_for(self) -> set[str]:
        """The clients the attempt waits for: those given a task now, and those still working on the task
        an earlier attempt of the round gave them (a new task would only queue behind it)."""
        return {plan.client_id for plan in self.plans.values()} | self.carried

    @property
    def selected(self) -> set[str]:
        """The clients this attempt counts on: those it waits for and those whose result it already holds
        (taken in an earlier attempt of the round, on the same global state)."""
        return self.waiting_for | self.results.keys()

    @property
    def complete(self) -> bool:
        """Every client has answered (a result, an error, or a result the intake refused and said so: waiting
        on would only burn the deadline)."""
        return self.waiting_for <= self.results.keys() | self.failed

    @property
    def answered(self) -> bool:
        """Every client has answered, counting results an aggregation worker folded but has not sent yet."""
        return self.waiting_for <= self.answered_by

    @property
    def enough(self) -> bool:
        """An over-selected attempt has the results it counts (those a worker folded included): it closes now."""
        return bool(self.close_at) and len(self.results) + len(self.granted) >= self.close_at

    @property
    def answered_by(self) -> set[str]:
        """The clients with an answer in this attempt: a result, an error, or a result a worker holds."""
        held = {result.client_id for _, result in self.granted.values()}
        return self.results.keys() | self.failed | held


@dataclass
class RoundNotes:
    """What a round's clients said and moved over all its phases and attempts."""

    failures: dict[str, str] = field(default_factory=dict)     # client -> why it could not run its task
    rejections: dict[str, str] = field(default_factory=dict)   # client -> why its last result was rejected
    client_bytes: dict[str, dict[str, int]] = field(default_factory=dict)   # client id -> down/up bytes

    def add_bytes(self, client_id: str, direction: str, n: int) -> None:
        self.client_bytes.setdefault(client_id, {"down": 0, "up": 0})[direction] += n

    def bytes_per_client(self) -> dict[str, dict[str, int]]:
        return {k: self.client_bytes[k] for k in sorted(self.client_bytes)}

    def diverged(self) -> list[tuple[str, str]]:
        """(client, why) of every failure and rejection of the round, sorted, when each of them says the client's
        training diverged (a non-finite loss or update); [] when there is none or another reason among them."""
        said = sorted([*self.failures.items(), *self.rejections.items()])
        return said if said and all(_says_diverged(why) for _, why in said) else []

    def why_too_few(self) -> str:
        """What the round's clients said or sent, which explains a round without enough results better
        than the timeout does."""
        said = "; ".join(f"{cid}: {why}" for cid, why in sorted(self.failures.items())[:3])
        rejected = sorted(self.rejections.items())
        diverged = sorted((cid, why) for cid, why in self.failures.items() if DIVERGED in why)
        if diverged:
            return (f"the global model this round started from has diverged: training it gave {len(diverged)} "
                    f"client(s) infinite or NaN values; {_DIVERGED_FIX} (first: {diverged[0][0]}: {diverged[0][1]})")
        if rejected and all(_says_diverged(why) for _, why in rejected):
            return (f"the results of {len(rejected)} client(s) held NaN or infinite values, which is what training "
                    f"a diverged global model gives; {_DIVERGED_FIX} (first: {rejected[0][0]}: {rejected[0][1]})")
        if said:
            return f"the clients said: {said}"
        if rejected:
            shown = "; ".join(f"{cid}: {why}" for cid, why in rejected[:3])
            return f"results were rejected: {shown}"
        return "check the clients' logs, raise clients.round_timeout or lower clients.min_results"


# How a device's failure or a rejected result reads when training diverged: the device's own objective and clipping
# say so (edge_client/objectives.py, edge_client/privacy.py), the intake's checks name the non-finite values, and a
# device whose metrics overflowed cannot encode its result (edge_client/wire/envelope.py).
_DIVERGED = ("diverged", "non-finite", "not finite", "NaN or infinite", "not plain finite JSON")


def _says_diverged(why: str) -> bool:
    return any(marker in why for marker in _DIVERGED)
