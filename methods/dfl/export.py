"""DFL's export hook: a DFL run has no global model, only devices' personalized ones."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from export.hooks import ExportHook

__all__ = ["HOOK"]


def _no_global(spec: Mapping[str, Any]) -> str | None:
    if spec.get("name") != "dfl":
        return None
    return ("DFL has no global model: the coordinator holds only the invariant extractor and each predictor stays "
            "on its device; export a device's model with fedge-export RUN_DIR --client-state STATE_DIR")


HOOK = ExportHook(no_global=_no_global)
