"""A device's data as the model's inputs: normalized as each task's model spec says.

The coordinator's data set decides the normalization (it is in the model spec every
task carries); a device's own ``--data`` may be another data set or file (an npz of
uint8 images beside a coordinator on ``fashion-mnist``). So a device loads its data
with its own data set's normalization, keeps the pixels, and when a task's spec
names another normalization it makes its inputs again from the pixels, with the
same function the coordinator used (:meth:`storage.pixels.Normalization.apply`):
both then feed the model the same numbers for the same image. A spec without a
normalization (written before specs had one) leaves the data as loaded.

The pixels are all a device holds: its inputs are made batch by batch as training and
evaluation read them (:class:`PixelInputs`). A Fashion-MNIST device's 6,000 images are
4.7 MiB as uint8 pixels and would be 18.8 MiB more as float32 inputs; the normalization is
elementwise, so a batch made from its rows has the bits the whole array would.
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

__all__ = ["PixelInputs", "DeviceData", "device_data", "load_device_data", "app_device_data", "app_partition", "for_model"]

activity = logging.getLogger("fedge.client.activity")


class PixelInputs:
    """A model's float32 inputs ``[N, C, H, W]`` made from pixels when read: indexing with a slice or
    a 1-D index tensor or array gives that batch as a tensor, normalized then, on ``device``.

    Read where a device's ``LocalData.x`` is read: mini-batches by index, evaluation by slices, the
    client's shape checks. On an accelerator each batch is normalized on the CPU and copied over
    (a batch of 64 Fashion-MNIST images is 200 KB)."""

    def __init__(self, pixels: Pixels, normalization: Normalization, device: torch.device | str = "cpu") -> None:
        if pixels.values.ndim != 4 or pixels.channels != normalization.channels:
            raise DataError(f"pixels of shape {list(pixels.values.shape)} do not fit a normalization of "
                            f"{normalization.channels} channel(s); images must be [N, {normalization.channels}, H, W]")
        self.pixels, self.normalization, self._device = pixels, normalization, torch.device(device)

    def __len__(self) -> int:
        return len(self.pixels)

    def __getitem__(self, rows: slice | torch.Tensor | np.ndarray) -> torch.Tensor:
        if isinstance(rows, torch.Tensor):
            rows = rows.cpu().numpy()
        if not isinstance(rows, slice) and np.ndim(rows) != 1:
            raise TypeError(f"inputs are read by a slice or a 1-D index of rows, got {type(rows).__name__}")
        batch = torch.from_numpy(self.normalization.apply(self.pixels.values[rows], self.pixels.top))
        return batch if self._device.type == "cpu" else batch.to(self._device)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.pixels.values.shape)

    @property
    def device(self) -> torch.device:
        return self._device

    dtype = torch.float32

    def to(self, device: torch.device | str) -> PixelInputs:
        """The same inputs, their batches given on ``device``."""
        return self if torch.device(device) == self._device else PixelInputs(self.pixels, self.normalization, device)

    def renormalized(self, normalization: Normalization) -> PixelInputs:
        """The same pixels read under ``normalization``."""
        return PixelInputs(self.pixels, normalization, self._device)


@dataclass(frozen=True)
class DeviceData(LocalData):
    """LocalData whose inputs are :class:`PixelInputs` (train and held-out rows), with how they are
    normalized, so that a task's model can have them under another normalization without a copy."""

    x: PixelInputs
    x_test: PixelInputs | None = None
    normalization: Normalization | None = None

    def to(self, device: torch.device) -> DeviceData:
        moved = LocalData.to(self, device)
        return replace(self, x=moved.x, y=moved.y, x_test=moved.x_test, y_test=moved.y_test)

    def normalized(self, normalization: Normalization) -> DeviceData:
        """The same rows under ``normalization`` (still the same pixels: nothing is copied)."""
        x_test = None if self.x_test is None else self.x_test.renormalized(normalization)
        return replace(self, x=self.x.renormalized(normalization), x_test=x_test, normalization=normalization)


def device_data(pixels: Pixels, y: np.ndarray, normalization: Normalization, test_fraction: float, *, seed: int,
                client_id: str) -> DeviceData:
    """A device's data from its ``pixels`` (holding out ``test_fraction`` as :func:`edge_client.objectives.local_data`
    does), read by its model normalized by ``normalization``."""
    train, y_train, test, y_test = holdout_split(pixels.values, y, test_fraction, holdout_seed(seed, client_id))
    held = test_fraction > 0
    return DeviceData(PixelInputs(Pixels(train, pixels.top), normalization), torch.from_numpy(y_train),
                      PixelInputs(Pixels(test, pixels.top), normalization) if held else None,
                      torch.from_numpy(y_test) if held else None, normalization)


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
    if wanted is None or not isinstance(data, DeviceData) or wanted == data.normalization:
        return data
    if wanted.channels != data.x.shape[1]:
        raise ObjectiveError(f"the model normalizes {wanted.channels} channel(s) but this device's images have "
                             f"{data.x.shape[1]}; give the device data with the coordinator's channels")
    before = data.normalization
    activity.info("inputs normalized as the model says: mean %s, std %s (were mean %s, std %s)", list(wanted.mean),
                  list(wanted.std), list(before.mean) if before else "?", list(before.std) if before else "?")
    return data.normalized(wanted)
