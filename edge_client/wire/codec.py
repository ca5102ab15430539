"""Update codecs: how float32 tensors are packed for the wire and checked on arrival.

A codec spec is a ``+``-joined string read from the run config (``codec.up``,
``codec.down``) and carried in each message body:

- a value format: ``fp32`` (exact, the default), ``fp64`` (exact for float64
  statistics such as a calibration's sums of feature products, which decode as float64),
  ``fp16``, ``bf16``, or ``int8``
  (symmetric, one float32 scale per output channel, i.e. per index of the first
  dimension; one per tensor for 0-D and 1-D tensors). ``int8:stochastic`` rounds
  up or down at random in proportion to the distance, so the rounding is unbiased.
- ``topk:FRACTION``: keep only the ``ceil(FRACTION * numel)`` largest-magnitude
  entries of each tensor, their values in the value format. It applies to updates
  sent as differences; raw values are always sent dense.
- ``zstd[:LEVEL]`` or ``lz4[:LEVEL]``: lossless compression of the whole message,
  applied only when it makes the message smaller (:mod:`edge_client.wire.compression`).

Wire layout of a tensor ``NAME`` (safetensors entries of the message):

==================  ===========================================================
dense               ``NAME`` in F32, F64, F16, BF16 or I8 with the tensor's shape;
                    int8 adds ``NAME:scale`` (F32, one per output channel)
top-k               ``NAME:val`` (the k kept values, ascending position order),
                    ``NAME:scale`` for int8, and the positions as either
                    ``NAME:mask`` (U8, one bit per entry, little-endian bit
                    order) or ``NAME:idx`` (gaps between successive positions
                    minus one, the first counted from -1, in U8, I16 or I32,
                    whichever is the narrowest that holds the largest gap).
                    The encoder picks whichever of mask and idx is smaller:
                    the mask costs numel/8 bytes, the gaps k bytes or 2k or 4k.
==================  ===========================================================

Decoding checks every wire tensor's name, dtype and shape against the expected
layout, every position against the tensor's size and every scale for sign and
finiteness before anything is built, so a malicious index cannot write out of
bounds; any problem is a :class:`CodecError` (a ``ProtocolError``) with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping

import numpy as np
import torch

from edge_client.wire.codec_spec import EXACT_VALUES, FP32, SEP, VALUE_NAMES, CodecError, CodecSpec, parse_codec

__all__ = ["CodecError", "CodecSpec", "parse_codec", "VALUE_FORMATS", "encode_tensors", "decode_tensors",
           "wire_bytes", "all_finite", "FP32"]

VALUE_FORMATS: dict[str, torch.dtype] = dict(zip(VALUE_NAMES, (torch.float32, torch.float64, torch.float16,
                                                                torch.bfloat16, torch.int8), strict=True))
_FP16_MAX = 65504.0
_INDEX_DTYPES = ((255, torch.uint8), (32767, torch.int16), (2**31 - 1, torch.int32))
_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite, checked with numpy where it can be.

    Every received tensor passes through here, so it must be cheap: torch's
    ``isfinite(t).all()`` goes through its intra-op thread pool, which on a busy
    2-core coordinator cost 2 to 11 ms per 1.7 MB model against numpy's 0.1 ms.
    The minimum and maximum decide it without a mask as large as the tensor (NaN
    propagates into both, an infinity is one of them).
    """
    if tensor.device.type == "cpu" and tensor.dtype in _NUMPY_FLOATS:
        values = tensor.detach().numpy()
        return values.size == 0 or bool(np.isfinite(values.min()) and np.isfinite(values.max()))
    return bool(torch.isfinite(tensor).all())


# ----------------------------------------------------------------------------- helpers


def _channels(shape: tuple[int, ...]) -> int:
    """Scales per tensor: one per output channel, one for 0-D and 1-D tensors."""
    return shape[0] if len(shape) >= 2 else 1


def _to_int8(y: torch.Tensor, stochastic: bool, generator: torch.Generator | None) -> torch.Tensor:
    if stochastic:
        y = torch.floor(y + torch.rand(y.shape, generator=generator))
    else:
        y = torch.round(y)
    return y.clamp_(-127, 127).to(torch.int8)


def _scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = amax / 127.0
    return scale, torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))


