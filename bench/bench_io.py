"""Where a benchmark's figures go: one JSON file in bench/results/, said on the console."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Write ``result`` as indented JSON to ``path`` (its directory made if missing) and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {path}")
