"""Images as stored, and how they become a model's input.

A model is trained on inputs ``x[c] = (p[c] - mean[c]) / std[c]``, where ``p`` are the
pixels scaled to [0, 1] (uint8 / 255, digits / 16, float files as stored). The
normalization (``mean``, ``std`` per channel) is part of the model spec, so the
coordinator, every device whatever its own data set, the export and a device that
serves the ONNX file all turn pixels into inputs with :meth:`Normalization.apply`,
the one place that does it. NumPy only: ``fedge-profile infer`` uses it without torch.

npz files are read here too (:func:`read_npz`), for the same reason: one reader for
the data loaders and ``infer``, which never unpickles and says in one line what is
wrong with a damaged file.
"""

from __future__ import annotations

import math
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from storage.errors import FedgeError

__all__ = ["DataError", "Normalization", "Pixels", "normalization_of", "read_npz", "npz_pixels"]

_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")   # a zip's first local file header, or an empty archive
_NPY_MAGIC = b"\x93NUMPY"


class DataError(FedgeError, ValueError):
    """Bad dataset/partition spec, normalization or data file; the message says how to fix it."""


@dataclass(frozen=True)
class Normalization:
    """How [0, 1] pixels become the model's input: ``x[c] = (p[c] - mean[c]) / std[c]``, one entry per channel."""

    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.mean or len(self.mean) != len(self.std):
            raise DataError(f"normalization needs one mean and one std per channel, got mean "
                                     f"{list(self.mean)} and std {list(self.std)}")
        if not all(math.isfinite(m) for m in self.mean) or not all(math.isfinite(s) and s > 0 for s in self.std):
            raise DataError(f"normalization means must be finite and stds positive, got mean "
                                     f"{list(self.mean)}, std {list(self.std)}")

    @classmethod
    def identity(cls, channels: int) -> Normalization:
        """Pixels in [0, 1] as they are."""
        return cls((0.0,) * channels, (1.0,) * channels)

    @classmethod
    def from_spec(cls, value: Any, channels: int | None = None) -> Normalization:
        """Parse a model spec's ``normalization`` (``{"mean": [...], "std": [...]}``), checked; ``channels``:
        the count it must have."""
        ok = isinstance(value, Mapping) and set(value) == {"mean", "std"} and all(
            isinstance(value[k], (list, tuple)) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                        for v in value[k]) for k in ("mean", "std"))
        if not ok:
            raise DataError(f"a model spec's normalization is {{\"mean\": [...], \"std\": [...]}} with one "
                                     f"number per channel, got {value!r}")
        out = cls(tuple(float(v) for v in value["mean"]), tuple(float(v) for v in value["std"]))
        if channels is not None and out.channels != channels:
            raise DataError(f"the normalization has {out.channels} channels, the model's input "
                                     f"{channels}; give one mean and one std per input channel")
        return out

    @property
    def channels(self) -> int:
        return len(self.mean)

    def to_spec(self) -> dict[str, list[float]]:
        return {"mean": list(self.mean), "std": list(self.std)}

    def apply(self, values: np.ndarray, top: float) -> np.ndarray:
        """float32 inputs ``[N, C, H, W]`` from pixels ``values`` whose full intensity is ``top``.

        Integer pixels take one float32 multiply-add (``p * (1 / (top * std)) - mean / std``: one pass,
        one allocation; Fashion-MNIST's figures were measured with it); float pixels are computed in
        float64 and rounded once to float32 (digits' figures).
        """
        if values.ndim != 4 or values.shape[1] != self.channels:
            raise DataError(f"pixels of shape {list(values.shape)} do not fit a normalization of "
                                     f"{self.channels} channel(s); images must be [N, {self.channels}, H, W]")
        mean = np.array(self.mean, np.float64).reshape(1, -1, 1, 1)
        std = np.array(self.std, np.float64).reshape(1, -1, 1, 1)
        if np.issubdtype(values.dtype, np.integer):
            scale = (1.0 / (top * std)).astype(np.float32)
            inputs = values * scale
            inputs -= (mean / std).astype(np.float32)   # in place: the same numbers as a - b, without a 2nd array
            return inputs
        return ((values / top - mean) / std).astype(np.float32)


def normalization_of(spec: Mapping[str, Any]) -> Normalization | None:
    """The normalization a model spec names; None for a spec written before specs carried one."""
    value = spec.get("normalization")
    return None if value is None else Normalization.from_spec(value, spec.get("in_channels"))


@dataclass(frozen=True, eq=False)   # eq=False: array fields cannot be compared with ==
class Pixels:
    """Images as stored, ``[N, C, H, W]``, and their full intensity ``top``: ``values / top`` is in [0, 1]."""

    values: np.ndarray
    top: float

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, rows: Any) -> Pixels:
        return Pixels(self.values[rows], self.top)

    @property
    def channels(self) -> int:
        return int(self.values.shape[1])

    def normalized(self, normalization: Normalization) -> np.ndarray:
        """The model's inputs: float32 ``[N, C, H, W]``."""
        return normalization.apply(self.values, self.top)


def read_npz(path: Path) -> dict[str, np.ndarray]:
    """Every array of an .npz file, never unpickled; DataError in one line for a file that is not one."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(len(_NPY_MAGIC))
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror or exc}); check the path and permissions") \
            from None
    if head.startswith(_NPY_MAGIC):
        raise DataError(f"{path}: a single .npy array, not an .npz archive; save the arrays with "
                                 "numpy.savez(PATH, x=..., y=...)")
    if not head.startswith(_ZIP_MAGIC):
        raise DataError(f"{path}: not a valid .npz (no zip archive at its start, so not written by "
                                 "numpy.savez); re-create it with numpy.savez")
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as exc:
        raise DataError(f"{path}: not a valid .npz (truncated or damaged zip archive: {exc}); "
                                 "re-create it with numpy.savez") from None
    except ValueError as exc:   # object arrays (pickles), or a member that is not a .npy array
        raise DataError(f"{path}: not a readable .npz of plain arrays ({exc}); save numeric arrays "
                                 "with numpy.savez") from None


def npz_pixels(path: Path, key: str, x: np.ndarray) -> Pixels:
    """An npz array of images as pixels: ``[N, H, W]`` gets a channel axis; uint8 is 0..255, floats are [0, 1]."""
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4:
        raise DataError(f"{path}: {key!r} must be [N, H, W] or [N, C, H, W], got shape {x.shape}")
    if x.dtype == np.uint8:
        return Pixels(x, 255.0)
    if not np.issubdtype(x.dtype, np.floating):
        raise DataError(f"{path}: {key!r} must be uint8 (0..255) or float, got {x.dtype}")
    x = x.astype(np.float32)
    if not np.isfinite(x).all():
        raise DataError(f"{path}: {key!r} contains NaN or inf; clean the data before saving")
    return Pixels(x, 1.0)
