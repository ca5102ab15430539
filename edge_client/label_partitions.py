"""Label partitions: which of a data set's samples each client owns (``iid``, ``dirichlet:ALPHA``, ``shards:K``).

Every process computes the partitions itself, deterministically in (labels, spec,
number of partitions, seed), so every process agrees on which samples each client
owns without exchanging them.
"""

from __future__ import annotations

import math

import numpy as np

from storage.pixels import DataError

__all__ = ["PARTITION_SPECS", "parse_label_spec", "label_partition_indices", "describe_partitions"]

PARTITION_SPECS = ("iid, dirichlet:ALPHA (ALPHA > 0), shards:K (K >= 1 integer), "
                   "attribute:KIND:DOMAINS[+LABEL_SPEC] (KIND color, rotate or invert), "
                   "attribute:colorlabel:DOMAINS:P[+LABEL_SPEC] (colour follows the label with probability P)")

_DIRICHLET_TRIES = 100


def parse_label_spec(spec: str) -> tuple[str, float]:
    """(kind, argument) of a plain label partition spec; DataError naming the valid ones otherwise."""
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


def label_partition_indices(labels: np.ndarray, spec: str, num_partitions: int, seed: int) -> list[np.ndarray]:
    """Split sample indices into `num_partitions` sorted, disjoint, non-empty parts by a plain label spec.

    Deterministic in (labels, spec, num_partitions, seed), so every process agrees
    on which samples each client owns without exchanging them.
    """
    kind, arg = parse_label_spec(spec)
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


def describe_partitions(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> list[dict]:
    """Per-partition size and nonzero class counts, for logging how skewed a split is."""
    out = []
    for i, p in enumerate(parts):
        counts = np.bincount(np.asarray(labels)[p], minlength=num_classes)
        classes = {int(c): int(n) for c, n in enumerate(counts) if n}
        out.append({"index": i, "size": int(len(p)), "classes": classes})
    return out

