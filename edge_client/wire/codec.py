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
- ``eden[:FRACTION]``: each difference as rotated sign bits, 1 bit per entry (of that share of the
  rotated entries) plus a scale per chunk (:mod:`edge_client.wire.rotated`).
- ``lowrank:RANK``: each difference of a weight with 2+ dimensions as two rank-RANK
  factors in the value format (:mod:`edge_client.wire.lowrank`), the rest dense.
- Top-k, eden and lowrank exclude each other.
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
eden                ``NAME:bits``, ``NAME:scale``, ``NAME:seed`` (rotated.py)
lowrank             ``NAME:p``, ``NAME:q`` and their int8 scales (lowrank.py)
==================  ===========================================================

Decoding checks every wire tensor's name, dtype and shape against the expected
layout, every position against the tensor's size and every scale for sign and
finiteness before anything is built, so a malicious index cannot write out of
bounds; any problem is a :class:`CodecError` (a ``ProtocolError``) with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, MutableMapping

import numpy as np
import torch

from edge_client.wire import lowrank, rotated
from edge_client.wire.codec_spec import FP32, SEP, CodecError, CodecSpec, parse_codec
from edge_client.wire.values import VALUE_FORMATS, all_finite, channels_of, need, pack_values, unpack_values

__all__ = ["CodecError", "CodecSpec", "parse_codec", "VALUE_FORMATS", "encode_tensors", "decode_tensors",
           "layout", "wire_bytes", "all_finite", "FP32"]

_INDEX_DTYPES = ((255, torch.uint8), (32767, torch.int16), (2**31 - 1, torch.int32))


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


def layout(spec: CodecSpec, difference: bool, shape: tuple[int, ...]) -> str:
    """How a tensor of ``shape`` travels: ``dense``, ``topk``, ``eden`` or ``lowrank``. Transforms apply to
    differences only, and ``lowrank`` only to tensors :func:`~edge_client.wire.lowrank.factored` accepts."""
    transform = spec.transform if difference else None
    if transform == "lowrank" and not lowrank.factored(shape, spec.rank or 0):
        return "dense"
    return transform or "dense"


def encode_tensors(tensors: Mapping[str, torch.Tensor], spec: CodecSpec, *, sparse: Collection[str] = (),
                   generator: torch.Generator | None = None,
                   state: MutableMapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Wire tensors for ``tensors`` (float32); top-k, eden and lowrank apply only to the names in ``sparse``
    (the differences). ``state``: the device's per-tensor codec state (lowrank's warm-start Q), updated."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if SEP in name:
            raise CodecError(f"tensor name {name!r} contains {SEP!r}, which the codec uses for its own entries")
        if not tensor.is_floating_point():
            raise CodecError(f"tensor {name!r} is {tensor.dtype}; codecs carry floating-point tensors only")
        x = tensor.detach().to("cpu", spec.dtype).contiguous()
        shape = tuple(x.shape)
        how = layout(spec, name in sparse, shape)
        if how == "eden":
            out.update(rotated.encode_rotated(name, x, generator, spec.eden))
        elif how == "lowrank":
            out.update(lowrank.encode_lowrank(name, x, spec, state, generator))
        elif how == "dense":
            packed = pack_values(name, name, x.reshape(-1), spec, None, channels_of(shape), generator)
            out.update({k: v.reshape(shape) if k == name else v for k, v in packed.items()})
        else:
            out.update(_encode_topk(name, x, spec, generator))
    return out


def _encode_topk(name: str, x: torch.Tensor, spec: CodecSpec, generator: torch.Generator | None
                 ) -> dict[str, torch.Tensor]:
    assert spec.topk is not None
    flat = x.reshape(-1)
    k = min(flat.numel(), math.ceil(spec.topk * flat.numel()))
    idx = (torch.sort(torch.topk(flat.abs(), k, sorted=False).indices).values if k
           else torch.zeros(0, dtype=torch.long))
    channels = channels_of(tuple(x.shape))
    channel = idx // max(flat.numel() // max(channels, 1), 1)
    out = pack_values(name, name + SEP + "val", flat[idx], spec, channel, channels, generator)
    out.update({name + SEP + kind: t for kind, t in _positions(idx, flat.numel()).items()})
    return out


