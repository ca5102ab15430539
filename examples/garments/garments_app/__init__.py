"""A fedge app: garments told apart by a MobileNetV3-Small-class network, from scratch or fine-tuned.

Written against fedge's app interface alone (``edge_client.app``). The data is Fashion-MNIST turned into
coloured 3 x 48 x 48 pictures (:mod:`garments_app.data`); the federated task is its classes 5-9 (sandal,
shirt, sneaker, bag, ankle boot) as labels 0-4. Two apps share the package:

- ``app`` (``garments``) trains the whole network from the coordinator's initial weights;
- ``finetune`` (``garments-ft``) starts from a feature extractor pretrained on the other five classes
  (``python -m garments_app.pretrain`` writes ``pretrained.safetensors`` beside this file): every party
  loads it from that file, and only the classifier trains and travels.

Locations: a device reads an npz file written by ``python -m garments_app.split`` (``x`` uint8 pictures,
``y`` labels); the coordinator's evaluation reads ``fashion-mnist`` (the installed test split's target
classes), a directory holding the four IDX files, or such an npz file. The directory ``split`` writes serves
both in a simulation: its devices share its device files, the coordinator evaluates on its ``eval.npz``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from edge_client.app import App, ExampleInput, Metric, Samples, accuracy
from garments_app.data import CLASS_NAMES, DEFAULT_DIR, MEAN, SIZE, STD, TARGET_CLASSES, garments, to_inputs
from garments_app.network import mobilenet_v3_small

__all__ = ["app", "finetune", "model", "load_device", "load_eval", "TRAINABLE", "VERSION"]

VERSION = "1.0.0"
# What fine-tuning trains: the classifier (its hidden layer and output layer); the features stay as pretrained.
TRAINABLE = ("classifier.*",)


def model(options: Mapping[str, Any]) -> nn.Module:
    """MobileNetV3-Small with five outputs; ``[model] width`` scales its channels (1.0: the paper's network)."""
    return mobilenet_v3_small(num_classes=len(TARGET_CLASSES), width=float(options.get("width", 1.0)))


def _npz(path: Path) -> Samples:
    with np.load(path) as data:
        if "x" not in data or "y" not in data:
            raise ValueError(f"{path}: expected arrays x (pictures) and y (labels), found {sorted(data.files)}")
        x, y = data["x"], data["y"]
    if x.ndim != 4 or x.shape[1:] != (3, SIZE, SIZE):
        raise ValueError(f"{path}: pictures must be (N, 3, {SIZE}, {SIZE}), found {x.shape}")
    if x.dtype == np.uint8:
        inputs = to_inputs(x)
    elif x.dtype in (np.float16, np.float32):   # already normalized inputs
        inputs = torch.from_numpy(x.astype(np.float32))
    else:
        raise ValueError(f"{path}: pictures must be uint8 or float16/float32, found {x.dtype}")
    labels = torch.from_numpy(y.astype(np.int64))
    if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= len(TARGET_CLASSES)):
        raise ValueError(f"{path}: labels must be 0..{len(TARGET_CLASSES) - 1}, found {int(labels.min())}.."
                         f"{int(labels.max())}")
    return Samples(inputs, labels)


def load_device(location: str) -> Samples:
    """A device's pictures: an npz file written by ``python -m garments_app.split``, or the directory it wrote
    (every device file in it, for a simulation, which shares them out among its devices)."""
    path = Path(location)
    if path.is_dir():
        files = sorted(path.glob("device-*.npz"))
        if not files:
            raise ValueError(f"{location}: no device-*.npz files; write them with python -m garments_app.split")
        parts = [_npz(f) for f in files]
        return Samples(torch.cat([p.x for p in parts]), torch.cat([p.y for p in parts]))
    if path.suffix != ".npz" or not path.is_file():
        raise ValueError(f"{location}: a device reads an npz file of pictures (python -m garments_app.split OUT N)")
    return _npz(path)


def load_eval(location: str) -> Samples:
    """The evaluation pictures: ``fashion-mnist`` (the installed test split's target classes), a directory written
    by ``python -m garments_app.split`` (its ``eval.npz``) or holding the four IDX files (their test split's),
    or an npz file as a device reads."""
    path = Path(location)
    if path.is_dir() and (path / "eval.npz").is_file():
        return _npz(path / "eval.npz")
    if location == "fashion-mnist" or path.is_dir():
        pictures, labels = garments("test", TARGET_CLASSES, DEFAULT_DIR if location == "fashion-mnist" else path)
        return Samples(to_inputs(pictures), torch.from_numpy(labels))
    if path.suffix == ".npz" and path.is_file():
        return _npz(path)
    raise ValueError(f"{location}: evaluation reads 'fashion-mnist', a directory written by garments_app.split or "
                     "holding the four IDX files, or an npz file of pictures")


PREPROCESSING = {
    "input": f"float32 (batch, 3, {SIZE}, {SIZE}), channels first",
    "channels": "RGB",
    "resize": f"bilinear to {SIZE}x{SIZE}",
    "value_range": "pixel / 255, in [0, 1]",
    "normalize": {"mean": list(MEAN), "std": list(STD)},
    "classes": [CLASS_NAMES[c] for c in TARGET_CLASSES],
}


def _app(name: str, **fine_tuning: Any) -> App:
    """One declaration for both apps, so that they differ only in what fine-tuning adds (weights, trainable)."""
    return App(name=name, version=VERSION, model=model, example_input=ExampleInput((3, SIZE, SIZE)),
               device_data=load_device, eval_data=load_eval, loss=nn.functional.cross_entropy,
               metrics={"accuracy": Metric(accuracy)}, headline="accuracy", preprocessing=PREPROCESSING,
               **fine_tuning)


app = _app("garments")
finetune = _app("garments-ft", weights="pretrained.safetensors", trainable=list(TRAINABLE))
