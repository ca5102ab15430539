"""The attempts of the phase in progress, and which round, phase and attempt each task belongs to.

A retry of a phase runs on the global state the attempt before it ran on: nothing is
aggregated between attempts. So a result answering an earlier attempt's task of the
same run, round and phase is as good as one answering the current attempt's, and a
device that needs longer than ``clients.round_timeout`` still contributes: its result
counts in whichever attempt is running when it arrives. :class:`Attempts` keeps the
earlier attempts' books (their plans) for the intake, carries the results they took
into the next attempt, and names the attempt a really late result missed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from coordinator.runtime.profiles import ProfileStore
from coordinator.runtime.round_book import RoundBook
from coordinator.runtime.round_times import RoundTimes
from coordinator.strategies.base import TaskPlan

__all__ = ["Attempts", "TaskPlace", "silent_note"]

_MAX_PLACES = 100_000   # tasks whose place is remembered, for the late-result message


@dataclass(frozen=True)
class TaskPlace:
    """Where a task belongs: its round, phase and attempt (0-based)."""

    round: int
    phase: str
    attempt: int


class Attempts:
    """The earlier attempts of the phase in progress, and the places of the tasks this coordinator gave."""

    def __init__(self) -> None:
        self.earlier: list[RoundBook] = []
        self.ended_round = 0   # the last round whose every phase ended
        self._places: OrderedDict[str, TaskPlace] = OrderedDict()

    def opened(self, previous: RoundBook, book: RoundBook, carry: bool) -> None:
        """``book`` replaces ``previous`` as the book results go to. A retry of the same phase keeps
        ``previous`` for its plans and, with ``carry``, takes over its results (and their partial
        aggregate): they were computed from the same global state. Anything else ends the phase's attempts."""
        retry = (book.attempt > 0 and previous.attempt >= 0
                 and (previous.round, previous.phase) == (book.round, book.phase))
        if not retry:
            self.earlier = []
            return
        self.earlier.append(previous)
        if carry:
            book.results.update(previous.results)
            book.profiles.update({k: v for k, v in previous.profiles.items() if k in previous.results})
            book.partial = previous.partial

    def issued(self, task_id: str, book: RoundBook) -> None:
        self._places[task_id] = TaskPlace(book.round, book.phase, book.attempt)
        while len(self._places) > _MAX_PLACES:
            self._places.popitem(last=False)

    def find(self, task_id: str) -> tuple[RoundBook, TaskPlan] | None:
        """The earlier attempt of the phase in progress that gave ``task_id``, and its plan."""
        for book in self.earlier:
            plan = book.plans.get(task_id)
            if plan is not None:
                return book, plan
        return None

    def unanswered(self, answered: set[str]) -> dict[str, str]:
        """Tasks of earlier attempts whose clients have not answered in any attempt since: task id -> client."""
        given = {task_id: plan.client_id for book in self.earlier for task_id, plan in book.plans.items()}
        answered = answered.union(*(b.answered_by for b in self.earlier))
        return {task_id: client for task_id, client in given.items() if client not in answered}

    def silent(self, book: RoundBook, rejected: Iterable[str] = ()) -> dict[str, str]:
        """The clients given a task in any attempt of the phase in progress (``book``: the last) that answered
        in none of them (a result ``rejected`` is an answer too): client -> the objective of its task."""
        answered = book.answered_by.union(rejected, *(b.answered_by for b in self.earlier))
        return {plan.client_id: plan.objective for b in (*self.earlier, book) for plan in b.plans.values()
                if plan.client_id not in answered}

    def why_late(self, task_id: str, round: int) -> str:
        """Which attempt a result of ``task_id`` (given by this coordinator) missed, and why it is over."""
        place = self._places.get(task_id)
        if place is None:
            return f"task {task_id} of round {round} is over (it is too old to say which attempt it missed)"
        missed = f"task {task_id} of round {place.round} attempt {place.attempt + 1}"
        if self.find(task_id) is not None:   # the phase is still on: only an aggregation worker's claim is refused
            return (f"{missed} is over (an aggregation worker holds it under that attempt, whose partial sums are "
                    "no longer merged)")
        if place.round <= self.ended_round:
            return f"{missed} is over (the round ended)"
        return f"{missed} is over (the round's {place.phase} phase ended)"


def silent_note(silent: dict[str, str], times: RoundTimes, waited: float, records: ProfileStore) -> str:
    """Which devices a phase waited for in vain and how long they take (the median of their round times measured
    here, else of those the run's records hold from an earlier session, when they ever answered a task of that
    kind), beside how long the last attempt waited: what a person needs to choose between a longer
    ``clients.round_timeout`` and looking at those devices. "" if none."""
    if not silent:
        return ""
    said = []
    for client, objective in sorted(silent.items()):
        usual = times.usual(client, objective)
        usual = usual if usual is not None else records.recorded_seconds(client, objective)
        said.append(f"{client} (its earlier {objective} tasks took {usual:.1f} s)" if usual is not None
                    else f"{client} (no {objective} task of it answered yet: is it online?)")
    return (f"no answer in time from {', '.join(said)}; the last attempt waited {waited:.1f} s "
            "(clients.round_timeout, longer for devices known to be slow); ")
