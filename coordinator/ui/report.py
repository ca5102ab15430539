"""The live per-round table people watch while a run goes (rich)."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from profiling.units import human_bytes

__all__ = ["RoundTable", "progress_line", "human_bytes"]

# Each column with the width of its plain-text line: the header or the widest usual cell ("1023.9 MiB"),
# so that a round fits one 80-column line of a CI log (a wider cell widens its line, never wraps it).
_COLUMNS = (("round", 5), ("accuracy", 8), ("loss", 7), ("personal", 8), ("clients", 7), ("late/rej", 8),
            ("down", 10), ("up", 10), ("seconds", 7))


def _number(value: float | None) -> str:
    """Absent figures show as "-": a method without a global model has no test accuracy, most rounds
    no personalized one."""
    return "-" if value is None else f"{value:.4f}"


def _cells(row: dict[str, Any]) -> list[str]:
    return [
        str(row["round"]),
        _number(row.get("test_accuracy")),
        _number(row.get("test_loss")),
        _number(row.get("personalized_accuracy_mean")),
        f"{row.get('returned', 0)}/{row.get('selected', 0)}",
        f"{row.get('late', 0)}/{row.get('rejected', 0)}",
        human_bytes(row.get("bytes_down", 0)),
        human_bytes(row.get("bytes_up", 0)),
        f"{row.get('seconds', 0.0):.1f}",
    ]


def _plain_line(cells: list[str]) -> str:
    return " ".join(f"{cell:>{width}}" for cell, (_, width) in zip(cells, _COLUMNS))


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

    def __init__(self, console: Console | None = None, title: str = "fedge") -> None:
        self.console = console or Console()
        self.table = Table(title=title)
        for name, _ in _COLUMNS:
            self.table.add_column(name, justify="right")
        self._view = _View(self.table)
        self._live: Live | None = None
        self._printed: tuple[tuple[Any, ...], float] = ((), 0.0)   # counts of the last line in a log, and when

    def __enter__(self) -> "RoundTable":
        return self

    def add(self, row: dict[str, Any]) -> None:
        """Show a round; the table (or the header line) appears with the first one, so an error at
        start-up comes alone, not under an empty table."""
        cells = _cells(row)
        self.table.add_row(*cells)
        self._view.progress = None
        if self.console.is_terminal:
            self._start_live()
        else:
            if self.table.row_count == 1:
                self._print_line([name for name, _ in _COLUMNS])
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
        self.console.print(_plain_line(cells), soft_wrap=True, highlight=False, markup=False)

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._view.progress = None
            self._live.__exit__(None, None, None)
