"""Every 95 % interval the documentation quotes is one a committed results file holds.

The verdicts in README.md and docs/ rest on paired intervals ("+5.89 [+4.74, +7.04]"). Copied by hand, a figure
can go stale when a run lands or drift by a rounding step; a reader checking it against the results would then
find a number nothing computed. So each bracketed pair of signed decimals in the docs must equal, at the
precision quoted, an ``interval`` in some JSON file under bench/results/ (in points or as a fraction, either way
round: "A above B by [+2.46, +3.64]" quotes the report's B-minus-A interval [-3.64, -2.46]). Where a signed
mean stands right before the interval ("+5.89 [+4.74, +7.04]"), the mean must be the one stored beside it.

The tables' "mean ± std" figures are checked the same way: each must be a mean and spread some results file
holds (``X_mean`` beside ``X_spread`` or ``X_std``; a figure beside a ``per_seed`` list, with that list's
population or sample std), in points, as a fraction or in MB, at the decimals quoted. And a signed difference
per seed ("+1.14, +1.08, -1.38" or "+7.92 / +8.12 / +6.37") must be a stored ``per_seed`` list, in order.
"""

from __future__ import annotations

import functools
import json
import re
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
QUOTED = re.compile(r"\[([−+-]?\d+\.\d+), ([−+-]?\d+\.\d+)\]")
QUOTED_WITH_MEAN = re.compile(r"([−+-]\d+\.\d+) \[([−+-]?\d+\.\d+), ([−+-]?\d+\.\d+)\]")
QUOTED_SPREAD = re.compile(r"([−+-]?)(\d+\.?\d*) ± (\d+\.?\d*)")
QUOTED_PER_SEED = re.compile(
    r"(?<![\[\d.])[−+-]\d+\.\d+(?:(?: / |, )(?:\*\*)?[−+-]\d+\.\d+(?:\*\*)?){2}(?![\d.])")
SIGNED = re.compile(r"[−+-]\d+\.\d+")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# Figures worked out from run files that no report aggregates, each with where it comes from. Every one must
# still be quoted, so an entry goes when its figure does.
NOT_IN_A_REPORT = {
    "+1.59 ± 0.52": "dfl.md, refresh over DFL between exact twins: dfl_postfix/ seeds 0, 1 and dfl/ seed 2",
    "+1.12 ± 0.17": "dfl.md, the same on rotate5",
    "78.10 ± 0.26": "dfl.md, DFL on color5 with every run seeded exactly: dfl_postfix/ seeds 0, 1, dfl/ seed 2",
    "70.49 ± 0.64": "dfl.md, the same on rotate5",
    "+2.31, +1.33, +1.13": "dfl.md, the refresh's gain per seed between those exact twins on color5",
    "+1.03, +1.36, +0.97": "dfl.md, the same on rotate5",
}


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _numbers(value: object, at_least: int) -> bool:
    return isinstance(value, list) and len(value) >= at_least and all(map(_number, value))


@functools.cache   # every test reads the same results tree: read it once
def _stored_dicts() -> list[dict]:
    """Every JSON object, at any depth, in every file under bench/results/."""
    found: list[dict] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            found.append(node)
        for child in node.values() if isinstance(node, dict) else node if isinstance(node, list) else ():
            walk(child)

    for path in RESULTS.rglob("*.json"):
        walk(json.loads(path.read_text()))
    return found


def _intervals(node: dict) -> Iterator[tuple[float | None, float, float]]:
    """(the mean stored beside it or None, low, high) for each interval in one object."""
    mean = node.get("mean")
    for key, value in node.items():
        if "interval" in key and _numbers(value, 2) and len(value) == 2:
            yield (float(mean) if _number(mean) else None), float(value[0]), float(value[1])


def _spreads(node: dict) -> Iterator[tuple[float, float]]:
    """(mean, std over seeds) for each figure in one object stored with its spread or its per-seed values."""
    per_seed = node.get("per_seed")
    for key, value in node.items():
        if not _number(value):
            continue
        for spread in ("spread", "std"):
            if key.endswith("mean") and _number(node.get(key[:-4] + spread)):
                yield float(value), float(node[key[:-4] + spread])
        if (isinstance(per_seed, list) and len(per_seed) > 1
                and all(isinstance(seed, dict) and _number(seed.get(key)) for seed in per_seed)):
            values = [seed[key] for seed in per_seed]
            yield float(value), statistics.pstdev(values)
            yield float(value), statistics.stdev(values)
    if _numbers(per_seed, 2):
        yield statistics.fmean(per_seed), statistics.pstdev(per_seed)
        yield statistics.fmean(per_seed), statistics.stdev(per_seed)


