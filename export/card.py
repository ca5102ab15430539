"""The model card: the JSON file beside each ONNX file that says how to use it and where it came from.

A device that serves the model needs the input shape and how raw pixels become
the input (the data set's normalization), and the class names; an operator needs
the run, round, strategy and its settings, the measured test accuracy and the
file's SHA-256 to know which model is deployed. ``model.onnx`` gets ``model.card.json``
(:mod:`storage.cards` writes and reads the file).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from edge_client.data import (COLOR_KINDS, COLOR_NORMALIZATION, DIGITS_NORMALIZATION,
                              FASHION_MNIST_CLASSES, FASHION_MNIST_NORMALIZATION, parse_attribute_skew)
from edge_client.registry import METHODS, model_size
from storage.cards import CARD_FORMAT, card_path, write_card
from storage.pixels import Normalization

__all__ = ["CARD_FORMAT", "card_path", "class_names", "input_normalization", "strategy_config", "sha256",
           "write_card", "portable_path"]


def class_names(data_spec: str | None, num_classes: int) -> list[str]:
    """The data set's names for its labels; label numbers where it has none."""
    kind = (data_spec or "").partition(":")[0]
    if kind == "fashion-mnist" and num_classes == len(FASHION_MNIST_CLASSES):
        return list(FASHION_MNIST_CLASSES)
    return [str(i) for i in range(num_classes)]


def input_normalization(data_spec: str | None, partition: str, channels: int,
                        model: Normalization | None = None) -> dict[str, Any]:
    """How raw pixels become the model's input: ``x[c] = (pixel[c] * scale - mean[c]) / std[c]``.

    ``model``: the normalization in the model spec, which every device applied to its own data
    whatever its data set; the ``scale`` and ``pixel_range`` are those of ``data_spec``'s pixels.
    Without it (a checkpoint from before specs carried one): the data set's own, as the coordinator used it.
    """
    kind = (data_spec or "").partition(":")[0]
    formula = "x[c] = (pixel[c] * scale - mean[c]) / std[c]"
    own = {"digits": DIGITS_NORMALIZATION, "fashion-mnist": FASHION_MNIST_NORMALIZATION,
           "npz": Normalization.identity(channels)}.get(kind)
    skew = parse_attribute_skew(partition) if partition else None
    norm = model or (COLOR_NORMALIZATION if skew is not None and skew.kind in COLOR_KINDS else own)
    if norm is None:
        return {"note": f"unknown: the data spec {data_spec!r} is not recorded; feed inputs as in training"}
    scale, top = {"digits": (1 / 16, 16)}.get(kind, (1 / 255, 255))
    out: dict[str, Any] = {"formula": formula, "scale": scale, "mean": list(norm.mean), "std": list(norm.std),
                           "pixel_range": [0, top]}
    if kind == "npz":
        out["note"] = "uint8 images are scaled to [0, 1] (float images in the .npz are taken as [0, 1] pixels)"
    if skew is not None and skew.kind == "colorlabel":
        out["note"] = (f"RGB images: the run trained on {data_spec} painted in one colour per class, each of its "
                       f"{skew.domains} domains with its own class colours, followed with probability "
                       f"{skew.correlation:g} (partition {partition}); the model was tested on random colours")
    elif skew is not None and skew.kind == "color":
        out["note"] = (f"RGB images: the run trained on {data_spec} painted in {skew.domains} colour domains "
                       f"(partition {partition})")
    elif skew is not None:
        look = ("rotated into" if skew.kind == "rotate"
                else "with inverted contrast (light background) in the odd ones of")
        out["note"] = f"the run trained on images {look} {skew.domains} domains ({partition})"
    return out


def provenance(source: Any) -> dict[str, Any]:
    """What every card says about where its model came from: the run and round, the checkpoint (relative to
    the run directory), the strategy's settings, the model spec and its size. ``source``: an export.source.RunSource."""
    checkpoint, spec = source.checkpoint, source.checkpoint.model_spec
    return {"run": {"run_id": checkpoint.run_id, "round": checkpoint.round,
                    "checkpoint": portable_path(checkpoint.path, source.run_dir),
                    "run_dir": source.run_dir.resolve().name if source.run_dir else None},
            "strategy": strategy_config(source.config, checkpoint.strategy),
            "model": spec,
            "size": model_size(spec)}


def strategy_config(config: dict[str, Any], strategy: str) -> dict[str, Any]:
    """The strategy's name and the settings that shaped the model: rounds, seed, local training, its own sections."""
    run = config.get("run", {})
    out: dict[str, Any] = {"name": strategy}
    out.update({k: run[k] for k in ("rounds", "seed") if k in run})
    method = METHODS.get(strategy)   # a run of a method no longer registered keeps what its name says
    for section in ("train", *(method.sections if method is not None else (strategy,))):
        if isinstance(config.get(section), dict):
            out[section] = config[section]
    return out


def portable_path(path: Path, run_dir: Path | None) -> str:
    """``path`` as a card records it: relative to the run directory when inside it, else its name alone. A card
    travels with its model to devices and other machines, where the exporting machine's absolute paths mean nothing
    and tell its user names and folders."""
    path = Path(path).resolve()
    if run_dir is not None:
        try:
            return path.relative_to(Path(run_dir).resolve()).as_posix()
        except ValueError:
            pass
    return path.name


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
