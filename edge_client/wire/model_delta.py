"""Delta broadcasts: the round's model as a quantized difference from the model a device already holds.

Both sides use this module, so that they compute the same bits. The coordinator encodes the
difference between its new global model and the *reference* (the model devices reconstructed
from the previous broadcast) with :func:`encode_delta`, then rebuilds the next reference with
:func:`apply_delta` from its own wire tensors, exactly as a device does. The quantization error
of one round therefore stays in the difference of the next, and a device's model stays within
one quantization step of the true global model instead of drifting.

A model is named by :func:`model_digest`, the SHA-256 of its float32 tensors (names, shapes and
bytes), so that a device can tell whether the base it holds is the one a delta was made from,
and whether what it rebuilt is what the coordinator holds.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import torch

from edge_client.wire.codec import CodecError, CodecSpec, all_finite, decode_tensors, encode_tensors

__all__ = ["model_digest", "encode_delta", "apply_delta", "exact_model"]


def model_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 (hex) of float32 tensors: each name with its shape, then its bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu", torch.float32).contiguous()
        h.update(json.dumps([name, list(t.shape)]).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def exact_model(wire: Mapping[str, torch.Tensor], codec: CodecSpec) -> dict[str, torch.Tensor] | None:
    """The model a broadcast's wire tensors carry when they are the model itself (dense float32 values), else
    None: only such a broadcast can be the base of a delta, since only it decodes to the bits that were sent."""
    if codec.values != "fp32" or codec.topk is not None:
        return None
    if any(t.dtype != torch.float32 for t in wire.values()):
        return None
    return dict(wire)


def encode_delta(target: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor], spec: CodecSpec, *,
                 generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Wire tensors of ``target - base`` in ``spec`` (top-k, when the spec has it, over every tensor)."""
    if sorted(target) != sorted(base):
        raise CodecError(f"a delta needs the same tensors on both sides: {sorted(set(target) ^ set(base))[:5]} "
                         "differ")
    diff = {}
    for name, t in target.items():
        if tuple(t.shape) != tuple(base[name].shape):
            raise CodecError(f"tensor {name!r} changed shape from {tuple(base[name].shape)} to {tuple(t.shape)}; "
                             "send the full model instead")
        diff[name] = t.detach().to("cpu", torch.float32) - base[name].to(torch.float32)
    return encode_tensors(diff, spec, sparse=list(diff) if spec.topk is not None else (), generator=generator)


def apply_delta(base: Mapping[str, torch.Tensor], wire: Mapping[str, torch.Tensor],
                spec: CodecSpec) -> dict[str, torch.Tensor]:
    """``base`` plus the difference ``wire`` carries in ``spec``: float32, every tensor of ``base``.

    The wire tensors are checked against the base's names and shapes (every one present, no other),
    their dtypes and positions by the codec, and the sum for finiteness; any problem is a CodecError.
    """
    for name, t in base.items():
        if t.dtype != torch.float32:
            raise CodecError(f"the base of a delta must be float32; tensor {name!r} is {t.dtype}")
    shapes = {name: tuple(t.shape) for name, t in base.items()}
    diff = decode_tensors(wire, spec, shapes, sparse=list(shapes) if spec.topk is not None else (), exact=True)
    out = {}
    for name, d in diff.items():
        value = base[name] + d
        if not all_finite(value):
            raise CodecError(f"tensor {name!r} is not finite after adding its delta")
        out[name] = value
    return out