def _signed(text: str) -> str:
    text = text.replace("−", "-")
    return text if text[0] in "+-" else "+" + text


@functools.cache
def _printable_intervals() -> set[tuple[str, ...]]:
    """Every results interval as the docs may print it: 1 or 2 decimals, points or fraction, either sign;
    as (low, high) and, where a mean is stored with it, as (mean, low, high) too."""
    printable: set[tuple[str, ...]] = set()
    for mean, low, high in (found for node in _stored_dicts() for found in _intervals(node)):
        for scale in (1.0, 100.0, -1.0, -100.0):
            a, b = sorted((low * scale, high * scale))
            for decimals in (1, 2):
                pair = (f"{a:+.{decimals}f}", f"{b:+.{decimals}f}")
                printable.add(pair)
                if mean is not None:
                    printable.add((f"{mean * scale:+.{decimals}f}", *pair))
    return printable


@functools.cache
def _printable_spreads() -> set[tuple[str, ...]]:
    """Every stored (mean, std) as the docs may print it: 0 to 3 decimals, points, fraction or MB."""
    return {(f"{mean * scale:+.{decimals}f}", f"{spread * scale:.{decimals}f}")
            for node in _stored_dicts() for mean, spread in _spreads(node)
            for scale in (1.0, 100.0, 1e-6) for decimals in range(4)}


@functools.cache
def _printable_per_seed() -> set[tuple[str, ...]]:
    """Every stored per-seed list as the docs may print it: 1 or 2 decimals, points or fraction, either sign."""
    return {tuple(f"{value * scale:+.{decimals}f}" for value in values)
            for node in _stored_dicts() for key, values in node.items() if "per_seed" in key and _numbers(values, 2)
            for scale in (1.0, 100.0, -1.0, -100.0) for decimals in (1, 2)}


def _assert_quotes_held(pattern: re.Pattern[str], printable: set[tuple[str, ...]],
                        figures: Callable[[re.Match[str]], tuple[str, ...]], at_least: int,
                        what: str, how_to_fix: str) -> None:
    """Every quote of `pattern` in the docs must print as a stored figure; a quote count far below
    `at_least` means the pattern stopped matching the docs' format, not that they are all right."""
    quoted, unmatched = 0, []
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for match in pattern.finditer(line):
                quoted += 1
                if figures(match) not in printable and match.group(0) not in NOT_IN_A_REPORT:
                    unmatched.append(f"{page.relative_to(ROOT)}:{number}: {match.group(0)}")
    assert quoted > at_least, f"found only {quoted} quoted {what}: has the docs' format changed?"
    assert not unmatched, f"{what} no results file holds ({how_to_fix}):\n" + "\n".join(unmatched)


def _each_signed(match: re.Match[str]) -> tuple[str, ...]:
    return tuple(map(_signed, match.groups()))


def test_every_quoted_interval_is_in_a_results_file() -> None:
    assert _printable_intervals(), "no intervals under bench/results: the paired reports are missing"
    _assert_quotes_held(QUOTED, _printable_intervals(), _each_signed, 100, "intervals",
                        "re-run bench/paired_report.py and quote its figure, rounded once from the JSON, "
                        "or commit the report that computed it")


def test_every_mean_quoted_with_its_interval_is_the_stored_one() -> None:
    _assert_quotes_held(QUOTED_WITH_MEAN, _printable_intervals(), _each_signed, 50,
                        "means with an interval", "quote the mean stored beside the interval, rounded once")


def test_every_quoted_mean_and_spread_is_in_a_results_file() -> None:
    _assert_quotes_held(QUOTED_SPREAD, _printable_spreads(),
                        lambda match: (_signed(match[1] + match[2]), match[3]), 200, "mean ± std figures",
                        "quote the report's mean and spread, rounded once from the JSON; the matrix "
                        "report's spread is the population std over seeds")


def test_every_quoted_difference_per_seed_is_a_stored_list() -> None:
    _assert_quotes_held(QUOTED_PER_SEED, _printable_per_seed(),
                        lambda match: tuple(map(_signed, SIGNED.findall(match[0]))), 10,
                        "per-seed differences", "quote the paired report's per_seed, each rounded once "
                        "from the JSON, not the difference of two rounded figures")


def test_every_figure_not_in_a_report_is_still_quoted() -> None:
    docs = "\n".join(page.read_text() for page in PAGES)
    gone = [figure for figure in NOT_IN_A_REPORT if figure not in docs]
    assert not gone, f"NOT_IN_A_REPORT lists figures the docs no longer quote (remove them): {gone}"
