"""Datasets and client partitions for fedge.

Every process (server and each client) calls the same functions with the same
specs and seeds, so splits and partitions are computed deterministically here
instead of being shipped over the network.  Nothing is cached on disk.
"""

from __future__ import annotations

import colorsys
import gzip
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from storage.pixels import DataError, Normalization, Pixels, npz_pixels, read_npz

__all__ = [
    "DataError",
    "Dataset",
    "RawDataset",
    "load_dataset",
    "load_pixels",
    "client_pixels",
    "model_normalization",
    "pixel_normalization",
    "partition_indices",
    "client_split",
    "load_client_split",
    "ClientRows",
    "arrange_clients",
    "describe_partitions",
    "holdout_split",
    "AttributeSkew",
    "ATTRIBUTE_KINDS",
    "parse_attribute_skew",
    "domain_palette",
    "evaluation_split",
    "DATASET_SPECS",
    "PARTITION_SPECS",
]

DATASET_SPECS = "digits, fashion-mnist, fashion-mnist:DIR, npz:PATH"
PARTITION_SPECS = ("iid, dirichlet:ALPHA (ALPHA > 0), shards:K (K >= 1 integer), "
                   "attribute:KIND:DOMAINS[+LABEL_SPEC] (KIND color, rotate or invert)")

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
# Colour domains (attribute:color) are RGB centred on 0.5: their own normalization, whatever the data set's.
COLOR_NORMALIZATION = Normalization((0.5,) * 3, (0.5,) * 3)

_TEST_FRACTION = 0.2
_SPLIT_SEED = 0  # fixed, so the train/test split never depends on a run's seed
_DIRICHLET_TRIES = 100


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


# --------------------------------------------------------------------------- loading


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


