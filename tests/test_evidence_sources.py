"""Every 95 % interval the documentation quotes is one a committed results file holds.

The verdicts in README.md and docs/ rest on paired intervals ("+5.89 [+4.74, +7.04]"). Copied by hand, a figure
can go stale when a run lands or drift by a rounding step; a reader checking it against the results would then
find a number nothing computed. So each bracketed pair of signed decimals in the docs must equal, at the
precision quoted, an ``interval`` in some JSON file under bench/results/ (in points or as a fraction, either way
round: "A above B by [+2.46, +3.64]" quotes the report's B-minus-A interval [-3.64, -2.46]).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
QUOTED = re.compile(r"\[([−+-]?\d+\.\d+), ([−+-]?\d+\.\d+)\]")


def _intervals(node: object) -> Iterator[tuple[float, float]]:
    if isinstance(node, dict):
        for key, value in node.items():
            if ("interval" in key and isinstance(value, list) and len(value) == 2
                    and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
                yield float(value[0]), float(value[1])
            yield from _intervals(value)
    elif isinstance(node, list):
        for value in node:
            yield from _intervals(value)


def _signed(text: str) -> str:
    text = text.replace("−", "-")
    return text if text[0] in "+-" else "+" + text


def _computed() -> set[tuple[str, str]]:
    """Every results interval as the docs may print it: 1 or 2 decimals, points or fraction, either sign."""
    printable: set[tuple[str, str]] = set()
    for path in RESULTS.rglob("*.json"):
        text = path.read_text()
        if "interval" not in text:
            continue
        for low, high in _intervals(json.loads(text)):
            for scale in (1.0, 100.0):
                for a, b in ((low * scale, high * scale), (-high * scale, -low * scale)):
                    for decimals in (1, 2):
                        printable.add((f"{a:+.{decimals}f}", f"{b:+.{decimals}f}"))
    return printable


def test_every_quoted_interval_is_in_a_results_file() -> None:
    computed = _computed()
    assert computed, "no intervals under bench/results: the paired reports are missing"
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    unmatched = []
    quoted = 0
    for page in pages:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for match in QUOTED.finditer(line):
                quoted += 1
                if (_signed(match.group(1)), _signed(match.group(2))) not in computed:
                    unmatched.append(f"{page.relative_to(ROOT)}:{number}: {match.group(0)}")
    assert quoted > 100, f"found only {quoted} quoted intervals: has the docs' format changed?"
    assert not unmatched, (
        "intervals no results file holds (re-run bench/paired_report.py and quote its figure, rounded once "
        "from the JSON, or commit the report that computed it):\n" + "\n".join(unmatched))
