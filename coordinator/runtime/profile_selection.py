"""``clients.selection = "profile"``: draw the devices whose own reports promise the most, as Oort does.

Oort (Lai et al., OSDI 2021) ranks devices by what their training would bring and how long
it would take, explores devices it knows nothing of, and bounds how often one device is drawn.
Here, from the :class:`~coordinator.runtime.device_book.DeviceBook`:

1. **Eligible**: a device the current model does not fit (its refusal, its measured peak
   against its memory, or the model's estimate against its available memory, each times
   ``selection.memory_margin``) gets no task at all: it could only fail. A device that
   reported a CPU hotter than ``selection.max_temperature_c``, throttling flags set now, or a
   battery below ``selection.min_battery_percent`` while discharging rests for
   ``selection.rest_rounds`` rounds, once per such report. With ``selection.availability``, a
   device whose presence history predicts it goes offline before it would finish its task
   (:mod:`coordinator.runtime.availability`) is left out. When resting or availability leave
   fewer than the results the round needs, the ones left out are put back (the soonest due
   back, the likeliest to finish).
2. **Explore**: ``ceil(epsilon * size)`` places go to devices never selected, in a seeded
   random order; ``epsilon`` is ``selection.explore`` in round 1 and decays by
   ``selection.explore_decay`` a round down to ``selection.explore_min`` (Oort's 0.9, 0.98, 0.2):
   a fleet is tried early, when what the model learns first is decided.
3. **Utility** of a device selected before: its statistical utility (samples times the root of
   its mean squared per-sample loss, ``train_loss_sq``, at its last training) over the largest
   in the pool (the pool's median for a device that never reported one), plus the staleness
   bonus ``sqrt(staleness * ln(round) / L)`` for a device last selected in round ``L``, times
   ``(T / t) ** alpha`` when its estimated completion time ``t`` exceeds the preferred duration
   ``T``. ``t`` is the book's (samples times seconds per sample plus its usual transfer and
   decoding), else the median of its measured round times; a device with neither is not penalized.
4. **Exploit**: the other places are drawn, weighted by utility, among the devices whose utility
   is at least ``selection.cutoff`` times the last place's in the ranking (Oort's 0.95), leaving
   out devices selected more than ``selection.max_share`` times the mean of the devices known
   (put back, least selected first, when too few remain). Places still empty go to the devices
   never selected that exploring did not take.

Seeded by the run's seed, the round and the attempt, as the random draw is.
"""

from __future__ import annotations

import logging
import math
import random
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from coordinator.runtime.availability import likely_gone
from coordinator.runtime.device_book import DeviceBook, DeviceRecord

if TYPE_CHECKING:
    from coordinator.run_config import RunConfig
    from coordinator.runtime.round_times import RoundTimes

__all__ = ["ProfilePolicy", "Eligibility"]

log = logging.getLogger("fedge.coordinator")
DEADLINE_SAFETY = 1.25   # T defaults to the round timeout over this: the deadline selection's margin


