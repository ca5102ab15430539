"""Data sets: loading digits, Fashion-MNIST and npz files from a spec, split into train and test.

Every process (server and each client) loads the same spec the same way, so the
train/test split is fixed here instead of being shipped over the network. Nothing
is cached on disk. Each loaded file is checked, and what is wrong with it is said in
one line that names the file and the fix: a device's data is put there by hand.
"""

from __future__ import annotations

import gzip
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from storage.pixels import DataError, Normalization, Pixels, npz_pixels, read_npz

__all__ = ["DataError", "Dataset", "RawDataset", "load_dataset", "load_pixels", "load_own_pixels", "read_fashion_mnist",
           "DATASET_SPECS",
           "FASHION_MNIST_DIR", "FASHION_MNIST_MEAN", "FASHION_MNIST_STD", "FASHION_MNIST_CLASSES",
           "FASHION_MNIST_NORMALIZATION", "DIGITS_MEAN", "DIGITS_STD", "DIGITS_NORMALIZATION"]

DATASET_SPECS = "digits, fashion-mnist, fashion-mnist:DIR, npz:PATH"

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_MEAN = 0.2860
FASHION_MNIST_STD = 0.3530
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
                         "Bag", "Ankle boot")   # label i is the i-th name (the data set's own labelling)

# Mean/std of the digits TRAIN split after scaling to [0, 1] (pixel/16).
# Computed once with this module's fixed split:
#   x = load_digits().images / 16; x[train_idx].mean(), x[train_idx].std()
#   -> 0.305483..., 0.376110...  (tests/test_data.py re-checks these)
DIGITS_MEAN = 0.30548
DIGITS_STD = 0.37611
FASHION_MNIST_NORMALIZATION = Normalization((FASHION_MNIST_MEAN,), (FASHION_MNIST_STD,))
DIGITS_NORMALIZATION = Normalization((DIGITS_MEAN,), (DIGITS_STD,))

_TEST_FRACTION = 0.2
_SPLIT_SEED = 0  # fixed, so the train/test split never depends on a run's seed


@dataclass(frozen=True, eq=False)  # eq=False: array fields cannot be compared with ==
class Dataset:
    """A train/test pair of normalized square images, ready to turn into tensors."""

    name: str
    x_train: np.ndarray  # float32 [N, C, H, W]
    y_train: np.ndarray  # int64 [N]
    x_test: np.ndarray  # float32 [M, C, H, W]
    y_test: np.ndarray  # int64 [M]
    num_classes: int
    train_loaded: bool = True   # False: the train split was left out on purpose (load_dataset(train=False))
    normalization: Normalization | None = None   # how the images were made from [0, 1] pixels; None: unknown

    def __post_init__(self) -> None:
        for split, x, y in (("train", self.x_train, self.y_train), ("test", self.x_test, self.y_test)):
            if x.dtype != np.float32 or x.ndim != 4:
                raise DataError(f"{self.name}: x_{split} must be float32 [N, C, H, W], got {x.dtype} {x.shape}")
            if y.dtype != np.int64 or y.ndim != 1:
                raise DataError(f"{self.name}: y_{split} must be int64 [N], got {y.dtype} {y.shape}")
            if len(x) != len(y):
                raise DataError(f"{self.name}: {len(x)} {split} images but {len(y)} labels; counts must match")
            if len(x) == 0 and (split == "test" or self.train_loaded):
                raise DataError(f"{self.name}: empty {split} split; provide at least a few samples per class")
            if x.shape[2] != x.shape[3]:
                raise DataError(f"{self.name}: images must be square, got {split} H x W = {x.shape[2]} x {x.shape[3]}")
        if self.x_train.shape[1:] != self.x_test.shape[1:]:
            raise DataError(
                f"{self.name}: train images {self.x_train.shape[1:]} and test images "
                f"{self.x_test.shape[1:]} must have the same [C, H, W]"
            )

    @property
    def in_channels(self) -> int:
        """C, for sizing the first conv layer."""
        return int(self.x_test.shape[1])

    @property
    def image_size(self) -> int:
        """H (== W), for sizing the model."""
        return int(self.x_test.shape[2])



@dataclass(frozen=True, eq=False)  # eq=False: array fields cannot be compared with ==
class RawDataset:
    """A data set as stored: its pixels, labels and the normalization it recommends for a model's input."""

    name: str
    x_train: Pixels
    y_train: np.ndarray
    x_test: Pixels
    y_test: np.ndarray
    num_classes: int
    normalization: Normalization   # the data set's own (mean, std) of its [0, 1] pixels
    train_loaded: bool = True

    def normalized(self, normalization: Normalization | None = None) -> Dataset:
        """The model's inputs under ``normalization`` (None: the data set's own)."""
        norm = normalization or self.normalization
        return Dataset(self.name, self.x_train.normalized(norm), self.y_train, self.x_test.normalized(norm),
                       self.y_test, self.num_classes, self.train_loaded, norm)


