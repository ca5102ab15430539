"""Fashion-MNIST as coloured 3-channel pictures, split into a source task (tops) and a target task (the rest).

The IDX files come from the ``dataset-fashion-mnist`` package (``/usr/share/datasets/fashion-mnist``) or any
directory holding the four of them. Each 28x28 grey picture is resized (bilinear) to :data:`SIZE` and tinted
with a colour drawn at random for it, so the three channels differ as a camera's would; the colour is drawn
independently of the label, so it carries no information about the class and a model has to learn shapes.
Colours are drawn from a fixed seed per split, so a picture's colour is the same in every file written from it.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

__all__ = ["SIZE", "MEAN", "STD", "DEFAULT_DIR", "SOURCE_CLASSES", "TARGET_CLASSES", "CLASS_NAMES", "read_idx",
           "garments", "to_inputs"]

SIZE = 48                                    # pictures are 3 x SIZE x SIZE
MEAN, STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)   # inputs = (pixel / 255 - MEAN) / STD, per channel
DEFAULT_DIR = Path("/usr/share/datasets/fashion-mnist")
CLASS_NAMES = ("T-shirt/top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
               "ankle boot")
SOURCE_CLASSES = (0, 1, 2, 3, 4)             # what the feature extractor is pretrained on
TARGET_CLASSES = (5, 6, 7, 8, 9)             # what the federation learns, as labels 0..4
_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
          "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
_TINT_SEED = {"train": 0, "test": 1}


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (gzipped or not) as a numpy array: the format's magic number gives the dtype and rank."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        raw = fh.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes (magic {raw[:4].hex()})")
    rank = raw[3]
    dims = tuple(int(d) for d in np.frombuffer(raw, ">u4", rank, 4))
    data = np.frombuffer(raw, np.uint8, offset=4 + 4 * rank)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims} but holds {data.size} bytes")
    return data.reshape(dims)


def _find(directory: Path, stem: str) -> Path:
    for name in (stem + ".gz", stem):
        if (directory / name).is_file():
            return directory / name
    raise FileNotFoundError(f"{directory} has no {stem}[.gz]; install the dataset-fashion-mnist package "
                            "(apt-get install dataset-fashion-mnist) or name a directory with the four IDX files")


def garments(split: str, classes: tuple[int, ...], directory: Path = DEFAULT_DIR,
             limit: int = 0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The ``split`` ("train" or "test") pictures of ``classes`` as uint8 (N, 3, SIZE, SIZE), and their labels
    renumbered 0..len(classes)-1 in that order. ``limit`` > 0 keeps that many, drawn at random with ``seed``."""
    images = read_idx(_find(Path(directory), _FILES[split][0]))
    labels = read_idx(_find(Path(directory), _FILES[split][1])).astype(np.int64)
    tints = np.random.default_rng(_TINT_SEED[split]).uniform(0.25, 1.0, size=(len(images), 3)).astype(np.float32)
    keep = np.flatnonzero(np.isin(labels, classes))
    if limit > 0:
        keep = np.sort(np.random.default_rng(seed).permutation(keep)[:limit])
    pictures = np.empty((len(keep), 3, SIZE, SIZE), np.uint8)
    for start in range(0, len(keep), 2048):   # in chunks: the float copies of a whole split would not fit small devices
        index = keep[start:start + 2048]
        grey = torch.from_numpy(images[index].astype(np.float32)).unsqueeze(1)
        grey = F.interpolate(grey, size=(SIZE, SIZE), mode="bilinear", align_corners=False)
        tinted = grey * torch.from_numpy(tints[index])[:, :, None, None]
        pictures[start:start + len(index)] = tinted.round().clamp(0, 255).to(torch.uint8).numpy()
    renumber = np.full(10, -1, np.int64)
    renumber[list(classes)] = np.arange(len(classes))
    return pictures, renumber[labels[keep]]


def to_inputs(pictures: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 (N, 3, H, W) pictures as the model's float inputs: pixel / 255, then normalized per channel."""
    x = torch.as_tensor(pictures).to(torch.float32) / 255.0
    return (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
