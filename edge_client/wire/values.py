"""Value formats: how a flat float tensor is packed as fp32, fp64, fp16, bf16 or int8, and checked on arrival.

Every codec layout (:mod:`edge_client.wire.codec` dense and top-k, :mod:`edge_client.wire.lowrank`'s
factors) carries its numbers through here, so each format has one packer and one checked unpacker.
int8 is symmetric with one float32 scale per output channel (index of the first dimension; one per
tensor for 0-D and 1-D tensors), in ``NAME:scale``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from edge_client.wire.codec_spec import EXACT_VALUES, SEP, VALUE_NAMES, CodecError, CodecSpec

__all__ = ["VALUE_FORMATS", "all_finite", "channels_of", "pack_values", "unpack_values", "need"]

VALUE_FORMATS: dict[str, torch.dtype] = dict(zip(VALUE_NAMES, (torch.float32, torch.float64, torch.float16,
                                                                torch.bfloat16, torch.int8), strict=True))
_FP16_MAX = 65504.0
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


def channels_of(shape: tuple[int, ...]) -> int:
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


def pack_values(name: str, key: str, flat: torch.Tensor, spec: CodecSpec, channel: torch.Tensor | None,
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


def need(wire: Mapping[str, torch.Tensor], key: str, dtypes: tuple[torch.dtype, ...],
          shape: tuple[int, ...] | None) -> torch.Tensor:
    t = wire[key]
    if t.dtype not in dtypes:
        raise CodecError(f"wire tensor {key!r} is {t.dtype}, expected {' or '.join(map(str, dtypes))}")
    if shape is not None and tuple(t.shape) != shape:
        raise CodecError(f"wire tensor {key!r} has shape {tuple(t.shape)}, expected {shape}")
    return t


def unpack_values(wire: Mapping[str, torch.Tensor], key: str, scale_key: str, spec: CodecSpec,
                  shape: tuple[int, ...], channel: torch.Tensor | None, channels: int) -> torch.Tensor:
    t = need(wire, key, (VALUE_FORMATS[spec.values],), shape)
    if spec.values != "int8":
        return t.to(spec.dtype)
    scale = need(wire, scale_key, (torch.float32,), (channels,))
    if not all_finite(scale) or bool((scale < 0).any()):
        raise CodecError(f"wire tensor {scale_key!r} holds negative or non-finite scales")
    q = t.to(torch.float32)
    if channel is None:
        return (q.reshape(channels, -1) * scale[:, None]).reshape(shape) if q.numel() else q
    return q * scale[channel]
