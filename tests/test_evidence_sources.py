"""Every 95 % interval the documentation quotes is one a committed results file holds.

The verdicts in README.md and docs/ rest on paired intervals ("+5.89 [+4.74, +7.04]"). Copied by hand, a figure
can go stale when a run lands or drift by a rounding step; a reader checking it against the results would then
find a number nothing computed. So each bracketed pair of signed decimals in the docs must equal, at the
precision quoted, an ``interval`` in some JSON file under bench/results/ (in points or as a fraction, either way
round: "A above B by [+2.46, +3.64]" quotes the report's B-minus-A interval [-3.64, -2.46]). Where a signed
mean stands right before the interval ("+5.89 [+4.74, +7.04]"), the mean must be the one stored beside it.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
QUOTED = re.compile(r"\[([−+-]?\d+\.\d+), ([−+-]?\d+\.\d+)\]")
QUOTED_WITH_MEAN = re.compile(r"([−+-]\d+\.\d+) \[([−+-]?\d+\.\d+), ([−+-]?\d+\.\d+)\]")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _intervals(node: object) -> Iterator[tuple[float | None, float, float]]:
    """(the mean stored beside it or None, low, high) for every interval in a parsed results file."""
    if isinstance(node, dict):
        for key, value in node.items():
            if "interval" in key and isinstance(value, list) and len(value) == 2 and all(map(_number, value)):
                mean = node.get("mean")
                yield (float(mean) if _number(mean) else None), float(value[0]), float(value[1])
            yield from _intervals(value)
    elif isinstance(node, list):
        for value in node:
            yield from _intervals(value)


def _signed(text: str) -> str:
    text = text.replace("−", "-")
    return text if text[0] in "+-" else "+" + text


@functools.cache   # both tests read the same results tree: read it once
def _computed() -> set[tuple[str, ...]]:
    """Every results interval as the docs may print it: 1 or 2 decimals, points or fraction, either sign;
    as (low, high) and, where a mean is stored with it, as (mean, low, high) too."""
    printable: set[tuple[str, ...]] = set()
    for path in RESULTS.rglob("*.json"):
        text = path.read_text()
        if "interval" not in text:
            continue
        for mean, low, high in _intervals(json.loads(text)):
            for scale in (1.0, 100.0):
                for sign in (1.0, -1.0):
                    a, b = sorted((sign * low * scale, sign * high * scale))
                    for decimals in (1, 2):
                        pair = (f"{a:+.{decimals}f}", f"{b:+.{decimals}f}")
                        printable.add(pair)
                        if mean is not None:
                            printable.add((f"{sign * mean * scale:+.{decimals}f}", *pair))
    return printable


def _unmatched(pattern: re.Pattern[str], computed: set[tuple[str, ...]]) -> tuple[int, list[str]]:
    quoted, unmatched = 0, []
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for match in pattern.finditer(line):
                quoted += 1
                if tuple(map(_signed, match.groups())) not in computed:
                    unmatched.append(f"{page.relative_to(ROOT)}:{number}: {match.group(0)}")
    return quoted, unmatched


def test_every_quoted_interval_is_in_a_results_file() -> None:
    computed = _computed()
    assert computed, "no intervals under bench/results: the paired reports are missing"
    quoted, unmatched = _unmatched(QUOTED, computed)
    assert quoted > 100, f"found only {quoted} quoted intervals: has the docs' format changed?"
    assert not unmatched, (
        "intervals no results file holds (re-run bench/paired_report.py and quote its figure, rounded once "
        "from the JSON, or commit the report that computed it):\n" + "\n".join(unmatched))


def test_every_mean_quoted_with_its_interval_is_the_stored_one() -> None:
    quoted, unmatched = _unmatched(QUOTED_WITH_MEAN, _computed())
    assert quoted > 50, f"found only {quoted} means quoted with an interval: has the docs' format changed?"
    assert not unmatched, (
        "a mean and interval that no results file holds together (quote the mean stored beside the "
        "interval, rounded once):\n" + "\n".join(unmatched))