# ----------------------------------------------------------------------------- decoding


def _decode_positions(wire: Mapping[str, torch.Tensor], name: str, numel: int, k: int) -> torch.Tensor:
    mask_key, idx_key = name + SEP + "mask", name + SEP + "idx"
    if mask_key in wire:
        packed = need(wire, mask_key, (torch.uint8,), ((numel + 7) // 8,))
        bits = np.unpackbits(packed.numpy(), bitorder="little")
        if bits[numel:].any():
            raise CodecError(f"wire tensor {mask_key!r} sets bits past the tensor's {numel} entries")
        positions = torch.from_numpy(np.flatnonzero(bits[:numel]))
        if len(positions) != k:
            raise CodecError(f"wire tensor {mask_key!r} marks {len(positions)} entries but {k} values came")
        return positions
    gaps = need(wire, idx_key, (torch.uint8, torch.int16, torch.int32), (k,)).to(torch.int64)
    if bool((gaps < 0).any()):
        raise CodecError(f"wire tensor {idx_key!r} holds negative gaps")
    positions = torch.cumsum(gaps + 1, 0) - 1
    if k and int(positions[-1]) >= numel:
        raise CodecError(f"wire tensor {idx_key!r} points past the tensor's {numel} entries")
    return positions


def _expected_keys(name: str, spec: CodecSpec, how: str, wire: Mapping[str, torch.Tensor]) -> set[str]:
    if how == "eden":
        return {name + SEP + kind for kind in rotated.KINDS}
    if how == "lowrank":
        return lowrank.wire_keys(name, spec)
    scale = {name + SEP + "scale"} if spec.values == "int8" else set()
    if how == "dense":
        return {name} | scale
    where = name + SEP + ("mask" if name + SEP + "mask" in wire else "idx")
    return {name + SEP + "val", where} | scale


def decode_tensors(wire: Mapping[str, torch.Tensor], spec: CodecSpec, shapes: Mapping[str, tuple[int, ...]],
                   *, sparse: Collection[str] = (), exact: bool = True) -> dict[str, torch.Tensor]:
    """Float32 tensors from wire tensors, checked against ``shapes``.

    ``sparse``: the names the sender sent as differences, which the spec's transform (top-k, eden, lowrank)
    applies to (the rest are dense).
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
        how = layout(spec, name in sparse, shape)
        expected = _expected_keys(name, spec, how, wire)
        if keys != expected:
            raise CodecError(f"tensor {name!r} arrived as {sorted(keys)}, but codec {spec.text} "
                             f"{'' if how == 'dense' else f'({how}) '}sends {sorted(expected)}")
        channels, numel = channels_of(shape), math.prod(shape)
        if how == "dense":
            value = unpack_values(wire, name, name + SEP + "scale", spec, shape, None, channels)
        elif how == "eden":
            value = rotated.decode_rotated(wire, name, shape, spec.eden).to(spec.dtype)
        elif how == "lowrank":
            value = lowrank.decode_lowrank(wire, name, shape, spec)
        else:
            k = len(wire[name + SEP + "val"]) if wire[name + SEP + "val"].dim() == 1 else -1
            if not 0 <= k <= numel:
                raise CodecError(f"wire tensor {name + SEP + 'val'!r} must be 1-D with at most {numel} values")
            positions = _decode_positions(wire, name, numel, k)
            channel = positions // max(numel // max(channels, 1), 1)
            vals = unpack_values(wire, name + SEP + "val", name + SEP + "scale", spec, (k,), channel, channels)
            value = torch.zeros(numel, dtype=vals.dtype).index_put_((positions,), vals).reshape(shape)
        if not all_finite(value):
            raise CodecError(f"tensor {name!r} decodes to non-finite values")
        out[name] = value
    return out


def wire_bytes(wire: Mapping[str, torch.Tensor]) -> int:
    """Bytes of tensor data (no headers) in a set of wire tensors."""
    return sum(t.numel() * t.element_size() for t in wire.values())
