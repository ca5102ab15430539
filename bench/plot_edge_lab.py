"""Accuracy against wall-clock time of each policy the edge lab ran (``bench/edge_lab.py``).

Reads the lab's results file and draws one line per policy: test accuracy at each evaluated round
against the seconds since training began (round 0's row; the clients' start-up is left out, as in
the lab's time to target), with the target (synchronous random selection's final accuracy) as a
dashed line. A second panel shows how many distinct devices of each class contributed, per policy,
out of the class's devices: a policy that reaches the target by picking only fast devices shows here.

    python bench/plot_edge_lab.py [bench/results/edge_lab.json] [--out docs/images/edge_lab.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _curve(policy: dict[str, Any]) -> tuple[list[float], list[float]]:
    points = [p for p in policy.get("accuracy_vs_time", []) if p.get("t_train") is not None]
    return [p["t_train"] for p in points], [100.0 * p["test_accuracy"] for p in points]


def plot(results: dict[str, Any], out: Path) -> None:
    """Write the two-panel figure of ``results`` (the lab's JSON) to ``out``."""
    policies = results.get("policies", {})
    fig, (acc, part) = plt.subplots(1, 2, figsize=(12.0, 4.2), dpi=100)
    for name, policy in policies.items():
        t, a = _curve(policy)
        if t:
            acc.plot(t, a, marker=".", label=name)
    target = (results.get("target") or {}).get("accuracy")
    if isinstance(target, float):
        acc.axhline(100.0 * target, color="black", linestyle="--", linewidth=1,
                    label=f"target ({100 * target:.1f} %)")
    acc.set_xlabel("seconds since training began")
    acc.set_ylabel("test accuracy (%)")
    acc.set_title(f"{results.get('fleet', 'fleet')}: {results.get('devices')} devices")
    acc.legend(fontsize=8)
    acc.grid(alpha=0.3)
    classes = list(results.get("classes", {}))
    width = 0.8 / max(1, len(policies))
    for i, (name, policy) in enumerate(policies.items()):
        shares = [policy.get("contributors", {}).get(c, {}) for c in classes]
        fractions = [100.0 * s.get("contributed", 0) / s["devices"] if s.get("devices") else 0.0 for s in shares]
        part.bar([k + i * width for k in range(len(classes))], fractions, width, label=name)
    part.set_xticks([k + 0.4 - width / 2 for k in range(len(classes))], classes, rotation=20, fontsize=8)
    part.set_ylabel("devices that contributed (% of class)")
    part.set_ylim(0, 105)
    part.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="?", type=Path, default=ROOT / "bench" / "results" / "edge_lab.json",
                   help="the lab's results file (default bench/results/edge_lab.json)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "edge_lab.png", help="PNG to write")
    args = p.parse_args(argv)
    if not args.results.exists():
        print(f"plot_edge_lab.py: {args.results} does not exist; run bench/edge_lab.py first", file=sys.stderr)
        return 2
    plot(json.loads(args.results.read_text()), args.out)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
