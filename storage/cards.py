"""Model cards on disk: the JSON file beside each ONNX file (``model.onnx`` -> ``model.card.json``), its one
writer and its one reader.

The export writes cards (:mod:`export.card` says what goes in them); ``fedge-profile infer`` reads the one
beside a model on a device that has onnxruntime and numpy but no torch, so nothing heavy is imported here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from storage.errors import FedgeError
from storage.files import write_atomic

__all__ = ["CARD_FORMAT", "CardError", "card_path", "write_card", "read_card"]

CARD_FORMAT = "fedge-model-card/1"


class CardError(FedgeError, ValueError):
    """A card that is not readable JSON or not a fedge model card; the message names the file."""


def card_path(onnx_path: Path) -> Path:
    """``DIR/NAME.onnx`` -> ``DIR/NAME.card.json``."""
    return onnx_path.with_name(onnx_path.stem + ".card.json")


def write_card(onnx_path: Path, card: dict[str, Any]) -> Path:
    """Write ``card`` beside ``onnx_path`` atomically; its path."""
    path = card_path(onnx_path)
    write_atomic(path, (json.dumps({"format": CARD_FORMAT, **card}, indent=2) + "\n").encode())
    return path


def read_card(onnx_path: Path) -> dict[str, Any] | None:
    """The card beside ``onnx_path``; None when there is none, CardError when it is not a fedge model card."""
    path = card_path(Path(onnx_path))
    if not path.is_file():
        return None
    try:
        card = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CardError(f"{path} is not readable JSON ({exc}); export the model again with fedge-export") from None
    if not isinstance(card, dict) or card.get("format") != CARD_FORMAT:
        raise CardError(f"{path} is not a fedge model card (no \"format\": \"{CARD_FORMAT}\")")
    return card
