"""A secure round's training phase: four exchanges of tasks and results instead of one, and only the sum.

With ``[secagg] enabled = true`` the engine hands the training phase's plans here
(:meth:`SecureRound.run`). Each stage is an ordinary exchange (tasks on each device's own task
topic, results through the intake), carrying the ``secagg`` objects of
:mod:`edge_client.secagg.stages`:

1. ``advertise``: the training task with the round's parameters; each device trains, keeps its
   weighted update and answers with its public keys;
2. ``share``: every advertised key; each device answers with its sealed shares;
3. ``mask``: each device's own forwarded shares; it answers with its masked vector;
4. ``unmask``: the survivors and the dropped; each survivor answers with its shares.

``aggregate`` then gives the sum of the survivors' vectors, which becomes the phase's partial
aggregate (a :class:`WeightedSum`, as streaming FedAvg folds): the strategy's own aggregation,
central DP's noise and the server optimizers run on it unchanged. Masked vectors are held until
the unmask stage (they look uniform; nothing is revealed by holding them). A round that cannot be
unmasked (too few devices advertised, shared, masked or answered) keeps no result: nothing is
released, and the engine retries it as it retries a round with too few results.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from coordinator.runtime.round_book import Network, RoundBook
from coordinator.runtime.tasks import TaskSender
from coordinator.strategies.base import ClientResult, TaskPlan, WeightedSum
from edge_client.secagg import (Advertise, MaskedInput, MaskedSum, PublicKeys, SecAggParams, ShareBundle,
                                UnmaskRequest, UnmaskResponse, aggregate, check_share_bundle, check_unmask_response,
                                collect_keys, request_unmask, route_shares)
from edge_client.secagg import masking
from edge_client.secagg.errors import MessageError, SecAggError
from edge_client.secagg.stages import TAIL, StageReply, StageTask, split_sum
from edge_client.wire.protocol import Message, ProtocolError, ResultBody

if TYPE_CHECKING:
    from coordinator.config import RunConfig
    from coordinator.runtime.intake import ResultIntake
    from coordinator.runtime.presence import Roster

__all__ = ["SecureRound", "round_params"]

log = logging.getLogger("fedge.coordinator")
OBJECTIVE = "secagg"   # the objective of the share, mask and unmask tasks (their round times are kept apart)


def round_params(config: RunConfig, round_id: int, num_clients: int, length: int, clip: float) -> SecAggParams:
    """The round's parameters: the configured degree and threshold (or the suggested ones), the finest scale
    at which ``num_clients`` vectors within ``clip`` sum without wrapping, a graph seed from os entropy."""
    s = config.secagg
    degree, threshold = s.degree_and_threshold(num_clients)
    return SecAggParams(round_id=round_id, num_clients=num_clients, degree=degree, threshold=threshold,
                        length=length, clip=clip, scale=masking.largest_scale(num_clients, clip, s.bits),
                        bits=s.bits, graph_seed=os.urandom(32))


class SecureRound:
    """Runs the four exchanges of a secure training phase through the engine's parts."""

    def __init__(self, config: RunConfig, *, intake: ResultIntake, tasks: TaskSender, roster: Roster,
                 network: Callable[[], Network], pump: Callable[..., None],
                 await_answers: Callable[[RoundBook], None]) -> None:
        self.config = config
        self.intake = intake
        self.tasks = tasks
        self.roster = roster
        self.network = network
        self.pump = pump
        self.await_answers = await_answers
        self.params: SecAggParams | None = None
        self.ids: dict[str, int] = {}
        self.replies: dict[int, Any] = {}          # device id -> its message of the stage in progress
        self.keys: PublicKeys | None = None
        self.members: frozenset[int] = frozenset()
        self.masked: MaskedSum | None = None   # the mask stage's inputs, added as they come
        self.request: UnmaskRequest | None = None
        intake.secure = self.on_answer

    # -- results ------------------------------------------------------------------------------
    def on_answer(self, plan: TaskPlan, msg: Message, body: ResultBody) -> ClientResult:
        """One stage result, checked against the round (the core's ``check_*``); ProtocolError refuses it
        (counted, logged and answered ``rejected`` by the intake, never raised further)."""
        if body.error is not None:
            raise ProtocolError(f"client could not run the task: {body.error}")
        params, stage = self.params, (plan.secagg or {}).get("stage")
        if params is None or plan.secagg.get("params", {}).get("round_id") != params.round_id:
            raise MessageError("a secure-aggregation result of a round that is over")
        if body.secagg is None:
            raise MessageError(f"a result to a secure {stage} task must carry a secagg object")
        me = self.ids[plan.client_id]
        message = StageReply.from_body(body.secagg, stage, params, msg.tensors).message
        if getattr(message, "sender", me) != me:
            raise MessageError(f"its secagg message says it is from device {message.sender}; this device is {me}")
        if isinstance(message, Advertise) and message.round_id != params.round_id:
            raise MessageError(f"its advertisement is for round {message.round_id}, this is {params.round_id}")
        if isinstance(message, ShareBundle):
            check_share_bundle(params, self.keys, message)
        elif isinstance(message, MaskedInput):
            self.masked.add(message)   # checked and added now: no vector is held until unmask
            message = dataclasses.replace(message, vector=b"")
        elif isinstance(message, UnmaskResponse):
            check_unmask_response(params, self.request, message)
        if me in self.replies:
            raise MessageError(f"a second {stage} message from device {me} in one round")
        self.replies[me] = message
        return ClientResult(plan.client_id, body.num_samples, {}, {})

    # -- the round ----------------------------------------------------------------------------------
    def run(self, book: RoundBook, plans: list[TaskPlan]) -> None:
        """The secure training phase of ``book``'s attempt: on success ``book.results`` holds the survivors
        (no tensors) and ``book.partial`` their sum; on failure both stay empty. ``book.columns`` gets the
        ``secagg_*`` columns either way."""
        book.carried = set()   # a device busy with an earlier attempt's task holds no key of this one
        started = time.monotonic()
        names = list(plans[0].up)
        shapes = self.network().shapes
        clip = plans[0].clip_norm if plans[0].clip_norm is not None else self.config.secagg.clip
        self.ids = {cid: i for i, cid in enumerate(sorted(p.client_id for p in plans))}
        try:
            self.params = round_params(self.config, (book.round << 16) | book.attempt, len(plans),
                                       sum(math.prod(shapes[n]) for n in names) + TAIL, clip)
            unit = 0.0 if plans[0].clip_norm is not None else self._weight_unit(book, plans)
            book.columns = self._columns()
            self.replies = {}
            self.tasks.send_all(book, [replace(p, secagg=self._task("advertise", p.client_id, unit))
                                       for p in plans])
            self.await_answers(book)
            if book.enough:   # over-selected: the devices still training are told now; the cohort is who advertised
                self.intake.close_rest(book)
            self._stage_end(book, "advertise", started)
            self._finish(book, self._rest(book, unit), names, shapes)
        except SecAggError as exc:
            log.warning("round %d attempt %d: the secure round fails, no sum is released: %s", book.round,
                        book.attempt + 1, exc)
            self.intake.notes.failures["secure aggregation"] = str(exc)
            self._back(book)
            book.results, book.partial = {}, None
        finally:
            self.params = None
            book.columns["secagg_seconds"] = round(time.monotonic() - started, 3)

    def _rest(self, book: RoundBook, unit: float) -> Any:
        """Stages share, mask and unmask; the aggregate."""
        p = self.params
        adverts = [m for _, m in sorted(self.replies.items())]
        self.keys = collect_keys(p, adverts)
        sent = self._exchange(book, "share", {i: self.keys for i in self.keys.keys}, unit)
        forwarded = route_shares(p, self.keys, sent.values())
        self.members = frozenset(forwarded)
        self.masked = MaskedSum(p, self.members)
        self._exchange(book, "mask", forwarded, unit)
        self.request = request_unmask(p, self.members, self.masked)
        answers = self._exchange(book, "unmask", {i: self.request for i in self.request.survivors}, unit)
        book.columns.update({"secagg_survivors": len(self.request.survivors),
                             "secagg_dropped": len(self.request.dropped)})
        return aggregate(p, self.keys, self.request, self.masked, answers.values())

    def _exchange(self, book: RoundBook, stage: str, asked: dict[int, Any], unit: float) -> dict[int, Any]:
        """One stage: a task to each device in ``asked`` (by id) with its message, answers until all came or
        ``secagg.stage_timeout``; the messages that came, by id."""
        started = time.monotonic()
        by_id = {i: cid for cid, i in self.ids.items()}
        stage_book = self.intake.open(RoundBook(round=book.round, attempt=book.attempt, phase=f"secagg-{stage}"))
        self.replies = {}
        plans = [TaskPlan(client_id=by_id[i], objective=OBJECTIVE, hyper={}, down={}, up=[],
                          secagg=self._task(stage, by_id[i], unit, message)) for i, message in sorted(asked.items())]
        self.tasks.send_all(stage_book, plans, broadcast=False)
        self.pump(started + self.config.secagg.stage_timeout, lambda: stage_book.answered)
        self.intake.close(stage_book)
        book.tally.add(stage_book.tally)
        self._stage_end(stage_book, stage, started)
        book.columns.update({k: v for k, v in stage_book.columns.items()})
        return dict(sorted(self.replies.items()))

    def _stage_end(self, book: RoundBook, stage: str, started: float) -> None:
        book.columns.update({f"secagg_{stage}_seconds": round(time.monotonic() - started, 3),
                             f"secagg_{stage}_answers": len(self.replies),
                             f"secagg_{stage}_bytes_down": book.tally.bytes_down,
                             f"secagg_{stage}_bytes_up": book.tally.bytes_up})

    def _finish(self, book: RoundBook, total: Any, names: list[str], shapes: dict[str, tuple[int, ...]]) -> None:
        """The sum as the phase's partial aggregate, and the survivors as its results (counts, no tensors)."""
        self._back(book)
        advertised = {cid: r for cid, r in book.results.items()}
        parts = split_sum(total.values, [(n, shapes[n]) for n in names], self.params.clip)
        if not parts.weight > 0:
            raise MessageError(f"the summed weight is {parts.weight}: the devices' vectors are not what they "
                               "must be")
        by_id = {i: cid for cid, i in self.ids.items()}
        survivors = [by_id[i] for i in total.survivors]
        book.results = {cid: ClientResult(cid, advertised[cid].num_samples, {},
                                          {"train_loss": parts.loss, "clipped": float(k < parts.clipped)})
                        for k, cid in enumerate(survivors)}
        book.partial = WeightedSum({k: v.to(torch.float64) for k, v in parts.sums.items()}, parts.weight)

    # -- helpers ------------------------------------------------------------------------------------------
    def _back(self, book: RoundBook) -> None:
        """Results go to the attempt's book again (strays of the stages are late from now on)."""
        if self.intake.book is not book:
            self.intake.open(book)

    def _task(self, stage: str, client_id: str, unit: float, message: Any = None) -> dict[str, Any]:
        return StageTask(stage, self.params, self.ids[client_id], unit, message).to_body()

    def _weight_unit(self, book: RoundBook, plans: list[TaskPlan]) -> float:
        """The largest sample count the selected devices announced, within the run's weight bound (the
        intake's): each device's weight is its count over it, at most 1, so the weights fit the clip, and a
        device announcing more than the bound weighs as the bound. 0 (equal weights) when one announced none."""
        counts = [self.roster.announced_samples(p.client_id) for p in plans]
        known = [c for c in counts if c]
        if len(known) < len(counts):
            log.warning("secure round: %d of %d devices announced no sample count; all weigh the same this round",
                        len(counts) - len(known), len(counts))
            return 0.0
        limit, source = self.intake.weights.limit()
        if limit is None or max(known) <= limit:
            return float(max(known))
        capped = sorted(p.client_id for p, c in zip(plans, counts) if c > limit)
        book.tally.counts["weight_capped"] = book.tally.counts.get("weight_capped", 0) + len(capped)
        log.warning("secure round: %s announced more than the weight bound of %s samples (%s): each weighs as that",
                    ", ".join(capped), f"{limit:,}", source)
        return float(limit)

    def _columns(self) -> dict[str, Any]:
        p = self.params
        return {"secagg_clients": p.num_clients, "secagg_degree": p.effective_degree, "secagg_threshold": p.threshold,
                "secagg_bits": p.bits, "secagg_length": p.length}
