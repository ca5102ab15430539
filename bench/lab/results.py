"""What a policy's run directory says, reduced to the lab's results: accuracy against wall-clock
time, results accepted, late and failed, which devices of each class contributed, time to a target.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_jsonl", "training_start", "accuracy_curve", "outcome_counts", "accounting", "contributors", "time_to_target"]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file; a line cut short by a crash is skipped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def training_start(rows: list[dict[str, Any]], seen_at: dict[int, float]) -> float | None:
    """When training began, in the lab's seconds: when round 1's row appeared, less the round's own
    ``seconds`` (round 0's row, the first evaluation, is written only beside round 1's)."""
    first = next((r for r in rows if r.get("round") == 1), None)
    if first is None or 1 not in seen_at or not isinstance(first.get("seconds"), (int, float)):
        return None
    return seen_at[1] - float(first["seconds"])


def accuracy_curve(rows: list[dict[str, Any]], seen_at: dict[int, float]) -> list[dict[str, Any]]:
    """(round, seconds, test accuracy) of every evaluated round. ``seen_at``: when the lab saw each
    round's row appear, in seconds since the policy started. ``t`` counts from there (client start-up and
    waiting for devices included); ``t_train`` from when training began (:func:`training_start`):
    start-up depends on how fast an emulated device imports torch, not on the policy, so policies are
    compared on ``t_train``."""
    start = training_start(rows, seen_at)
    return [{"round": r["round"], "t": seen_at.get(r["round"]),
             "t_train": None if start is None or r["round"] not in seen_at
             else round(max(0.0, seen_at[r["round"]] - start), 2) if r["round"] else 0.0,
             "test_accuracy": r["test_accuracy"]}
            for r in rows if isinstance(r.get("round"), int) and isinstance(r.get("test_accuracy"), float)]


def outcome_counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Results accepted into an aggregate (``returned``), late, failed and rejected, over all rounds."""
    keys = {"accepted": "returned", "late": "late", "failed": "failed", "rejected": "rejected",
            "selected": "selected"}
    return {name: sum(int(r.get(key) or 0) for r in rows if r.get("round", 0) > 0) for name, key in keys.items()}


def _buffered_at_stop(run_dir: Path) -> int:
    """Results an async run's last checkpoint holds in its buffer (taken, not yet in a version): a stop
    saves them there, and a resume applies them."""
    from coordinator.runtime.async_buffer import AsyncBuffer
    from storage.checkpoint import latest_checkpoint, load_checkpoint

    path = latest_checkpoint(run_dir / "checkpoints")
    return AsyncBuffer.taken_from(load_checkpoint(path)[0])[0].count if path is not None else 0


def accounting(run_dir: Path, rows: list[dict[str, Any]]) -> dict[str, int]:
    """Whether every result counted once. ``answered_in_time``: training answers the coordinator took in
    time (``clients/ID.jsonl``: not late, not missed, no error); ``counted``: results the rows say went into
    a model (``returned``: accepted, and in async mode also those dropped as too stale). Two kinds of answer
    are taken and not (yet) counted, by design: those of the round a stop interrupted (``interrupted``,
    rounds after the last row: a resumed run trains that round again), and in async mode those the last
    checkpoint keeps in its buffer (``buffered``). ``lost`` is what neither explains; a result counted
    twice would make it negative."""
    last = max([r["round"] for r in rows if isinstance(r.get("round"), int)], default=0)
    answered = interrupted = 0
    for path in sorted((run_dir / "clients").glob("*.jsonl")):
        for r in read_jsonl(path):
            if r.get("objective") == "train" and not r.get("late") and not r.get("missed") and r.get("error") is None:
                answered += 1
                interrupted += isinstance(r.get("round"), int) and r["round"] > last
    counted = sum(int(r.get("returned") or 0) for r in rows if r.get("round", 0) > 0)
    buffered = _buffered_at_stop(run_dir) if any("version" in r for r in rows) else 0
    if buffered:   # async tasks travel as the version they train towards: the buffer's are among the later ones
        interrupted = 0
    return {"answered_in_time": answered, "counted": counted, "interrupted": interrupted, "buffered": buffered,
            "lost": answered - counted - interrupted - buffered}


def contributors(run_dir: Path, device_class: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Per class: the distinct devices with at least one training result that was in time and not
    an error (from the run's ``clients/ID.jsonl`` profile records), out of the class's devices."""
    out: dict[str, dict[str, Any]] = {}
    for klass in dict.fromkeys(device_class.values()):
        members = [d for d, c in device_class.items() if c == klass]
        good = [d for d in members
                if any(r.get("objective") == "train" and not r.get("late") and not r.get("missed")
                       and r.get("error") is None for r in read_jsonl(run_dir / "clients" / f"{d}.jsonl"))]
        out[klass] = {"contributed": len(good), "devices": len(members), "ids": good}
    return out


def time_to_target(curve: list[dict[str, Any]], target: float | None, window: int = 1) -> float | None:
    """Wall-clock seconds of training until test accuracy first reached ``target`` (None: never, or no
    target). With ``window`` > 1, until the mean of the last ``window`` evaluations first reached it: one
    evaluation of a model that swings from round to round can touch the target by luck."""
    if target is None:
        return None
    points = [p for p in curve if p.get("t_train") is not None]
    for i in range(window - 1, len(points)):
        if sum(p["test_accuracy"] for p in points[i - window + 1:i + 1]) / window >= target:
            return points[i]["t_train"]
    return None