class Eligibility:
    """Which devices of a pool may get a task now: not those the model does not fit, not those resting, and not
    those likely to go offline before they finish (``task_seconds``: a device's expected task time)."""

    def __init__(self, config: RunConfig, book: DeviceBook,
                 task_seconds: Callable[[str], float | None] = lambda c: None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.book = book
        self.task_seconds = task_seconds
        self.clock = clock

    def __call__(self, pool: list[str], round: int, need: int) -> tuple[list[str], dict[str, str]]:
        """The devices that may be drawn, and why each other one may not."""
        s = self.config.selection
        out: dict[str, str] = {}
        for c in pool:
            problem = self.book.memory_problem(c, s.memory_margin)
            if problem:
                out[c] = f"memory: {problem}"
        rested = [c for c in pool if c not in out and self._resting(c, round)]
        keep = [c for c in pool if c not in out and c not in rested]
        rested.sort(key=lambda c: (self.book.record(c).rested_until, c))
        back = rested[:max(0, need - len(keep))]   # too few left: the soonest due back return now
        out.update({c: f"resting until round {self.book.record(c).rested_until}" for c in rested if c not in back})
        keep = sorted(keep + back)
        if s.availability:
            keep, gone = likely_gone(keep, need, self.book.presence, self.task_seconds, self.clock(), s.min_sessions)
            out.update(gone)
        return keep, out

    def _resting(self, client_id: str, round: int) -> bool:
        """Whether the device rests in ``round``; a new hot or low-battery report starts a rest."""
        rec, s = self.book.record(client_id), self.config.selection
        if rec.fresh and s.rest_rounds and self.strained(rec):
            rec.rested_until = round + s.rest_rounds
        rec.fresh = False
        return round < rec.rested_until

    def strained(self, rec: DeviceRecord) -> bool:
        """Hot, throttled now, or discharging below the battery threshold (an absent reading is no reason)."""
        s = self.config.selection
        hot = rec.temperature_c is not None and rec.temperature_c > s.max_temperature_c
        low = (rec.power_plugged is False and rec.battery_percent is not None
               and rec.battery_percent < s.min_battery_percent)
        return hot or bool(rec.throttled_now) or low


class ProfilePolicy:
    """Ranks and draws eligible devices by utility, with a decaying exploration share (module docstring)."""

    def __init__(self, config: RunConfig, book: DeviceBook, times: RoundTimes,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.book = book
        self.times = times
        self.eligibility = Eligibility(config, book, self.completion_seconds, clock)

    @property
    def preferred_seconds(self) -> float:
        s = self.config.selection
        return s.preferred_seconds or self.config.clients.round_timeout / DEADLINE_SAFETY

    def epsilon(self, round: int) -> float:
        """The share of round ``round``'s draw given to devices never selected."""
        s = self.config.selection
        return max(min(s.explore, s.explore_min), s.explore * s.explore_decay ** max(0, round - 1))

    def completion_seconds(self, client_id: str) -> float | None:
        """The book's estimate where the device sent profiles, else its measured round times'."""
        estimate = self.book.completion_seconds(client_id)
        return estimate if estimate is not None else self.times.predict(client_id)

    def utilities(self, pool: list[str], round: int) -> dict[str, float]:
        """Utility of each device of ``pool`` that was selected before (module docstring, step 3)."""
        s, preferred = self.config.selection, self.preferred_seconds
        known = [u for c in pool if (u := self.book.record(c).utility) is not None]
        top = max(known, default=0.0)
        unknown = statistics.median(known) / top if top > 0 else 1.0
        out = {}
        for c in pool:
            rec = self.book.record(c)
            if rec.last_selected is None:
                continue
            stat = rec.utility / top if rec.utility is not None and top > 0 else unknown
            bonus = math.sqrt(s.staleness * math.log(max(round, 1)) / max(rec.last_selected, 1))
            t = self.completion_seconds(c)
            penalty = (preferred / t) ** s.alpha if t is not None and t > preferred else 1.0
            out[c] = (stat + bonus) * penalty
        return out

    def over_share(self, pool: list[str]) -> set[str]:
        """Devices of ``pool`` selected more than ``selection.max_share`` times the mean of the devices known."""
        bound = self.config.selection.max_share
        if not bound or not self.book.devices:
            return set()
        mean = sum(r.picks for r in self.book.devices.values()) / len(self.book.devices)
        return {c for c in pool if self.book.record(c).picks > max(1.0, bound * mean)}

    def draw(self, pool: list[str], round: int, attempt: int, size: int, need: int) -> tuple[list[str], list[str]]:
        """The devices to give tasks (at most ``size``), and those left out as not eligible."""
        keep, left_out = self.eligibility(pool, round, need)
        if left_out:
            log.info("round %d: profile selection left out %s", round,
                     ", ".join(f"{c} ({why})" for c, why in sorted(left_out.items())))
        rng = random.Random(f"{self.config.run.seed}/{round}/{attempt}")
        order = {c: rng.random() for c in keep}   # seeded tie-break and exploration order
        size = min(size, len(keep))
        fresh = sorted((c for c in keep if self.book.record(c).last_selected is None), key=order.__getitem__)
        chosen = fresh[:math.ceil(self.epsilon(round) * size)]
        utility = {c: u for c, u in self.utilities(keep, round).items() if c not in chosen}
        capped = self.over_share(list(utility))
        fair = [c for c in utility if c not in capped]
        short = max(0, size - len(chosen) - len(fair))   # too few under the bound: the least selected come back
        fair += sorted(capped, key=lambda c: (self.book.record(c).picks, order[c]))[:short]
        chosen += self._exploit({c: utility[c] for c in fair}, size - len(chosen), order, rng)
        chosen += [c for c in fresh if c not in chosen][:size - len(chosen)]
        for c in chosen:
            rec = self.book.record(c)
            rec.last_selected, rec.picks = round, rec.picks + 1
        return sorted(chosen), sorted(left_out)

    def _exploit(self, utility: dict[str, float], places: int, order: dict[str, float],
                 rng: random.Random) -> list[str]:
        """``places`` devices drawn by utility among those within ``selection.cutoff`` of the last place."""
        ranked = sorted(utility, key=lambda c: (-utility[c], order[c]))
        if places <= 0 or not ranked:
            return []
        floor = self.config.selection.cutoff * utility[ranked[min(places, len(ranked)) - 1]]
        candidates = [c for c in ranked if utility[c] >= floor]
        picked = []
        while candidates and len(picked) < places:
            weights = [max(utility[c], 1e-12) for c in candidates]
            picked.append(candidates.pop(rng.choices(range(len(candidates)), weights)[0]))
        return picked