def load_pixels(spec: str, *, train: bool = True) -> RawDataset:
    """Load a dataset's pixels from a spec: digits, fashion-mnist[:DIR] or npz:PATH.

    ``train=False``: the train split may be left empty where that saves memory, for a
    coordinator whose clients bring their own data."""
    kind, _, arg = spec.partition(":")
    if spec == "digits":
        return _digits_pixels()
    if kind == "fashion-mnist":
        return _fashion_mnist_pixels(Path(arg) if arg else Path(FASHION_MNIST_DIR), train=train)
    if kind == "npz" and arg:
        return _npz_dataset(Path(arg))
    raise DataError(f"unknown dataset spec {spec!r}; valid: {DATASET_SPECS}")


def load_own_pixels(spec: str) -> tuple[Pixels, np.ndarray, Normalization]:
    """The rows a device trains on from its own ``--data``: (pixels, labels, the data set's normalization).

    A device's npz file is all its own data: every row of ``x`` is kept for training (the fixed 80/20
    split serves a coordinator evaluating on such a file, not a device that needs every image it has;
    a held-out share for personalized evaluation is the run's ``data.local_test_fraction``). The built-in
    data sets give their train split, as in a simulation."""
    kind, _, arg = spec.partition(":")
    if kind == "npz" and arg:
        raw = _npz_dataset(Path(arg), split=False)
    else:
        raw = load_pixels(spec)
    return raw.x_train, raw.y_train, raw.normalization


def load_dataset(spec: str, *, train: bool = True, normalization: Normalization | None = None) -> Dataset:
    """Load a dataset from a spec as a model's inputs, normalized by ``normalization`` (a model spec's;
    None: the data set's own).

    ``train=False``: the train split may be left empty where that saves memory (Fashion-MNIST's
    is 188 MB as float32), for a coordinator whose clients bring their own data."""
    return load_pixels(spec, train=train).normalized(normalization)


