"""The commands a tutorial page shows, and whether what they print still matches the page.

A tutorial shows a session as a ``console`` code block: ``$ COMMAND`` lines, each followed by what it
prints. A command continues on the next line after a trailing backslash. What the page shows must match
what the command prints, line by line, with two allowances for what changes from run to run:

* ``...`` inside a line matches any text (a time, a loss, a path);
* a line that is only ``...`` matches any number of lines (a table's rows, a progress bar);
* in a block marked ``numbers vary``, every number the page shows matches any number (a table of
  accuracies, byte counts and seconds from one run, shown as they were).

A page marks a block with an HTML comment on the line before it:

* ``<!-- tutorial: long -->``: it needs root, real hardware or many minutes; ``make tutorials`` runs it,
  the test suite does not;
* ``<!-- tutorial: skip -->``: shown, never run (what a device's own shell prints, say);
* ``<!-- tutorial: numbers vary -->``: run, its numbers matched loosely (above). Marks combine:
  ``<!-- tutorial: long, numbers vary -->``.

Blocks of one page run in order in one working directory, so a later command finds what an earlier wrote.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Command", "Block", "read_blocks", "mismatch"]

_FENCE = re.compile(r"^```console\s*$")
_MARK = re.compile(r"<!--\s*tutorial:\s*([a-z ,]+?)\s*-->")
_MARKS = {"long", "skip", "numbers vary"}
_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


@dataclass
class Command:
    text: str                       # what the shell runs (continuation lines included)
    shown: list[str] = field(default_factory=list)   # the output the page shows
    line: int = 0                   # where it is on the page (1-based), for the failure message


@dataclass
class Block:
    commands: list[Command]
    kind: str = "run"               # "run", "long" or "skip"
    numbers_vary: bool = False


def read_blocks(page: Path) -> list[Block]:
    """The page's console blocks, in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if not _FENCE.match(lines[i]):
            i += 1
            continue
        mark = _MARK.search(lines[i - 1]) if i else None
        marks = {m.strip() for m in mark.group(1).split(",")} if mark else set()
        if marks - _MARKS:
            raise ValueError(f"{page}:{i}: unknown tutorial mark {sorted(marks - _MARKS)}; known: {sorted(_MARKS)}")
        commands: list[Command] = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            text = lines[i]
            if text.startswith("$ "):
                number, command = i + 1, text[2:]
                while command.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    command += "\n" + lines[i]   # the shell reads backslash-newline as one line
                commands.append(Command(command, line=number))
            elif commands:
                commands[-1].shown.append(text)
            i += 1
        kind = "skip" if "skip" in marks else "long" if "long" in marks else "run"
        blocks.append(Block(commands, kind, "numbers vary" in marks))
        i += 1
    return blocks


def _literal(text: str, numbers_vary: bool) -> str:
    if not numbers_vary:
        return re.escape(text)
    pieces = _NUMBER.split(text)
    return _NUMBER.pattern.join(re.escape(piece) for piece in pieces)


def _line_pattern(shown: str, numbers_vary: bool = False) -> re.Pattern[str]:
    parts = [_literal(part, numbers_vary) for part in shown.rstrip().split("...")]
    return re.compile(".*".join(parts) + r"\s*")


def mismatch(shown: list[str], printed: str, numbers_vary: bool = False) -> str:
    """Where ``printed`` stops matching what the page shows ("" when it matches)."""
    out = [line.rstrip() for line in printed.splitlines()]
    while out and not out[-1]:
        out.pop()

    def match(s: int, o: int) -> bool:
        if s == len(shown):
            return o == len(out)
        if shown[s].strip() == "...":
            return any(match(s + 1, k) for k in range(o, len(out) + 1))
        return o < len(out) and bool(_line_pattern(shown[s], numbers_vary).fullmatch(out[o])) and match(s + 1, o + 1)

    if match(0, 0):
        return ""
    # the first shown line (not an ellipsis) that appears nowhere in order: the most useful pointer
    o = 0
    for s, text in enumerate(shown):
        if text.strip() == "...":
            continue
        pattern = _line_pattern(text, numbers_vary)
        found = next((k for k in range(o, len(out)) if pattern.fullmatch(out[k])), None)
        if found is None:
            return f"the page shows {text!r} (line {s + 1} of its output), which the command did not print there"
        o = found + 1
    return "the command printed lines the page does not show (add them, or a line '...' where output varies)"
