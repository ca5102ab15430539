"""The live per-round table people watch while a run goes (rich)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from profiling.units import human_bytes

if TYPE_CHECKING:
    from coordinator.run_config import RunConfig

__all__ = ["RoundTable", "progress_line", "human_bytes", "mode_columns"]

# Each column with the width of its plain-text line: the header or the widest usual cell ("1023.9 MiB"),
# so that a round fits one 80-column line of a CI log (a wider cell widens its line, never wraps it).
_COLUMNS = (("round", 5), ("accuracy", 8), ("loss", 7), ("personal", 8), ("clients", 7), ("late/rej", 8),
            ("down", 10), ("up", 10), ("seconds", 7))


def _epsilon(row: dict[str, Any]) -> str:
    """The differential privacy spent so far (the row's ``dp_epsilon``, the run's composed epsilon)."""
    value = row.get("dp_epsilon")
    return "-" if value is None else f"{value:.2f}"


def _dropouts(row: dict[str, Any]) -> str:
    """A secure round's devices dropped, of the k - t dropouts its graph tolerates (degree k, threshold t)."""
    degree, threshold = row.get("secagg_degree"), row.get("secagg_threshold")
    if degree is None or threshold is None:
        return "-"
    return f"{row.get('secagg_dropped', 0)}/{degree - threshold}"


def _staleness(row: dict[str, Any]) -> str:
    """An asynchronous version's results: their mean and largest staleness (versions behind), "-" if none."""
    counts = {int(s): n for s, n in (row.get("staleness") or {}).items()}
    applied = sum(counts.values())
    if not applied:
        return "-"
    return f"{sum(s * n for s, n in counts.items()) / applied:.1f}/{max(counts)}"


# The columns a mode adds, each shown only where the mode is on: name, width, cell.
_MODE_COLUMNS: dict[str, tuple[str, int, Callable[[dict[str, Any]], str]]] = {
    "dp": ("ε spent", 7, _epsilon),
    "secagg": ("drop/tol", 8, _dropouts),
    "async": ("stale avg/max", 13, _staleness),
}


def mode_columns(config: RunConfig) -> list[str]:
    """The modes of ``config`` whose columns the table shows: differential privacy's epsilon, secure
    aggregation's dropouts and tolerance, asynchronous versions' staleness."""
    on = {"dp": config.privacy.mode in ("central", "local"), "secagg": config.secagg.enabled,
          "async": config.run.mode == "async"}
    return [mode for mode in _MODE_COLUMNS if on[mode]]


def _number(value: float | None) -> str:
    """Absent figures show as "-": a method without a global model has no test accuracy, most rounds
    no personalized one."""
    return "-" if value is None else f"{value:.4f}"


def _cells(row: dict[str, Any], headline: str = "accuracy") -> list[str]:
    return [
        str(row["round"]),
        _number(row.get(f"test_{headline}")),
        _number(row.get("test_loss")),
        _number(row.get("personalized_accuracy_mean")),
        f"{row.get('returned', 0)}/{row.get('selected', 0)}",
        f"{row.get('late', 0)}/{row.get('rejected', 0)}",
        human_bytes(row.get("bytes_down", 0)),
        human_bytes(row.get("bytes_up", 0)),
        f"{row.get('seconds', 0.0):.1f}",
    ]


def _plain_line(cells: list[str], columns: tuple[tuple[str, int], ...] = _COLUMNS) -> str:
    return " ".join(f"{cell:>{width}}" for cell, (_, width) in zip(cells, columns))


def progress_line(info: dict[str, Any], now: float | None = None) -> str:
    """One line on what the run is doing between rounds (see ``Coordinator.on_progress``)."""
    if info.get("kind") == "waiting":
        online, needed = info["online"], info["needed"]
        shown = ", ".join(online[:8]) + (f" and {len(online) - 8} more" if len(online) > 8 else "")
        return f"waiting for clients: {len(online)}/{needed} online" + (f" ({shown})" if online else "")
    elapsed = (time.monotonic() if now is None else now) - info["started"]
    phase = "" if info["phase"] == "train" else f" {info['phase']}"
    attempt = f" (attempt {info['attempt']})" if info["attempt"] > 1 else ""
    return (f"round {info['round']}{phase}{attempt}: {info['results']}/{info['selected']} results, "
            f"{human_bytes(info['bytes_down'])} down, {human_bytes(info['bytes_up'])} up, "
            f"{elapsed:.0f} s of {info['timeout']:.0f} s")


