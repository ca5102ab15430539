"""The live per-round table people watch while a run goes (rich)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from profiling.units import human_bytes

__all__ = ["RoundTable", "human_bytes"]

# Each column with the width of its plain-text line: the header or the widest usual cell ("1023.9 MB"),
# so that a round fits one 80-column line of a CI log (a wider cell widens its line, never wraps it).
_COLUMNS = (("round", 5), ("accuracy", 8), ("loss", 7), ("personal", 8), ("clients", 7), ("late/rej", 8),
            ("down", 9), ("up", 9), ("seconds", 7))


def _number(value: float | None) -> str:
    """Absent figures show as "-": DFL has no global test accuracy, most rounds no personalized one."""
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


class RoundTable:
    """Live table on a terminal; one plain line per round when output is a file or CI log."""

    def __init__(self, console: Console | None = None, title: str = "fedge") -> None:
        self.console = console or Console()
        self.table = Table(title=title)
        for name, _ in _COLUMNS:
            self.table.add_column(name, justify="right")
        self._live: Live | None = None

    def __enter__(self) -> "RoundTable":
        return self

    def add(self, row: dict[str, Any]) -> None:
        """Show a round; the table (or the header line) appears with the first one, so an error at
        start-up comes alone, not under an empty table."""
        cells = _cells(row)
        self.table.add_row(*cells)
        if self._live is None and self.console.is_terminal:
            self._live = Live(self.table, console=self.console, refresh_per_second=4)
            self._live.__enter__()
        elif self._live is None:
            if self.table.row_count == 1:
                self._print_line([name for name, _ in _COLUMNS])
            self._print_line(cells)

    def _print_line(self, cells: list[str]) -> None:
        """One line as is: rich would otherwise wrap it at the console's width, 80 columns when piped."""
        self.console.print(_plain_line(cells), soft_wrap=True, highlight=False, markup=False)

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
