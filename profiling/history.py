"""A device's profile history: one JSON object per line in ``STATE_DIR/profile.jsonl``.

The client appends one ``task`` line per task and ``fedge-profile infer`` one
``infer`` line per benchmark, so the history of a device survives restarts and
can be read with any JSON-lines tool. Appending one short line at a time keeps a
crash from corrupting earlier lines; a torn last line is skipped when reading.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

__all__ = ["HISTORY_FILE", "append_history", "read_jsonl"]

HISTORY_FILE = "profile.jsonl"


def append_history(state_dir: Path, kind: str, record: dict[str, Any]) -> Path:
    """Append ``record`` as a ``kind`` line (with the current time) to the device's history."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / HISTORY_FILE
    line = json.dumps({"kind": kind, "time": time.time(), **record})
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file; blank, torn or non-object lines are skipped."""
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows
