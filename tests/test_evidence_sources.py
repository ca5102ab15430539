"""Every 95 % interval the documentation quotes is one a committed results file holds.

The verdicts in README.md and docs/ rest on paired intervals ("+5.89 [+4.74, +7.04]"). Copied by hand, a figure
can go stale when a run lands or drift by a rounding step; a reader checking it against the results would then
find a number nothing computed. So each bracketed pair of signed decimals in the docs must equal, at the
precision quoted, an ``interval`` in some JSON file under bench/results/ (in points or as a fraction, either way
round: "A above B by [+2.46, +3.64]" quotes the report's B-minus-A interval [-3.64, -2.46]). Where a signed
mean stands right before the interval ("+5.89 [+4.74, +7.04]"), the mean must be the one stored beside it.

The tables' "mean ± std" figures are checked the same way: each must be a mean and spread some results file
holds (``X_mean`` beside ``X_spread`` or ``X_std``; a figure beside a ``per_seed`` list, with that list's
population or sample std), in points, as a fraction or in MB, at the decimals quoted.
"""

from __future__ import annotations

import functools
import json
import re
import statistics
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
QUOTED = re.compile(r"\[([−+-]?\d+\.\d+), ([−+-]?\d+\.\d+)\]")
QUOTED_WITH_MEAN = re.compile(r"([−+-]\d+\.\d+) \[([−+-]?\d+\.\d+), ([−+-]?\d+\.\d+)\]")
QUOTED_SPREAD = re.compile(r"([−+-]?)(\d+\.?\d*) ± (\d+\.?\d*)")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Figures worked out from run files that no report aggregates, each with where it comes from. Every one must
# still be quoted, so an entry goes when its figure does.
NOT_IN_A_REPORT = {
    "+1.59 ± 0.52": "dfl.md, refresh over DFL between exact twins: dfl_postfix/ seeds 0, 1 and dfl/ seed 2",
    "+1.12 ± 0.17": "dfl.md, the same on rotate5",
    "78.10 ± 0.26": "dfl.md, DFL on color5 with every run seeded exactly: dfl_postfix/ seeds 0, 1, dfl/ seed 2",
    "70.49 ± 0.64": "dfl.md, the same on rotate5",
}


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


def _spreads(node: object) -> Iterator[tuple[float, float]]:
    """(mean, std) for every mean stored with its spread over seeds in a parsed results file."""
    if isinstance(node, dict):
        per_seed = node.get("per_seed")
        for key, value in node.items():
            if _number(value) and key.endswith("mean"):
                for spread in ("spread", "std"):
                    if _number(node.get(key[:-4] + spread)):
                        yield float(value), float(node[key[:-4] + spread])
            if (_number(value) and isinstance(per_seed, list) and len(per_seed) > 1
                    and all(isinstance(seed, dict) and _number(seed.get(key)) for seed in per_seed)):
                values = [seed[key] for seed in per_seed]
                yield float(value), statistics.pstdev(values)
                yield float(value), statistics.stdev(values)
            yield from _spreads(value)
        if isinstance(per_seed, list) and len(per_seed) > 1 and all(map(_number, per_seed)):
            yield statistics.fmean(per_seed), statistics.pstdev(per_seed)
            yield statistics.fmean(per_seed), statistics.stdev(per_seed)
    elif isinstance(node, list):
        for value in node:
            yield from _spreads(value)


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


@functools.cache
def _computed_spreads() -> set[tuple[str, str]]:
    """Every stored (mean, std) as the docs may print it: 0 to 3 decimals, points, fraction or MB."""
    printable: set[tuple[str, str]] = set()
    for path in RESULTS.rglob("*.json"):
        for mean, spread in _spreads(json.loads(path.read_text())):
            for scale in (1.0, 100.0, 1e-6):
                for decimals in range(4):
                    printable.add((f"{mean * scale:+.{decimals}f}", f"{spread * scale:.{decimals}f}"))
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


def test_every_quoted_mean_and_spread_is_in_a_results_file() -> None:
    computed = _computed_spreads()
    quoted, unmatched, exempt_seen = 0, [], set()
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for match in QUOTED_SPREAD.finditer(line):
                quoted += 1
                sign, mean, spread = match.groups()
                if (_signed(sign + mean), spread) in computed:
                    continue
                if match.group(0) in NOT_IN_A_REPORT:
                    exempt_seen.add(match.group(0))
                else:
                    unmatched.append(f"{page.relative_to(ROOT)}:{number}: {match.group(0)}")
    assert quoted > 200, f"found only {quoted} quoted mean ± std figures: has the docs' format changed?"
    assert not unmatched, (
        "mean ± std figures no results file holds (quote the report's mean and spread, rounded once from the "
        "JSON; the matrix report's spread is the population std over seeds):\n" + "\n".join(unmatched))
    assert exempt_seen == set(NOT_IN_A_REPORT), (
        f"NOT_IN_A_REPORT lists figures the docs no longer quote: {sorted(set(NOT_IN_A_REPORT) - exempt_seen)}")
