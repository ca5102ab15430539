"""Selection policies on a simulated mixed fleet: who each policy draws, round after round, and who answers in time.

The draws are the product's (:class:`~coordinator.runtime.selection.Sampler` with its device book, round times
and presence history, fed what the intake would feed them); only the fleet is simulated: the edge lab's 30 devices
(``bench/fleets/mixed.toml`` as the committed lab results ran it: speeds 1 to 13, online/offline spells with the
file's means), 2,000 samples each, a task taking ``samples / (speed x 13.3)`` seconds plus 3 s of transfer (a Zero
100 to 210 s, as the lab measured), rounds of 10 with ``clients.round_timeout`` 60 s. A device that goes offline
before it finishes never answers. Its training loss is a model, not a measurement: the round's global loss (falling
as results are counted) times the device's own factor (its label skew) times how far its data is from the model
(falling each time it is counted), so the statistical utility behaves as Oort's does, high for devices rarely
counted. Accuracy is not simulated: what this measures is participation (per class and per device, results counted
and late) and coverage (distinct devices counted), the mechanism behind a policy's accuracy per round.

    python bench/selection_sim.py --rounds 14 --policy random --policy profile
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from collections import Counter
from pathlib import Path

from coordinator.config import load_config
from coordinator.runtime.device_book import DeviceBook
from coordinator.runtime.round_times import RoundTimes
from coordinator.runtime.selection import Absences, Sampler
from profiling.schema import clean_profile

# class -> (count, speed, online mean s, offline mean s or None: always online): the lab's fleet as it ran
FLEET = {"pi-zero-2w": (6, 1.0, 300, 150), "pi4-2gb": (6, 5.7, 400, 100), "pi4-4gb": (6, 6.8, 400, 100),
         "pi4-8gb": (2, 6.8, 0, None), "pi5-4gb": (6, 12.5, 480, 120), "orin-nano": (4, 13.0, 900, 100)}
SAMPLES = 2000
PER_UNIT = 13.3        # samples per second per unit of speed: a Zero needs 150 s for 2,000 samples
TRANSFER = 3.0
TIMEOUT = 60.0
PER_ROUND = 10


class Fleet:
    """Devices' spells online and offline (seeded), their task times and their loss model."""

    def __init__(self, seed: int, horizon: float) -> None:
        rng = random.Random(seed)
        self.cls: dict[str, str] = {}
        self.speed: dict[str, float] = {}
        self.spells: dict[str, list[tuple[float, float]]] = {}   # online intervals
        self.skew: dict[str, float] = {}
        self.counted: Counter[str] = Counter()
        for name, (count, speed, up, down) in FLEET.items():
            for i in range(1, count + 1):
                c = f"{name}-{i:02d}"
                self.cls[c], self.speed[c] = name, speed
                self.skew[c] = math.exp(rng.gauss(0, 0.3))
                spells, t, online = [], 0.0, down is None or rng.random() < up / (up + down)
                while t < horizon:
                    if down is None:
                        spells.append((0.0, math.inf))
                        break
                    length = rng.expovariate(1 / (up if online else down))
                    if online:
                        spells.append((t, t + length))
                    t += length
                    online = not online
                self.spells[c] = spells

    def online(self, c: str, t: float) -> bool:
        return any(a <= t < b for a, b in self.spells[c])

    def session_end(self, c: str, t: float) -> float:
        return next((b for a, b in self.spells[c] if a <= t < b), t)

    def task_seconds(self, c: str) -> float:
        return SAMPLES / (self.speed[c] * PER_UNIT) + TRANSFER

    def loss_sq(self, c: str, global_loss: float) -> float:
        distance = 1.0 + 1.5 / (1 + self.counted[c])
        return (global_loss * self.skew[c] * distance) ** 2


