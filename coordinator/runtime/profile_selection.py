"""``clients.selection = "profile"``: draw the devices whose own reports promise the most, Oort-style.

Oort (Lai et al., OSDI 2021) ranks devices by what their training would bring and how long
it would take. Here, from the :class:`~coordinator.runtime.device_book.DeviceBook`:

1. **Eligible**: a device the current model does not fit (its refusal, its measured peak
   against its memory, or the model's estimate against its available memory, each times
   ``selection.memory_margin``) gets no task at all: it could only fail. A device that
   reported a CPU hotter than ``selection.max_temperature_c``, throttling flags set now, or a
   battery below ``selection.min_battery_percent`` while discharging rests for
   ``selection.rest_rounds`` rounds, once per such report. When that leaves fewer than the
   results the round needs, the rested ones soonest due back are put back.
2. **Utility** of a device that took part before: its statistical utility (samples times the
   root of its mean squared per-sample loss, last time), divided by the largest in the pool
   (1 when it reported none), plus a staleness bonus ``sqrt(staleness * ln(round) / L)`` for a
   device last selected in round ``L`` (Oort's), times ``(T / t) ** alpha`` when its estimated
   completion time ``t`` exceeds the preferred duration ``T``. ``t`` is the book's (samples
   times seconds per sample plus its usual transfer and decoding), else the median of its
   measured round times; a device with neither is not penalized.
3. **Draw**: ``ceil(explore * size)`` places go to devices never selected (in a seeded random
   order), or when there are none to those selected least recently; the rest to the highest
   utilities (ties in seeded random order). So every device is tried within
   ``ceil(devices / explore places)`` draws, and a slow device still comes back now and then.

Seeded by the run's seed, the round and the attempt, as the random draw is.
"""

from __future__ import annotations

import logging
import math
import random
from typing import TYPE_CHECKING

from coordinator.runtime.device_book import DeviceBook, DeviceRecord

if TYPE_CHECKING:
    from coordinator.run_config import RunConfig
    from coordinator.runtime.round_times import RoundTimes

__all__ = ["ProfilePolicy", "Eligibility"]

log = logging.getLogger("fedge.coordinator")
DEADLINE_SAFETY = 1.25   # T defaults to the round timeout over this: the deadline selection's margin


class Eligibility:
    """Which devices of a pool may get a task now: not those the model does not fit, and not those resting."""

    def __init__(self, config: RunConfig, book: DeviceBook) -> None:
        self.config = config
        self.book = book

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
        return sorted(keep + back), out

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
    """Ranks and draws eligible devices by utility, with an exploration share (module docstring)."""

    def __init__(self, config: RunConfig, book: DeviceBook, times: RoundTimes) -> None:
        self.config = config
        self.book = book
        self.times = times
        self.eligibility = Eligibility(config, book)

    @property
    def preferred_seconds(self) -> float:
        s = self.config.selection
        return s.preferred_seconds or self.config.clients.round_timeout / DEADLINE_SAFETY

    def completion_seconds(self, client_id: str) -> float | None:
        """The book's estimate where the device sent profiles, else its measured round times'."""
        estimate = self.book.completion_seconds(client_id)
        return estimate if estimate is not None else self.times.predict(client_id)

    def utilities(self, pool: list[str], round: int) -> dict[str, float]:
        """Utility of each device of ``pool`` that was selected before (module docstring, step 2)."""
        s, preferred = self.config.selection, self.preferred_seconds
        known = [u for c in pool if (u := self.book.record(c).utility) is not None]
        top = max(known, default=0.0)
        out = {}
        for c in pool:
            rec = self.book.record(c)
            if rec.last_selected is None:
                continue
            stat = rec.utility / top if rec.utility is not None and top > 0 else 1.0
            bonus = math.sqrt(s.staleness * math.log(max(round, 1)) / max(rec.last_selected, 1))
            t = self.completion_seconds(c)
            penalty = (preferred / t) ** s.alpha if t is not None and t > preferred else 1.0
            out[c] = (stat + bonus) * penalty
        return out

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
        stale = sorted((c for c in keep if c not in fresh),
                       key=lambda c: (self.book.record(c).last_selected or 0, order[c]))
        explore = math.ceil(self.config.selection.explore * size)
        chosen = (fresh or stale)[:explore]
        utility = {c: u for c, u in self.utilities(keep, round).items() if c not in chosen}
        ranked = sorted(utility, key=lambda c: (-utility[c], order[c])) + [c for c in fresh if c not in chosen]
        chosen += ranked[:size - len(chosen)]
        for c in chosen:
            self.book.record(c).last_selected = round
        return sorted(chosen), sorted(left_out)
