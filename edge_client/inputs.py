"""A device's data as the model's inputs: normalized as each task's model spec says.

The coordinator's data set decides the normalization (it is in the model spec every
task carries); a device's own ``--data`` may be another data set or file (an npz of
uint8 images beside a coordinator on ``fashion-mnist``). So a device loads its data
with its own data set's normalization, keeps the pixels, and when a task's spec
names another normalization it makes its inputs again from the pixels, with the
same function the coordinator used (:meth:`storage.pixels.Normalization.apply`):
both then feed the model the same numbers for the same image. A spec without a
normalization (written before specs had one) leaves the data as loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from edge_client.app import App, check_samples
from edge_client.data import client_pixels, holdout_split, load_client_split, parse_attribute_skew
from edge_client.datasets import load_own_pixels
from edge_client.label_partitions import label_partition_indices
from edge_client.objectives import LocalData, ObjectiveError, holdout_seed, local_data
from storage.pixels import DataError, Normalization, Pixels, normalization_of

__all__ = ["DeviceData", "device_data", "load_device_data", "app_device_data", "app_partition", "for_model"]

activity = logging.getLogger("fedge.client.activity")


@dataclass(frozen=True)
class DeviceData(LocalData):
    """LocalData that keeps the pixels its inputs were made from (train and held-out rows, in the same
    order), and how they were normalized, so that they can be made again under another normalization."""

    pixels: Pixels | None = None
    test_pixels: Pixels | None = None
    normalization: Normalization | None = None

    def to(self, device: torch.device) -> DeviceData:
        moved = LocalData.to(self, device)
        return replace(self, x=moved.x, y=moved.y, x_test=moved.x_test, y_test=moved.y_test)


def device_data(pixels: Pixels, y: np.ndarray, normalization: Normalization, test_fraction: float, *, seed: int,
                client_id: str) -> DeviceData:
    """:func:`edge_client.objectives.local_data` of ``pixels`` normalized by ``normalization``, keeping the pixels
    (split into the same train and held-out rows)."""
    data = local_data(pixels.normalized(normalization), y, test_fraction, seed=seed, client_id=client_id)
    train, _, test, _ = holdout_split(pixels.values, y, test_fraction, holdout_seed(seed, client_id))
    return DeviceData(data.x, data.y, data.x_test, data.y_test, Pixels(train, pixels.top),
                      Pixels(test, pixels.top) if data.x_test is not None else None, normalization)


def load_device_data(spec: str, test_fraction: float, *, seed: int, client_id: str, partition: str | None = None,
                     partition_index: int = 0, num_partitions: int = 1) -> LocalData:
    """A device's data from its ``--data`` spec (with ``partition``: one partition of it, in a simulation).

    An attribute partition's images are already its domains' inputs (their look is the attribute), so
    they are kept as they are, without pixels; the coordinator's spec then names the same normalization."""
    if partition and parse_attribute_skew(partition) is not None:
        x, y = load_client_split(spec, partition, partition_index, num_partitions, seed)
        return local_data(x, y, test_fraction, seed=seed, client_id=client_id)
    if partition:
        pixels, y, own = client_pixels(spec, partition, partition_index, num_partitions, seed)
    else:
        pixels, y, own = load_own_pixels(spec)
    return device_data(pixels, y, own, test_fraction, seed=seed, client_id=client_id)


def app_partition(y: np.ndarray, partition: str, index: int, parts: int, seed: int) -> np.ndarray:
    """Rows of partition ``index`` of ``parts`` of an app's samples in a simulation, whose targets are ``y``.

    ``iid`` takes any targets; a label partition (``dirichlet:A``, ``shards:K``) splits by class, so it needs
    one integer class per sample. Deterministic in its arguments, so every process agrees without talking."""
    if parse_attribute_skew(partition) is not None:
        raise DataError(f"partition {partition!r} changes fedge's own images; an app's data takes 'iid', "
                        "'dirichlet:A' or 'shards:K'")
    if partition != "iid" and (y.ndim != 1 or not np.issubdtype(y.dtype, np.integer)):
        raise DataError(f"partition {partition!r} splits by class label, but the app's targets are {y.dtype} "
                        f"{tuple(y.shape)}, not one integer class per sample; use data.partition = 'iid'")
    labels = y if partition != "iid" else np.zeros(len(y), dtype=np.int64)
    return label_partition_indices(labels, partition, parts, seed)[index]


def app_device_data(app: App, location: str, test_fraction: float, *, seed: int, client_id: str,
                    partition: str | None = None, partition_index: int = 0, num_partitions: int = 1) -> LocalData:
    """A device's data loaded by its app from ``location`` (with ``partition``: one part of it, in a
    simulation), holding out ``test_fraction`` for personalized evaluation."""
    samples = check_samples(app.device_data(location), app, "device_data")
    x, y = samples.x.numpy(), samples.y.numpy()
    if partition:
        rows = app_partition(y, partition, partition_index, num_partitions, seed)
        x, y = x[rows], y[rows]
    return local_data(x, y, test_fraction, seed=seed, client_id=client_id)


def for_model(data: LocalData, spec: Mapping[str, Any]) -> LocalData:
    """``data`` as the inputs of the model ``spec`` describes: made again from its pixels when the spec names
    another normalization than the one applied; as it is when the spec names none, or the data kept no pixels."""
    try:
        wanted = normalization_of(spec)
    except DataError as exc:
        raise ObjectiveError(str(exc)) from None
    if wanted is None or not isinstance(data, DeviceData) or data.pixels is None or wanted == data.normalization:
        return data
    if wanted.channels != data.pixels.channels:
        raise ObjectiveError(f"the model normalizes {wanted.channels} channel(s) but this device's images have "
                             f"{data.pixels.channels}; give the device data with the coordinator's channels")
    device = data.x.device
    x = torch.from_numpy(data.pixels.normalized(wanted)).to(device)
    x_test = None if data.test_pixels is None else torch.from_numpy(data.test_pixels.normalized(wanted)).to(device)
    before = data.normalization
    activity.info("inputs normalized as the model says: mean %s, std %s (were mean %s, std %s)", list(wanted.mean),
                  list(wanted.std), list(before.mean) if before else "?", list(before.std) if before else "?")
    return replace(data, x=x, x_test=x_test, normalization=wanted)