def run(policy: str, rounds: int, seed: int, overrides: list[tuple[str, str, object]]) -> dict:
    config = load_config(None, [("run", "seed", seed), ("clients", "expected", 30),
                                ("clients", "per_round", PER_ROUND), ("clients", "round_timeout", TIMEOUT),
                                ("clients", "selection", policy), *overrides])
    fleet = Fleet(seed, horizon=rounds * 2 * TIMEOUT + 3600)
    times, book = RoundTimes(), DeviceBook()
    sampler = Sampler(config, Absences(config.clients.max_misses), times, book)
    now, global_loss = 0.0, 2.3
    sampler.clock = lambda: now   # the presence history's clock: the simulated one
    drawn, counted, late = Counter(), Counter(), Counter()
    per_round = []
    pending: list[tuple[float, str, str, float]] = []   # a late answer: (arrives, client, task, global loss then)
    was_online: dict[str, bool] = {}
    for r in range(1, rounds + 1):
        for c in fleet.cls:   # what the roster tells the presence history
            up = fleet.online(c, now)
            if was_online.get(c) != up:
                book.presence.changed(c, up, now)
                was_online[c] = up
        online = [c for c in fleet.cls if fleet.online(c, now)]
        chosen = sampler.draw(online, r, 0).clients
        deadline = max([times.deadline([(c, "fedavg")], TIMEOUT) for c in chosen] or [TIMEOUT])
        answers = {}
        for c in chosen:
            drawn[c] += 1
            task = f"{r}/{c}"
            times.sent(task, c, "fedavg", now)
            done = now + fleet.task_seconds(c)
            if fleet.session_end(c, now) < done:
                continue   # went offline before it finished: never answers
            answers[c] = (done, task)
        finished = [c for c, (t, _) in answers.items() if t <= now + deadline]
        end = now + deadline if len(finished) < len(chosen) else max([now, *(answers[c][0] for c in finished)])
        for c in finished:
            _answer(book, times, fleet, c, answers[c][1], answers[c][0], global_loss)
            counted[c] += 1
        for c in chosen:
            if c not in finished and c in answers:
                pending.append((answers[c][0], c, answers[c][1], global_loss))
                late[c] += 1
        times.missed([f"{r}/{c}" for c in chosen if c not in finished], deadline)
        sampler.absences.missed([c for c in chosen if c not in answers])
        for c in finished:
            fleet.counted[c] += 1
            sampler.absences.returned(c)
        for item in [p for p in pending if p[0] <= end]:
            _answer(book, times, fleet, item[1], item[2], item[0], item[3])
            sampler.absences.returned(item[1])
            pending.remove(item)
        if finished:
            global_loss = max(0.3, global_loss * (1 - 0.08 * len(finished) / PER_ROUND))
        per_round.append({"round": r, "drawn": len(chosen), "counted": len(finished), "seconds": round(end - now, 1),
                          "distinct_counted": sum(1 for c in fleet.cls if counted[c])})
        now = end
    classes = {name: {"devices": FLEET[name][0],
                      "drawn": sum(drawn[c] for c in fleet.cls if fleet.cls[c] == name),
                      "counted": sum(counted[c] for c in fleet.cls if fleet.cls[c] == name),
                      "late": sum(late[c] for c in fleet.cls if fleet.cls[c] == name),
                      "devices_counted": sum(1 for c in fleet.cls if fleet.cls[c] == name and counted[c])}
               for name in FLEET}
    share = [counted[c] for c in fleet.cls]
    return {"policy": policy, "overrides": [list(o) for o in overrides], "seed": seed, "rounds": rounds,
            "seconds": round(now, 1), "counted": sum(counted.values()), "late": sum(late.values()),
            "drawn": sum(drawn.values()), "distinct_counted": sum(1 for s in share if s),
            "max_per_device": max(share), "median_per_device": statistics.median(share),
            "classes": classes, "per_device": dict(counted), "per_round": per_round}


def _answer(book: DeviceBook, times: RoundTimes, fleet: Fleet, c: str, task: str, at: float,
            global_loss: float) -> None:
    """What the intake does with a first answer: its round time, then the book's reading of it."""
    answered = times.answered(task, c, at)
    seconds = answered[0] if answered else fleet.task_seconds(c)
    speed = fleet.speed[c] * PER_UNIT
    book.answered(c, seconds, clean_profile({"samples": SAMPLES, "samples_per_second": speed}),
                  {"train_loss_sq": fleet.loss_sq(c, global_loss)}, SAMPLES, None)


def _override(text: str) -> tuple[str, str, object]:
    key, _, value = text.partition("=")
    section, _, name = key.partition(".")
    return section, name, json.loads(value) if value[:1] in "0123456789-tf[{" else value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", action="append", help="clients.selection (repeat); default: random and profile")
    ap.add_argument("--rounds", type=int, default=14)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="a config override")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args()
    overrides = [_override(s) for s in args.set]
    results = [run(p, args.rounds, seed, overrides) for p in args.policy or ["random", "profile"]
               for seed in range(args.seeds)]
    print(f"{'policy':10} {'seed':>4} {'counted':>7} {'late':>5} {'distinct':>8} {'max/dev':>7}  "
          + "  ".join(f"{n[:10]:>10}" for n in FLEET))
    for res in results:
        cls = "  ".join(f"{v['counted']:>4}/{v['devices_counted']}of{v['devices']}".rjust(10)
                        for v in res["classes"].values())
        print(f"{res['policy']:10} {res['seed']:>4} {res['counted']:>7} {res['late']:>5} "
              f"{res['distinct_counted']:>8} {res['max_per_device']:>7}  {cls}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
