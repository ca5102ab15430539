"""A device's profile history: one JSON object per line in ``STATE_DIR/profile.jsonl``.

The client appends one ``task`` line per task and ``fedge-profile infer`` one
``infer`` line per benchmark, so the history of a device survives restarts and
can be read with any JSON-lines tool. Appending one short line at a time keeps a
crash from corrupting earlier lines; a torn last line is skipped when reading
(``read_jsonl``, fedge's one JSON-lines reader, offered here beside the appender).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from storage.files import read_jsonl

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