def _fixed_split(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Seed-independent stratified 80/20 split -> (train_idx, test_idx), both sorted."""
    rng = np.random.default_rng(_SPLIT_SEED)
    train, test = [], []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        n_test = int(round(len(idx) * _TEST_FRACTION))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def _digits_pixels() -> RawDataset:
    try:  # imported lazily: only the digits spec needs scikit-learn
        from sklearn.datasets import load_digits
    except ImportError:
        raise DataError("digits: needs scikit-learn (pip install scikit-learn); else use fashion-mnist") from None

    bunch = load_digits()
    x = Pixels(bunch.images[:, None], 16.0)   # float64 0..16, as scikit-learn gives them
    y = bunch.target.astype(np.int64)
    tr, te = _fixed_split(y)
    return RawDataset("digits", x[tr], y[tr], x[te], y[te], 10, DIGITS_NORMALIZATION)


def _find_idx(directory: Path, name: str) -> Path:
    """DIR/NAME.gz or, failing that, DIR/NAME."""
    for path in (directory / f"{name}.gz", directory / name):
        if path.is_file():
            return path
    raise DataError(
        f"{directory}: missing {name}.gz (or {name}); download Fashion-MNIST there or pass fashion-mnist:DIR"
    )


def _read_idx(path: Path, magic: int, ndim: int) -> np.ndarray:
    """An unsigned-byte IDX file (gzip or plain; big-endian header) as a uint8 array.

    Decompressed straight into the array, so reading the 47 MB of training images holds
    47 MB, not the compressed file, the decompressed bytes and the array at once.
    """
    header = 4 + 4 * ndim
    try:
        with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
            head = f.read(header)
            if len(head) < header:
                raise DataError(f"{path}: truncated IDX header ({len(head)} bytes); re-download the file")
            found = int.from_bytes(head[:4], "big")
            if found != magic:
                raise DataError(f"{path}: wrong IDX magic {found}, expected {magic}; is this the right file?")
            dims = tuple(int(d) for d in np.frombuffer(head, ">u4", count=ndim, offset=4))
            out = np.empty(math.prod(dims), np.uint8)
            view, got = memoryview(out), 0
            while got < out.size:   # in 1 MiB steps: gzip's readinto decompresses a whole request at once
                n = f.readinto(view[got:got + (1 << 20)])
                if not n:
                    break
                got += n
            extra = len(f.read(1))
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: cannot read ({exc}); re-download the file") from None
    if got != out.size or extra:
        raise DataError(
            f"{path}: IDX dims {dims} need {out.size} data bytes but the file has "
            f"{'more' if extra else got}; file is truncated or corrupt, re-download it"
        )
    return out.reshape(dims)


def read_fashion_mnist(directory: Path, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 images [N, 28, 28], int64 labels) of one split (``train`` or ``t10k``), checked."""
    if not directory.is_dir():
        raise DataError(f"{directory}: Fashion-MNIST directory not found; pass fashion-mnist:DIR with the 4 IDX files")
    ipath = _find_idx(directory, f"{prefix}-images-idx3-ubyte")
    lpath = _find_idx(directory, f"{prefix}-labels-idx1-ubyte")
    images = _read_idx(ipath, 2051, 3)
    labels = _read_idx(lpath, 2049, 1)
    if len(images) != len(labels):
        raise DataError(f"{ipath}: {len(images)} images but {lpath.name} has {len(labels)} labels; counts must match")
    if len(labels) and labels.max() > 9:
        raise DataError(f"{lpath}: label {int(labels.max())} out of range 0..9; file is corrupt")
    return images, labels.astype(np.int64)


def _fashion_mnist_pixels(directory: Path, *, train: bool = True) -> RawDataset:
    splits: list = []
    for prefix in ("train", "t10k"):
        if prefix == "train" and not train:
            splits += [Pixels(np.empty((0, 1, 28, 28), dtype=np.uint8), 255.0), np.empty(0, dtype=np.int64)]
            continue
        images, labels = read_fashion_mnist(directory, prefix)
        splits += [Pixels(images[:, None], 255.0), labels]
    return RawDataset("fashion-mnist", *splits, num_classes=10, normalization=FASHION_MNIST_NORMALIZATION,
                      train_loaded=train)


def _npz_labels(path: Path, key: str, y: np.ndarray, n: int) -> np.ndarray:
    if y.ndim != 1:
        raise DataError(f"{path}: {key!r} must be 1-D labels, got shape {y.shape}")
    if not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{path}: {key!r} must hold integer labels, got {y.dtype}")
    if len(y) != n:
        raise DataError(f"{path}: {n} images but {len(y)} labels in {key!r}; counts must match")
    if len(y) and y.min() < 0:
        raise DataError(f"{path}: {key!r} has negative label {int(y.min())}; labels must be 0..num_classes-1")
    return y.astype(np.int64)


def _npz_dataset(path: Path, split: bool = True) -> RawDataset:
    """An npz of images (uint8 0..255, or float pixels in [0, 1]) and labels; the identity normalization (the
    pixels as they are) unless a model spec names another.

    ``split=False`` keeps every row of ``x`` as the train split (a device's own file); the test split is then
    ``x_test`` when the file has one, else the same rows, never used for training."""
    if not path.is_file():
        raise DataError(f"{path}: npz file not found; check the path in npz:PATH")
    arrays = read_npz(path)
    if "x" not in arrays or "y" not in arrays:
        raise DataError(f"{path}: needs arrays 'x' and 'y', found {sorted(arrays)}")
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise DataError(f"{path}: give both 'x_test' and 'y_test' or neither")
    x = npz_pixels(path, "x", arrays["x"])
    if len(x) == 0:
        raise DataError(f"{path}: empty dataset (0 samples in 'x')")
    y = _npz_labels(path, "y", arrays["y"], len(x))
    if "x_test" in arrays:
        x_test = npz_pixels(path, "x_test", arrays["x_test"])
        y_test = _npz_labels(path, "y_test", arrays["y_test"], len(x_test))
    elif not split:
        x_test, y_test = x, y
    else:
        tr, te = _fixed_split(y)
        if len(te) == 0:
            raise DataError(f"{path}: too few samples ({len(y)}) for an 80/20 split; add data or give x_test/y_test")
        x, y, x_test, y_test = x[tr], y[tr], x[te], y[te]
    num_classes = int(max(y.max(), y_test.max(initial=0))) + 1
    if x.values.shape[1:] != x_test.values.shape[1:]:
        raise DataError(f"{path}: 'x' images {x.values.shape[1:]} and 'x_test' images {x_test.values.shape[1:]} "
                        "must have the same [C, H, W]")
    return RawDataset("npz", x, y, x_test, y_test, num_classes, Normalization.identity(x.channels))