def _counts(info: dict[str, Any]) -> tuple[Any, ...]:
    """The stage a progress report is about, then its two counts (which the log line is printed for)."""
    if info.get("kind") == "waiting":
        return ("waiting", info["needed"], len(info["online"]), tuple(info["online"]))
    return ("exchange", info["round"], info["phase"], info["attempt"], info["results"], info["selected"])


class _View:
    """What the live display shows: the rounds so far (once there is one) and the progress line."""

    def __init__(self, table: Table) -> None:
        self.table = table
        self.progress: dict[str, Any] | None = None

    def __rich__(self) -> Group:
        parts: list[Any] = [self.table] if self.table.row_count else []
        if self.progress is not None:
            parts.append(Text(progress_line(self.progress), style="dim"))
        return Group(*parts)


class RoundTable:
    """Live table and progress line on a terminal; plain lines when output is a file or CI log."""

    PIPED_EVERY = 10.0   # seconds between progress lines in a log, unless something new happened

    def __init__(self, console: Console | None = None, title: str = "fedge", modes: list[str] | None = None,
                 headline: str = "accuracy") -> None:
        """``modes``: those whose columns to add (:func:`mode_columns`); ``headline``: the metric in the second
        column (the run's app's headline, ``test_NAME`` in the rows)."""
        self.console = console or Console()
        self.table = Table(title=title)
        self._headline = headline
        self._modes = [_MODE_COLUMNS[mode] for mode in modes or []]
        first = ((_COLUMNS[1][0] if headline == "accuracy" else headline), max(_COLUMNS[1][1], len(headline)))
        self._columns = (_COLUMNS[0], first, *_COLUMNS[2:]) + tuple((name, width) for name, width, _ in self._modes)
        for name, _ in self._columns:
            self.table.add_column(name, justify="right")
        self._view = _View(self.table)
        self._live: Live | None = None
        self._printed: tuple[tuple[Any, ...], float] = ((), 0.0)   # counts of the last line in a log, and when

    def __enter__(self) -> "RoundTable":
        return self

    def add(self, row: dict[str, Any]) -> None:
        """Show a round; the table (or the header line) appears with the first one, so an error at
        start-up comes alone, not under an empty table."""
        cells = _cells(row, self._headline) + [cell(row) for _, _, cell in self._modes]
        self.table.add_row(*cells)
        self._view.progress = None
        if self.console.is_terminal:
            self._start_live()
        else:
            if self.table.row_count == 1:
                self._print_line([name for name, _ in self._columns])
            self._print_line(cells)

    def progress(self, info: dict[str, Any]) -> None:
        """Clients coming online, results coming in: a line under the table on a terminal. In a log, a
        line for every count of clients online while waiting for them, and for a round when its counts
        changed, at most every ``PIPED_EVERY`` seconds and only once it has lasted that long (a quick
        round adds no lines). Other kinds (a round's start and end) have nothing to show."""
        if info.get("kind") not in ("waiting", "exchange"):
            return
        self._view.progress = info
        if self.console.is_terminal:
            self._start_live()
            return
        counts, now = _counts(info), time.monotonic()
        if counts[:-2] != self._printed[0][:-2]:   # a new stage: waiting, or another round, phase or attempt
            self._printed = (counts[:-2], -float("inf") if info.get("kind") == "waiting" else now)
        if counts != self._printed[0] and (counts[0] == "waiting" or now - self._printed[1] >= self.PIPED_EVERY):
            self.console.print(progress_line(info), soft_wrap=True, highlight=False, markup=False)
            self._printed = (counts, now)

    def _start_live(self) -> None:
        if self._live is None:
            self._live = Live(self._view, console=self.console, refresh_per_second=4)
            self._live.__enter__()

    def _print_line(self, cells: list[str]) -> None:
        """One line as is: rich would otherwise wrap it at the console's width, 80 columns when piped."""
        self.console.print(_plain_line(cells, self._columns), soft_wrap=True, highlight=False, markup=False)

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._view.progress = None
            self._live.__exit__(None, None, None)
