"""A run's ``summary.json``: what it reached and what it moved, from its metrics rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coordinator.config import RunConfig
from edge_client.app import spec_app

__all__ = ["run_summary", "traffic", "contributions"]


def traffic(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Bytes on the wire over the run, and their ratio to sending the whole float32 model both ways
    to every selected client every round (below 1: smaller than that)."""
    keys = ("bytes_down", "bytes_up", "bytes_broadcast", "fp32_bytes_down", "fp32_bytes_up")
    t: dict[str, Any] = {k: sum(r.get(k, 0) for r in rows) for k in keys}
    reference = t["fp32_bytes_down"] + t["fp32_bytes_up"]
    t["ratio_down_vs_fp32"] = t["bytes_down"] / t["fp32_bytes_down"] if t["fp32_bytes_down"] else None
    t["ratio_up_vs_fp32"] = t["bytes_up"] / t["fp32_bytes_up"] if t["fp32_bytes_up"] else None
    t["ratio_vs_fp32"] = (t["bytes_down"] + t["bytes_up"]) / reference if reference else None
    return t


def contributions(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """What each device contributed over an async run's versions (their rows' ``contributions``): results
    counted and dropped as too stale, tasks shortened, versions it rested through, and its share of the summed
    weight of every counted result (0 for a device none of whose results counted)."""
    totals: dict[str, dict[str, Any]] = {}
    for row in rows:
        for client, counts in row.get("contributions", {}).items():
            mine = totals.setdefault(client, {"counted": 0, "dropped": 0, "shortened": 0, "rested": 0, "weight": 0.0})
            for key in mine:
                mine[key] += counts.get(key, 0)
    weight = sum(t["weight"] for t in totals.values())
    return {client: {**{k: v for k, v in t.items() if k != "weight"},
                     "weight_share": t["weight"] / weight if weight > 0 else 0.0}
            for client, t in sorted(totals.items())}


def run_summary(config: RunConfig, run_id: str, out: Path, rows: list[dict[str, Any]], seconds: float,
                spec: dict[str, Any], started_after: int) -> dict[str, Any]:
    """The run's summary; with ``started_after > 0`` (a resumed run) ``this_session`` counts what this
    session itself did and moved, apart from the whole run's totals."""
    trained = [r for r in rows if r["round"] > 0]
    session = [r for r in trained if r["round"] > started_after]
    # the last row with a test-set evaluation (eval.every), or none (a method whose clients keep their
    # own predictors has no global model to test)
    final = next((r for r in reversed(rows) if r.get("test_accuracy") is not None), {})
    return {
        "run_id": run_id,
        "out_dir": str(out),
        "strategy": config.run.strategy,
        "model": spec,
        "rounds": len(trained),
        # None for a strategy without a global model to test: see its personalized accuracy
        "initial_accuracy": rows[0].get("test_accuracy") if rows else None,
        "final_accuracy": final.get("test_accuracy"),
        "best_accuracy": max((r["test_accuracy"] for r in rows if r.get("test_accuracy") is not None), default=None),
        "final_loss": final.get("test_loss"),
        "final_personalized_accuracy": next((r["personalized_accuracy_mean"] for r in reversed(rows)
                                             if "personalized_accuracy_mean" in r), None),
        **_headline(rows, spec),
        **traffic(rows),
        **({"contributions": contributions(rows)} if any("contributions" in r for r in rows) else {}),
        "rejected": sum(r.get("rejected", 0) for r in rows),
        "late": sum(r.get("late", 0) for r in rows),
        "seconds_this_session": seconds,
        "this_session": {"resumed_after_round": started_after, "rounds": len(session),
                         **{k: sum(r.get(k, 0) for r in session) for k in ("bytes_down", "bytes_up", "late")}},
    }


def _headline(rows: list[dict[str, Any]], spec: dict[str, Any]) -> dict[str, Any]:
    """An app's run: its headline metric's name, direction, and its first, last and best value (the lowest
    for a metric where lower is better); nothing for fedge's own networks, whose summary keys say accuracy."""
    app = spec_app(spec)
    if app is None:
        return {}
    name, higher = app.headline, app.metrics[app.headline].higher_is_better
    values = [r[f"test_{name}"] for r in rows if r.get(f"test_{name}") is not None]
    return {"headline": name, "higher_is_better": higher, f"initial_{name}": values[0] if values else None,
            f"final_{name}": values[-1] if values else None,
            f"best_{name}": (max if higher else min)(values) if values else None}
