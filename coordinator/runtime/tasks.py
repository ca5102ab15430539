"""Sending an exchange's tasks: one new task id per selected client, each task in its own message.

What every task would carry with the same values goes once, as the model broadcast
(``codec.broadcast``); with aggregation workers the manifest goes before the tasks, so a
worker knows a task before its result can reach it. A task its device has not answered
goes again, under its id, when the device announces itself online: after a reconnect
its subscriptions are back, and a broker that restarted without persistence (or a session
that expired) lost the task it had not delivered, which would cost the attempt its whole
timeout. A device that did get the task answers the copy with the result it already has.
Only once per ``clients.presence_interval``, though: a device re-announcing itself in a loop
(a broken client, or a hostile one) would otherwise make the coordinator send its task, a
model's worth of bytes, once per presence; presences inside the interval re-send nothing and
are counted (``presence_ignored`` in the round's row).
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from coordinator.runtime.broadcast import Broadcast
from coordinator.runtime.downlink import Downlink, shared_tensors
from coordinator.runtime.intake import ResultIntake
from coordinator.runtime.round_book import Network, RoundBook
from coordinator.strategies.base import TaskPlan
from coordinator.runtime.worker_exchange import WorkerExchange
from edge_client.wire.protocol import TaskBody, Topics

if TYPE_CHECKING:
    from coordinator.config import RunConfig
    from coordinator.runtime.outbox import Outbox

__all__ = ["TaskSender", "new_task_ids"]

log = logging.getLogger("fedge.coordinator")
_MAX_RESENT = 10_000   # tasks whose last re-send on presence is remembered


def new_task_ids(count: int) -> list[str]:
    """Ids for ``count`` new tasks: random, so a resumed run's never meet a stopped one's."""
    return [uuid.uuid4().hex[:16] for _ in range(count)]


class TaskSender:
    """Publishes the tasks of each exchange, with the broadcast and the manifest they depend on."""

    def __init__(self, config: RunConfig, *, outbox: Outbox, topics: Topics, downlink: Downlink,
                 broadcast: Broadcast, workers: WorkerExchange, intake: ResultIntake,
                 network: Callable[[], Network]) -> None:
        self.config = config
        self.outbox = outbox
        self.topics = topics
        self.downlink = downlink
        self.broadcast = broadcast
        self.workers = workers
        self.intake = intake
        self.network = network
        self._resent: OrderedDict[str, float] = OrderedDict()   # task id -> when a presence last re-sent it

    def send_all(self, book: RoundBook, plans: list[TaskPlan], *, broadcast: bool = True,
                 task_ids: list[str] | None = None) -> list[str]:
        """The exchange's tasks, after the broadcast they share and (with workers) the manifest; their ids.
        ``broadcast=False``: each task carries all its tensors (asynchronous versions outlive a broadcast);
        ``task_ids``: ids the caller chose (:func:`new_task_ids`, journaled before they go), else new ones."""
        shared = shared_tensors(plans) if self.config.codec.broadcast and broadcast else {}
        digest = self.broadcast.publish_model(book, shared) if shared else ""
        self.outbox.transport.prefer(self.topics.client(plan.client_id, "result") for plan in plans)
        task_ids = task_ids or new_task_ids(len(plans))
        if self.config.workers.count and plans:   # the workers learn the tasks before any result can come
            self.workers.open(book, plans, task_ids, self.downlink.upload_codec(plans[0]), digest or None)
        book.shared, book.broadcast = frozenset(shared), digest or None
        for task_id, plan in zip(task_ids, plans):
            self.intake.issued(book, task_id, plan)
            self.send(book, task_id, plan)
        return task_ids

    def send(self, book: RoundBook, task_id: str, plan: TaskPlan) -> None:
        """One client's task message: its own tensors, the broadcast named by hash."""
        c = self.config.clients
        body = TaskBody(objective=plan.objective, model=self.network().spec if plan.model is None else plan.model,
                        up=tuple(plan.up), hyper=plan.hyper, upload=self.downlink.upload(plan),
                        codec=self.downlink.spec, broadcast=book.broadcast, seed=self.config.run.seed,
                        timeout=c.round_timeout, resend_every=c.resend_every, deadline=time.time() + c.round_timeout,
                        session=self.broadcast.session, secagg=plan.secagg,
                        **_delta_fields(book))
        own = {k: v for k, v in plan.down.items() if k not in book.shared}
        sent = self.outbox.publish(self.topics.client(plan.client_id, "task"),
                                   self.downlink.task(book.round, task_id, body, own))
        book.tally.bytes_down += sent
        self.intake.notes.add_bytes(plan.client_id, "down", sent)

    def resend_unanswered(self, book: RoundBook, client_id: str, now: float | None = None) -> None:
        """Send the client's task of this attempt again, under its id, if it has not answered it (it has
        just announced itself online); for a client the attempt waits for while it works on an earlier
        attempt's task, that task. Not if a presence re-sent that task less than ``clients.presence_interval``
        seconds ago (``now``: monotonic time): the presence is counted as ignored."""
        if client_id in book.answered_by:
            return
        now = time.monotonic() if now is None else now
        books = [book, *(self.intake.attempts.earlier if client_id in book.carried else ())]
        for given in books:
            for task_id, plan in given.plans.items():
                if plan.client_id == client_id and (given is book or client_id not in given.answered_by):
                    if now - self._resent.get(task_id, -math.inf) < self.config.clients.presence_interval:
                        counts = book.tally.counts
                        counts["presence_ignored"] = counts.get("presence_ignored", 0) + 1
                        return
                    log.warning("round %d: sending %s's unanswered task again (it announced itself online)",
                                book.round, client_id)
                    self._resent[task_id] = now
                    self._resent.move_to_end(task_id)
                    while len(self._resent) > _MAX_RESENT:
                        self._resent.popitem(last=False)
                    self.send(given, task_id, plan)
                    return


def _delta_fields(book: RoundBook) -> dict[str, str | None]:
    """A task's delta broadcast fields (codec.down_delta): the digest of the model its broadcast carries and the
    delta that rebuilds it, when the exchange has one."""
    sent = book.sent_model
    if sent is None or book.broadcast is None:
        return {}
    return {"model_digest": sent.model_digest, "delta_broadcast": sent.delta, "delta_base": sent.base}