def _values(name: str, key: str, flat: torch.Tensor, spec: CodecSpec, channel: torch.Tensor | None,
            channels: int, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
    """``flat`` in the value format under ``key``, int8 scales under ``NAME:scale``.

    ``channel`` maps each entry to its output channel (None: dense, channels contiguous).
    """
    if spec.values in EXACT_VALUES:
        return {key: flat}
    if spec.values == "fp16":
        peak = float(flat.abs().max()) if flat.numel() else 0.0
        if peak > _FP16_MAX:
            raise CodecError(f"tensor {name!r} holds {peak:g}, beyond float16's range of {_FP16_MAX:g}; "
                             "use bf16 or int8 for it")
        return {key: flat.to(torch.float16)}
    if spec.values == "bf16":
        return {key: flat.to(torch.bfloat16)}
    if flat.numel() == 0:
        scale, q = torch.zeros(channels), flat.to(torch.int8)
    elif channel is None:   # dense: the entries of each channel are contiguous
        rows = flat.reshape(channels, -1)
        scale, inv = _scales(rows.abs().amax(dim=1))
        q = _to_int8(rows * inv[:, None], spec.stochastic, generator).reshape(flat.shape)
    else:
        amax = torch.zeros(channels).scatter_reduce(0, channel, flat.abs(), "amax")
        scale, inv = _scales(amax)
        q = _to_int8(flat * inv[channel], spec.stochastic, generator)
    return {key: q, name + SEP + "scale": scale}


def _positions(idx: torch.Tensor, numel: int) -> dict[str, torch.Tensor]:
    """The sorted kept positions as a bit mask or as narrow gaps, whichever is smaller."""
    gaps = torch.diff(idx, prepend=torch.tensor([-1])) - 1
    widest = int(gaps.max()) if len(gaps) else 0
    dtype = next(d for limit, d in _INDEX_DTYPES if widest <= limit)
    gap_bytes = len(idx) * torch.tensor([], dtype=dtype).element_size()
    if (numel + 7) // 8 <= gap_bytes:
        bits = np.zeros(numel, dtype=bool)
        bits[idx.numpy()] = True
        return {"mask": torch.from_numpy(np.packbits(bits, bitorder="little"))}
    return {"idx": gaps.to(dtype)}


def encode_tensors(tensors: Mapping[str, torch.Tensor], spec: CodecSpec, *, sparse: Collection[str] = (),
                   generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Wire tensors for ``tensors`` (float32); top-k applies only to the names in ``sparse``."""
    if spec.topk is not None and not sparse:
        spec = spec.dense()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if SEP in name:
            raise CodecError(f"tensor name {name!r} contains {SEP!r}, which the codec uses for its own entries")
        if not tensor.is_floating_point():
            raise CodecError(f"tensor {name!r} is {tensor.dtype}; codecs carry floating-point tensors only")
        x = tensor.detach().to("cpu", spec.dtype).contiguous()
        shape = tuple(x.shape)
        if spec.topk is None or name not in sparse:
            packed = _values(name, name, x.reshape(-1), spec, None, _channels(shape), generator)
            out.update({k: v.reshape(shape) if k == name else v for k, v in packed.items()})
            continue
        flat = x.reshape(-1)
        k = min(flat.numel(), math.ceil(spec.topk * flat.numel()))
        idx = (torch.sort(torch.topk(flat.abs(), k, sorted=False).indices).values if k
               else torch.zeros(0, dtype=torch.long))
        channels = _channels(shape)
        channel = idx // max(flat.numel() // max(channels, 1), 1)
        vals = _values(name, name + SEP + "val", flat[idx], spec, channel, channels, generator)
        out.update(vals)
        out.update({name + SEP + kind: t for kind, t in _positions(idx, flat.numel()).items()})
    return out


# ----------------------------------------------------------------------------- decoding


def _need(wire: Mapping[str, torch.Tensor], key: str, dtypes: tuple[torch.dtype, ...],
          shape: tuple[int, ...] | None) -> torch.Tensor:
    t = wire[key]
    if t.dtype not in dtypes:
        raise CodecError(f"wire tensor {key!r} is {t.dtype}, expected {' or '.join(map(str, dtypes))}")
    if shape is not None and tuple(t.shape) != shape:
        raise CodecError(f"wire tensor {key!r} has shape {tuple(t.shape)}, expected {shape}")
    return t


def _dense_values(wire: Mapping[str, torch.Tensor], key: str, scale_key: str, spec: CodecSpec,
                  shape: tuple[int, ...], channel: torch.Tensor | None, channels: int) -> torch.Tensor:
    t = _need(wire, key, (VALUE_FORMATS[spec.values],), shape)
    if spec.values != "int8":
        return t.to(spec.dtype)
    scale = _need(wire, scale_key, (torch.float32,), (channels,))
    if not all_finite(scale) or bool((scale < 0).any()):
        raise CodecError(f"wire tensor {scale_key!r} holds negative or non-finite scales")
    q = t.to(torch.float32)
    if channel is None:
        return (q.reshape(channels, -1) * scale[:, None]).reshape(shape) if q.numel() else q
    return q * scale[channel]


def _decode_positions(wire: Mapping[str, torch.Tensor], name: str, numel: int, k: int) -> torch.Tensor:
    mask_key, idx_key = name + SEP + "mask", name + SEP + "idx"
    if mask_key in wire:
        packed = _need(wire, mask_key, (torch.uint8,), ((numel + 7) // 8,))
        bits = np.unpackbits(packed.numpy(), bitorder="little")
        if bits[numel:].any():
            raise CodecError(f"wire tensor {mask_key!r} sets bits past the tensor's {numel} entries")
        positions = torch.from_numpy(np.flatnonzero(bits[:numel]))
        if len(positions) != k:
            raise CodecError(f"wire tensor {mask_key!r} marks {len(positions)} entries but {k} values came")
        return positions
    gaps = _need(wire, idx_key, (torch.uint8, torch.int16, torch.int32), (k,)).to(torch.int64)
    if bool((gaps < 0).any()):
        raise CodecError(f"wire tensor {idx_key!r} holds negative gaps")
    positions = torch.cumsum(gaps + 1, 0) - 1
    if k and int(positions[-1]) >= numel:
        raise CodecError(f"wire tensor {idx_key!r} points past the tensor's {numel} entries")
    return positions


def _expected_keys(name: str, spec: CodecSpec, sparse: bool, wire: Mapping[str, torch.Tensor]) -> set[str]:
    scale = {name + SEP + "scale"} if spec.values == "int8" else set()
    if not sparse:
        return {name} | scale
    where = name + SEP + ("mask" if name + SEP + "mask" in wire else "idx")
    return {name + SEP + "val", where} | scale


def decode_tensors(wire: Mapping[str, torch.Tensor], spec: CodecSpec, shapes: Mapping[str, tuple[int, ...]],
                   *, sparse: Collection[str] = (), exact: bool = True) -> dict[str, torch.Tensor]:
    """Float32 tensors from wire tensors, checked against ``shapes``.

    ``sparse``: the names the sender encoded with top-k (the rest are dense).
    ``exact``: the message must carry every name in ``shapes``; otherwise a subset.
    """
    names: dict[str, set[str]] = {}
    for key in wire:
        names.setdefault(key.split(SEP, 1)[0], set()).add(key)
    unknown = sorted(set(names) - set(shapes))
    missing = sorted(set(shapes) - set(names)) if exact else []
    if unknown or missing:
        raise CodecError(f"tensor names differ from what was expected: missing {missing[:5]}, "
                         f"unexpected {unknown[:5]}")
    if set(sparse) - set(names):
        raise CodecError(f"names declared sparse are not in the message: {sorted(set(sparse) - set(names))[:5]}")
    out: dict[str, torch.Tensor] = {}
    for name, keys in names.items():
        shape = tuple(shapes[name])
        is_sparse = spec.topk is not None and name in sparse
        expected = _expected_keys(name, spec, is_sparse, wire)
        if keys != expected:
            raise CodecError(f"tensor {name!r} arrived as {sorted(keys)}, but codec {spec.text} "
                             f"{'with top-k ' if is_sparse else ''}sends {sorted(expected)}")
        channels, numel = _channels(shape), math.prod(shape)
        if not is_sparse:
            value = _dense_values(wire, name, name + SEP + "scale", spec, shape, None, channels)
        else:
            k = len(wire[name + SEP + "val"]) if wire[name + SEP + "val"].dim() == 1 else -1
            if not 0 <= k <= numel:
                raise CodecError(f"wire tensor {name + SEP + 'val'!r} must be 1-D with at most {numel} values")
            positions = _decode_positions(wire, name, numel, k)
            channel = positions // max(numel // max(channels, 1), 1)
            vals = _dense_values(wire, name + SEP + "val", name + SEP + "scale", spec, (k,), channel, channels)
            value = torch.zeros(numel, dtype=vals.dtype).index_put_((positions,), vals).reshape(shape)
        if not all_finite(value):
            raise CodecError(f"tensor {name!r} decodes to non-finite values")
        out[name] = value
    return out


def wire_bytes(wire: Mapping[str, torch.Tensor]) -> int:
    """Bytes of tensor data (no headers) in a set of wire tensors."""
    return sum(t.numel() * t.element_size() for t in wire.values())
