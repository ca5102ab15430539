"""What each client trains on: its partition of a data set's train split, its local hold-out, and many
simulated clients' data arranged in one array.

A partition spec is a label partition (:mod:`edge_client.label_partitions`) or an
attribute skew over one (:mod:`edge_client.attribute_skew`), which also changes how a
client's images look.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_client.attribute_skew import intensity_range, parse_attribute_skew
from edge_client.datasets import (FASHION_MNIST_DIR, FASHION_MNIST_NORMALIZATION, Dataset, load_dataset, load_pixels,
                                  read_fashion_mnist)
from edge_client.label_partitions import label_partition_indices
from storage.pixels import DataError, Normalization, Pixels

__all__ = ["partition_indices", "client_pixels", "load_client_split", "client_split", "holdout_split", "ClientRows",
           "arrange_clients"]


def partition_indices(labels: np.ndarray, spec: str, num_partitions: int, seed: int) -> list[np.ndarray]:
    """Split sample indices into `num_partitions` sorted, disjoint, non-empty parts.

    Deterministic in (labels, spec, num_partitions, seed), so every process agrees
    on which samples each client owns without exchanging them.
    """
    skew = parse_attribute_skew(spec)   # the attribute changes the images, not who owns which sample
    return label_partition_indices(labels, spec if skew is None else skew.labels, num_partitions, seed)


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
        images, labels = read_fashion_mnist(Path(arg) if arg else Path(FASHION_MNIST_DIR), "train")
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
    looks = skew.looks(dataset.y_train[idx], index, seed, dataset.num_classes)
    return skew.apply(dataset.x_train[idx], looks, intensity_range(dataset), dataset.num_classes), dataset.y_train[idx]


def holdout_split(x: np.ndarray, y: np.ndarray, fraction: float, seed: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Split a client's data into (x_train, y_train, x_test, y_test) for personalized evaluation.

    Seeded, so a restarted client holds out exactly the same samples. Holding out nothing returns ``x`` and
    ``y`` themselves, not copies of every row (a device's whole data set, twice at once while it loads).
    """
    train, test = _holdout_rows(len(y), fraction, seed)
    if len(test) == 0:
        x, y = np.ascontiguousarray(x), np.ascontiguousarray(y)   # as x[train] would be, copied only if not
        return x, y, x[:0], y[:0]
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
    skew = parse_attribute_skew(partition_spec)
    rows, bounds, looks, start = [], [], [], 0
    for i, (part, holdout_seed) in enumerate(zip(parts, holdout_seeds)):
        train, test = _holdout_rows(len(part), test_fraction, holdout_seed)
        positions = np.concatenate([train, test])
        rows.append(part[positions])
        bounds.append((start, start + len(train), start + len(part)))
        start += len(part)
        if skew is not None:   # drawn in partition order, as client_split draws them, then put in this order
            looks.append(skew.looks(dataset.y_train[part], i, seed, dataset.num_classes)[positions])
    order = np.concatenate(rows)
    if skew is None:
        x = dataset.x_train[order]
    else:   # each client's images as seen in its domain
        x = skew.apply(dataset.x_train[order], np.concatenate(looks), intensity_range(dataset), dataset.num_classes)
    return ClientRows(x, dataset.y_train[order], tuple(rows), tuple(bounds))

