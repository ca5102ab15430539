"""Codec specs: the ``+``-joined strings ``codec.up`` and ``codec.down`` name (``topk:0.1+int8+zstd``,
``eden+zstd``, ``lowrank:4+int8``), parsed and checked.

Apart from the tensor code (:mod:`edge_client.wire.codec`), which imports torch, so that a configuration
is checked before torch loads; a bad spec is an error naming the valid forms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from edge_client.wire.compression import COMPRESSORS, CompressionError, check_available, compress
from edge_client.wire.errors import ProtocolError

if TYPE_CHECKING:
    import torch

__all__ = ["eden_variance", "CodecError", "CodecSpec", "parse_codec", "VALUE_NAMES", "EXACT_VALUES", "FP32", "SEP",
           "MAX_RANK"]

VALUE_NAMES = ("fp32", "fp64", "fp16", "bf16", "int8")   # the value formats (their dtypes: codec.VALUE_FORMATS)
EXACT_VALUES = ("fp32", "fp64")
SEP = ":"


class CodecError(ProtocolError):
    """A codec spec is invalid, or encoded tensors do not match what the codec and shapes allow."""


@dataclass(frozen=True)
class CodecSpec:
    """A parsed codec spec; :attr:`text` is its canonical string."""

    values: str = "fp32"
    stochastic: bool = False            # int8 only: stochastic rounding
    topk: float | None = None           # fraction of entries kept, in (0, 1]
    eden: float | None = None           # differences as rotated sign bits of this share of the rotated entries
                                        # (1: every entry; edge_client/wire/rotated.py)
    rank: int | None = None             # differences of matrices as rank-r factors (edge_client/wire/lowrank.py)
    compressor: str | None = None       # zstd | lz4
    level: int | None = None            # compressor level; None: its default

    @property
    def lossy(self) -> bool:
        """True when decoding does not give back the exact input."""
        return self.values not in EXACT_VALUES or self.transform is not None

    @property
    def transform(self) -> str | None:
        """What is done to differences before the value format: ``topk``, ``eden``, ``lowrank``, or None (dense).
        Raw values are always sent dense, and a transformed update is not a sum of per-entry values, so secure
        aggregation (which adds masked dense vectors) needs None."""
        if self.topk is not None:
            return "topk"
        if self.eden is not None:
            return "eden"
        return "lowrank" if self.rank is not None else None

    @property
    def dtype(self) -> torch.dtype:
        """What the values are encoded from and decode to: float64 for fp64, float32 otherwise (torch is
        imported here, by the tensor code that asks, not by a configuration check)."""
        import torch

        return torch.float64 if self.values == "fp64" else torch.float32

    @property
    def text(self) -> str:
        transform = self.transform
        parts = ([f"topk:{self.topk:g}"] if transform == "topk" else [f"lowrank:{self.rank}"]
                 if transform == "lowrank" else [f"eden:{self.eden:g}" if self.eden != 1 else "eden"]
                 if transform == "eden" else [])
        if self.values != "fp32" or not parts:
            parts.append(self.values + (":stochastic" if self.stochastic else ""))
        if self.compressor:
            parts.append(self.compressor + (f":{self.level}" if self.level is not None else ""))
        return "+".join(parts)

    def compress(self, payload: bytes) -> bytes:
        """The whole message compressed with this spec's compressor, when that shrinks it."""
        return compress(payload, self.compressor, self.level) if self.compressor else payload

    def dense(self) -> "CodecSpec":
        """This spec without its transform: how raw values and downloads are sent."""
        return replace(self, topk=None, eden=None, rank=None)


FP32 = CodecSpec()
_FORMS = ("fp32, fp64, fp16, bf16, int8, int8:stochastic, topk:FRACTION, eden[:FRACTION], lowrank:RANK, zstd[:LEVEL], "
          "lz4[:LEVEL]")
def _fraction(arg: str) -> float:
    try:
        return float(arg)
    except ValueError:
        return math.nan


def eden_variance(fraction: float) -> float:
    """One ``eden:FRACTION`` decode's squared error relative to its input's squared norm, for the nearly Gaussian
    rotated entries: ``pi / (2 FRACTION) - 1`` (0.57 at 1, 5.3 at 0.25). Error feedback carries the error into the
    next update, so its residual settles at ``sqrt(v / (1 - v))`` of an update's norm when ``v < 1`` (1.15 for
    eden) and grows without bound when ``v >= 1``, below ``FRACTION = pi / 4``."""
    return math.pi / (2 * fraction) - 1


MAX_RANK = 64   # lowrank:RANK above this saves little over a dense int8 difference of any layer fedge trains


def parse_codec(text: str) -> CodecSpec:
    """Parse ``topk:0.01+int8+zstd:3`` and the like; raise CodecError naming the valid forms."""
    if not isinstance(text, str) or not text.strip():
        raise CodecError(f"a codec spec is a non-empty string such as 'topk:0.1+int8+zstd'; forms: {_FORMS}")
    fields: dict[str, object] = {}

    def put(key: str, value: object, token: str) -> None:
        if key in fields:
            raise CodecError(f"codec spec {text!r} sets the {key} twice (at {token!r})")
        fields[key] = value

    for token in text.strip().split("+"):
        name, _, arg = token.strip().partition(SEP)
        if name in VALUE_NAMES and (not arg or (name, arg) == ("int8", "stochastic")):
            put("values", name, token)
            fields["stochastic"] = arg == "stochastic"
        elif name == "topk":
            if not 0 < (fraction := _fraction(arg)) <= 1:
                raise CodecError(f"topk needs a fraction in (0, 1], e.g. topk:0.1; got {token!r}")
            put("topk", fraction, token)
        elif name == "eden":
            if not 0 < (fraction := _fraction(arg or "1")) <= 1:
                raise CodecError(f"eden takes the share of rotated entries sent, 1 bit each, in (0, 1] ('eden' is "
                                 f"eden:1, eden:0.25 sends a quarter of them); more bits are not built, got {token!r}")
            put("eden", fraction, token)
        elif name == "lowrank":
            if not (arg.isdigit() and 1 <= int(arg) <= MAX_RANK):
                raise CodecError(f"lowrank needs a rank in 1..{MAX_RANK}, e.g. lowrank:4; got {token!r}")
            put("rank", int(arg), token)
        elif name in COMPRESSORS:
            _, _, levels, _ = COMPRESSORS[name]
            if arg and not (arg.isdigit() and int(arg) in levels):
                raise CodecError(f"{name} level must be an integer in {levels.start}..{levels.stop - 1}, "
                                 f"got {token!r}")
            put("compressor", name, token)
            fields["level"] = int(arg) if arg else None
        else:
            raise CodecError(f"unknown codec part {token!r} in {text!r}; forms: {_FORMS}")
    transforms = [key for key in ("topk", "eden", "rank") if key in fields]
    if len(transforms) > 1:
        raise CodecError(f"codec spec {text!r} combines {' and '.join(transforms)}: use one of topk, eden and "
                         "lowrank (a rotation spreads a sparse vector over every entry, and a sparse or 1-bit "
                         "matrix is not low-rank)")
    spec = CodecSpec(**fields)  # type: ignore[arg-type]
    if spec.compressor:
        try:
            check_available(spec.compressor)
        except CompressionError as exc:
            raise CodecError(str(exc)) from None
    return spec