def _fashion_mnist_raw(directory: Path, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 images [N, 28, 28], int64 labels) of one split (``train`` or ``t10k``), checked."""
    if not directory.is_dir():
        raise DataError(f"{directory}: Fashion-MNIST directory not found; pass fashion-mnist:DIR with the 4 IDX files")
    ipath, lpath = _find_idx(directory, f"{prefix}-images-idx3-ubyte"), _find_idx(directory, f"{prefix}-labels-idx1-ubyte")
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
        images, labels = _fashion_mnist_raw(directory, prefix)
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


def _npz_dataset(path: Path) -> RawDataset:
    """An npz of images (uint8 0..255, or float pixels in [0, 1]) and labels; the identity normalization (the
    pixels as they are) unless a model spec names another."""
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


# --------------------------------------------------------------------------- partitions


def _parse_partition_spec(spec: str) -> tuple[str, float]:
    kind, sep, arg = spec.partition(":")
    try:
        if spec == "iid":
            return "iid", 0.0
        if kind == "dirichlet" and sep:
            alpha = float(arg)
            if math.isfinite(alpha) and alpha > 0:
                return kind, alpha
        if kind == "shards" and sep and int(arg) >= 1:
            return kind, int(arg)
    except ValueError:
        pass
    raise DataError(f"bad partition spec {spec!r}; valid: {PARTITION_SPECS}")


def partition_indices(labels: np.ndarray, spec: str, num_partitions: int, seed: int) -> list[np.ndarray]:
    """Split sample indices into `num_partitions` sorted, disjoint, non-empty parts.

    Deterministic in (labels, spec, num_partitions, seed), so every process agrees
    on which samples each client owns without exchanging them.
    """
    skew = parse_attribute_skew(spec)
    if skew is not None:   # the attribute changes the images, not who owns which sample
        return partition_indices(labels, skew.labels, num_partitions, seed)
    kind, arg = _parse_partition_spec(spec)
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"labels must be a 1-D integer array, got {labels.dtype} {labels.shape}")
    n = len(labels)
    if not 1 <= num_partitions <= n:
        raise DataError(f"num_partitions must be in 1..{n} (number of samples), got {num_partitions}")
    rng = np.random.default_rng(seed)

    if kind == "iid":
        parts = np.array_split(rng.permutation(n), num_partitions)
    elif kind == "dirichlet":
        parts = _dirichlet(labels, arg, num_partitions, rng, spec)
    else:
        k = int(arg)
        if num_partitions * k > n:
            raise DataError(f"{spec}: {num_partitions} partitions x {k} shards exceeds {n} samples; use a smaller K")
        shards = np.array_split(np.argsort(labels, kind="stable"), num_partitions * k)
        order = rng.permutation(num_partitions * k)
        parts = [np.concatenate([shards[s] for s in order[i * k : (i + 1) * k]]) for i in range(num_partitions)]

    out = [np.sort(p).astype(np.int64) for p in parts]
    for i, p in enumerate(out):
        if len(p) == 0:
            raise DataError(f"{spec}: partition {i} is empty; use fewer partitions")
    return out


def _dirichlet(
    labels: np.ndarray, alpha: float, num_partitions: int, rng: np.random.Generator, spec: str
) -> list[np.ndarray]:
    """Label-skewed split: per class, proportions ~ Dir(alpha); retry until no partition is tiny."""
    min_size = min(10, len(labels) // num_partitions)
    classes = np.unique(labels)
    for _ in range(_DIRICHLET_TRIES):
        buckets: list[list[np.ndarray]] = [[] for _ in range(num_partitions)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            cuts = (np.cumsum(rng.dirichlet([alpha] * num_partitions))[:-1] * len(idx)).astype(int)
            for bucket, piece in zip(buckets, np.split(idx, cuts)):
                bucket.append(piece)
        parts = [np.concatenate(b) for b in buckets]
        if min(len(p) for p in parts) >= min_size:
            return parts
    raise DataError(
        f"{spec}: no draw in {_DIRICHLET_TRIES} tries gave every one of {num_partitions} partitions "
        f">= {min_size} samples; use a larger alpha or fewer clients"
    )


def client_pixels(spec: str, partition_spec: str, index: int, num_partitions: int,
                  seed: int) -> tuple[Pixels, np.ndarray, Normalization]:
    """Pixels and labels of partition ``index`` of dataset ``spec``'s train split, and the data set's
    own normalization: what a device keeps to make any model's inputs from (a plain label partition;
    attribute partitions change the images themselves, see :func:`load_client_split`).

    Fashion-MNIST's training images stay uint8 (47 MB) and only the partition's rows are kept."""
    if parse_attribute_skew(partition_spec) is not None:
        raise DataError(f"{partition_spec}: an attribute partition's images are its domains' inputs, not pixels; "
                        "load them with load_client_split")
    if not 0 <= index < num_partitions:
        raise DataError(f"partition index {index} out of range 0..{num_partitions - 1}")
    kind, _, arg = spec.partition(":")
    if kind == "fashion-mnist":
        images, labels = _fashion_mnist_raw(Path(arg) if arg else Path(FASHION_MNIST_DIR), "train")
        idx = partition_indices(labels, partition_spec, num_partitions, seed)[index]
        return Pixels(images[idx][:, None], 255.0), labels[idx], FASHION_MNIST_NORMALIZATION
    raw = load_pixels(spec)
    idx = partition_indices(raw.y_train, partition_spec, num_partitions, seed)[index]
    return raw.x_train[idx], raw.y_train[idx], raw.normalization


def load_client_split(spec: str, partition_spec: str, index: int, num_partitions: int,
                      seed: int) -> tuple[np.ndarray, np.ndarray]:
    """What :func:`client_split` gives partition ``index`` of dataset ``spec``, holding less on the way.

    A simulated client needs only its partition's rows: Fashion-MNIST's training images stay
    uint8 (47 MB) until its rows are picked and only those become float32, instead of the whole
    train and test splits in float32 (219 MB). Attribute partitions (which scale by the whole
    split's intensity range) load the whole dataset.
    """
    if parse_attribute_skew(partition_spec) is not None:
        return client_split(load_dataset(spec), partition_spec, index, num_partitions, seed)
    pixels, labels, normalization = client_pixels(spec, partition_spec, index, num_partitions, seed)
    return pixels.normalized(normalization), labels


def client_split(
    dataset: Dataset, partition_spec: str, index: int, num_partitions: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of partition `index` of the train split: what one client trains on."""
    if not 0 <= index < num_partitions:
        raise DataError(f"partition index {index} out of range 0..{num_partitions - 1}")
    idx = partition_indices(dataset.y_train, partition_spec, num_partitions, seed)[index]
    skew = parse_attribute_skew(partition_spec)
    if skew is None:
        return dataset.x_train[idx], dataset.y_train[idx]
    domains = np.full(len(idx), skew.domain_of(index))
    return skew.apply(dataset.x_train[idx], domains, _intensity_range(dataset)), dataset.y_train[idx]


def holdout_split(x: np.ndarray, y: np.ndarray, fraction: float, seed: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Split a client's data into (x_train, y_train, x_test, y_test) for personalized evaluation.

    Seeded, so a restarted client holds out exactly the same samples.
    """
    train, test = _holdout_rows(len(y), fraction, seed)
    return x[train], y[train], x[test], y[test]


def _holdout_rows(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) positions of :func:`holdout_split` among ``n`` samples, each sorted."""
    if not 0.0 <= fraction < 1.0:
        raise DataError(f"local test fraction must be in [0, 1), got {fraction}")
    n_test = int(round(n * fraction))
    if fraction > 0 and (n_test == 0 or n_test == n):
        raise DataError(f"a local test fraction of {fraction} leaves no train or no test samples out of {n}")
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[n_test:]), np.sort(order[:n_test])


@dataclass(frozen=True, eq=False)  # eq=False: array fields cannot be compared with ==
class ClientRows:
    """Many clients' data in one pair of arrays, client after client, each client's train rows then
    its local test rows: a client's data is two slices of them (views, no copy)."""

    x: np.ndarray                         # float32 [N, C, H, W], shared by all clients
    y: np.ndarray                         # int64 [N]
    rows: tuple[np.ndarray, ...]          # per client: its rows of the train split, in the order held here
    bounds: tuple[tuple[int, int, int], ...]   # per client: where its train rows start, its test rows, the end

    def __len__(self) -> int:
        return len(self.bounds)

    def client(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(x_train, y_train, x_test, y_test) of client ``index``, as :func:`client_split` and
        :func:`holdout_split` give them, but views of the shared arrays."""
        start, test, end = self.bounds[index]
        return self.x[start:test], self.y[start:test], self.x[test:end], self.y[test:end]


def arrange_clients(dataset: Dataset, partition_spec: str, num_partitions: int, seed: int, test_fraction: float,
                    holdout_seeds: list[int]) -> ClientRows:
    """The train split arranged for ``num_partitions`` clients of one process (a simulation): the
    same samples, in the same order, as each client's :func:`client_split` then :func:`holdout_split`
    with its ``holdout_seeds[i]``, but in one array that every client's data is a view of."""
    if len(holdout_seeds) != num_partitions:
        raise DataError(f"{len(holdout_seeds)} holdout seeds for {num_partitions} partitions; give one per client")
    parts = partition_indices(dataset.y_train, partition_spec, num_partitions, seed)
    rows, bounds, start = [], [], 0
    for part, holdout_seed in zip(parts, holdout_seeds):
        train, test = _holdout_rows(len(part), test_fraction, holdout_seed)
        rows.append(np.concatenate([part[train], part[test]]))
        bounds.append((start, start + len(train), start + len(part)))
        start += len(part)
    order = np.concatenate(rows)
    skew = parse_attribute_skew(partition_spec)
    if skew is None:
        x = dataset.x_train[order]
    else:   # each client's images as seen in its domain
        domains = np.concatenate([np.full(len(r), skew.domain_of(i)) for i, r in enumerate(rows)])
        x = skew.apply(dataset.x_train[order], domains, _intensity_range(dataset))
    return ClientRows(x, dataset.y_train[order], tuple(rows), tuple(bounds))


def describe_partitions(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> list[dict]:
    """Per-partition size and nonzero class counts, for logging how skewed a split is."""
    out = []
    for i, p in enumerate(parts):
        counts = np.bincount(np.asarray(labels)[p], minlength=num_classes)
        classes = {int(c): int(n) for c, n in enumerate(counts) if n}
        out.append({"index": i, "size": int(len(p)), "classes": classes})
    return out


# --------------------------------------------------------------------------- attribute skew

ATTRIBUTE_KINDS = ("color", "rotate", "invert")


@dataclass(frozen=True)
class AttributeSkew:
    """``attribute:KIND:DOMAINS[+LABEL_SPEC]``: clients differ in how their images look, not in labels.

    Client ``i`` belongs to domain ``i % DOMAINS``; its domain changes one attribute
    that does not decide the label: ``color`` paints background and foreground of a
    grayscale image with the domain's two colours (3 channels), ``rotate`` turns the
    image by ``360 * domain / DOMAINS`` degrees, ``invert`` shows the odd domains' images
    with inverted contrast (light background, dark ink) and the even domains' as they
    are. Who owns which sample is decided by
    LABEL_SPEC (``iid`` when absent, or e.g. ``dirichlet:0.5`` to add label skew).
    """

    kind: str
    domains: int
    labels: str = "iid"

    def domain_of(self, index: int) -> int:
        return index % self.domains

    def apply(self, x: np.ndarray, domains: np.ndarray, intensity: tuple[float, float]) -> np.ndarray:
        """Images ``x`` [N, C, H, W] as seen in ``domains`` [N] (one domain per image)."""
        if self.kind == "color":
            return _colorize(x, domains, self.domains, intensity)
        if self.kind == "invert":
            lo, hi = intensity
            return np.where((domains % 2 == 1)[:, None, None, None], np.float32(lo + hi) - x, x).astype(np.float32)
        return _rotate(x, domains, self.domains, fill=intensity[0])


def parse_attribute_skew(spec: str) -> AttributeSkew | None:
    """The attribute skew a partition spec asks for; None for a plain label partition."""
    if not spec.startswith("attribute:"):
        return None
    head, plus, labels = spec.partition("+")
    parts = head.split(":")
    valid = (len(parts) == 3 and parts[1] in ATTRIBUTE_KINDS and parts[2].isdigit() and int(parts[2]) >= 1
             and (not plus or (labels != "" and not labels.startswith("attribute:"))))
    if not valid:
        raise DataError(f"bad partition spec {spec!r}; attribute skew is attribute:KIND:DOMAINS[+LABEL_SPEC] "
                        f"with KIND one of {', '.join(ATTRIBUTE_KINDS)}, DOMAINS >= 1 and LABEL_SPEC a plain "
                        f"spec (iid, dirichlet:ALPHA, shards:K), e.g. attribute:color:5+dirichlet:0.5")
    if plus:
        _parse_partition_spec(labels)
    return AttributeSkew(parts[1], int(parts[2]), labels or "iid")


def domain_palette(domain: int, domains: int) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """(foreground, background) RGB in [0, 1] of a colour domain.

    Backgrounds are dark and evenly spread around the hue circle; each foreground
    is a light colour of the opposite hue, so every domain stays readable.
    """
    hue = (domain % domains) / domains
    return colorsys.hsv_to_rgb((hue + 0.5) % 1.0, 0.5, 1.0), colorsys.hsv_to_rgb(hue, 0.8, 0.5)


def model_normalization(dataset: Dataset, partition_spec: str) -> Normalization | None:
    """The normalization of the inputs a model trained on ``dataset`` under ``partition_spec`` gets, for its
    spec: the data set's, except colour domains, which are RGB with their own. Rotation and inverted
    contrast keep the data set's (they move and mirror intensities within its range)."""
    skew = parse_attribute_skew(partition_spec)
    if skew is not None and skew.kind == "color":
        return COLOR_NORMALIZATION
    return dataset.normalization


def pixel_normalization(model: Normalization | None, partition_spec: str) -> Normalization | None:
    """What to normalize a data set's pixels with so that, under ``partition_spec``, they become the inputs
    of a model whose spec says ``model``: ``model`` itself, except under colour domains, which set their
    own (None: the data set's own, as the run loaded it)."""
    skew = parse_attribute_skew(partition_spec)
    return None if skew is not None and skew.kind == "color" else model


def _intensity_range(dataset: Dataset) -> tuple[float, float]:
    """Darkest and brightest value of the dataset's train split (its test split when the train split was
    not loaded; Fashion-MNIST's have the same): background and full ink."""
    x = dataset.x_train if len(dataset.x_train) else dataset.x_test
    return float(x.min()), float(x.max())


def _colorize(x: np.ndarray, domains: np.ndarray, count: int, intensity: tuple[float, float]) -> np.ndarray:
    if x.shape[1] != 1:
        raise DataError(f"attribute:color needs grayscale images (1 channel), got {x.shape[1]} channels; "
                        "use attribute:rotate for colour images")
    lo, hi = intensity
    ink = np.clip((x - lo) / max(hi - lo, 1e-12), 0.0, 1.0)            # [N, 1, H, W] in [0, 1]
    palettes = [domain_palette(d, count) for d in range(count)]
    fg = np.array([p[0] for p in palettes], np.float32)[domains][:, :, None, None]   # [N, 3, 1, 1]
    bg = np.array([p[1] for p in palettes], np.float32)[domains][:, :, None, None]
    rgb = bg + (fg - bg) * ink
    return COLOR_NORMALIZATION.apply(rgb, 1.0)                         # centred, in [-1, 1]


def _rotate(x: np.ndarray, domains: np.ndarray, count: int, fill: float) -> np.ndarray:
    """Each image turned counter-clockwise by its domain's angle about its centre (bilinear)."""
    out = x.copy()
    size = x.shape[2]
    centre = (size - 1) / 2.0
    rows, cols = np.meshgrid(np.arange(size) - centre, np.arange(size) - centre, indexing="ij")
    for d in np.unique(domains):
        angle = 2 * math.pi * int(d) / count
        if angle == 0:
            continue
        cos, sin = round(math.cos(angle), 12), round(math.sin(angle), 12)
        # Where each output pixel comes from: the inverse rotation of its position.
        src_r = cos * rows + sin * cols + centre
        src_c = -sin * rows + cos * cols + centre
        r0, c0 = np.floor(src_r).astype(int), np.floor(src_c).astype(int)
        fr, fc = (src_r - r0).astype(np.float32), (src_c - c0).astype(np.float32)
        pick = domains == d
        images = x[pick]
        acc = np.zeros_like(images)
        for dr, dc, w in ((0, 0, (1 - fr) * (1 - fc)), (0, 1, (1 - fr) * fc), (1, 0, fr * (1 - fc)), (1, 1, fr * fc)):
            rr, cc = r0 + dr, c0 + dc
            inside = (rr >= 0) & (rr < size) & (cc >= 0) & (cc < size)
            values = images[:, :, np.clip(rr, 0, size - 1), np.clip(cc, 0, size - 1)]
            acc += w * np.where(inside, values, np.float32(fill))
        out[pick] = acc
    return out


def evaluation_split(dataset: Dataset, partition_spec: str) -> tuple[np.ndarray, np.ndarray]:
    """The coordinator's test split, as the clients' data looks under ``partition_spec``.

    With attribute skew every domain is equally present (test image ``i`` is shown in
    domain ``i % DOMAINS``), so the global model is judged on all domains, and the
    images have the clients' channel count; otherwise the test split as it is.
    """
    skew = parse_attribute_skew(partition_spec)
    if skew is None:
        return dataset.x_test, dataset.y_test
    domains = np.arange(len(dataset.y_test)) % skew.domains
    return skew.apply(dataset.x_test, domains, _intensity_range(dataset)), dataset.y_test
