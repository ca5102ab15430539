"""PowerSGD's low-rank differences (Vogels et al., NeurIPS 2019), codec ``lowrank:RANK``.

The difference of a weight with two or more dimensions is read as a matrix ``M`` (out × in·k·k)
and sent as two thin factors from one step of power iteration: ``P = orth(M Q)``, ``Q' = Mᵀ P``,
and the receiver rebuilds ``P Q'ᵀ`` (the projection of ``M`` on the span of ``P``). ``Q`` is the
device's ``Q'`` of the tensor's previous round (warm start, kept with the error-feedback residuals
in :class:`~edge_client.wire.updates.ResidualStore` as ``NAME:q``), random the first time: the
repeated power step tracks the update's top singular directions across rounds at the cost of one.
What the factors miss goes into the residual with error feedback on. A matrix of rank at most
``RANK`` comes back exactly (to the value format's rounding), whatever ``Q`` was, if ``Q`` is random.

A tensor is factored only when the factors are smaller than it, ``RANK·(out + in) < out·in``;
biases, norms and small matrices go dense in the value format, as the codec's other layouts do.
Wire entries of ``NAME``: ``NAME:p`` (RANK × out, i.e. ``Pᵀ``) and ``NAME:q`` (RANK × in, ``Q'ᵀ``)
in the value format; with int8 each adds its scales, one per factor row (``NAME:p:scale``,
``NAME:q:scale``), which is why the factors travel transposed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping

import torch

from edge_client.wire.codec_spec import SEP, CodecError, CodecSpec
from edge_client.wire.values import all_finite, pack_values, unpack_values

__all__ = ["factored", "matrix_shape", "encode_lowrank", "decode_lowrank", "wire_keys", "state_key"]


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """A weight of ``shape`` as a matrix: output channels × everything else."""
    return shape[0], math.prod(shape[1:])


def factored(shape: tuple[int, ...], rank: int) -> bool:
    """Whether a difference of ``shape`` goes as rank-``rank`` factors (only when they are smaller)."""
    if len(shape) < 2:
        return False
    rows, cols = matrix_shape(shape)
    return rank * (rows + cols) < rows * cols


def state_key(name: str) -> str:
    """Where the device keeps the tensor's warm-start ``Q`` among its residuals."""
    return name + SEP + "q"


def wire_keys(name: str, spec: CodecSpec) -> set[str]:
    """The entries a factored tensor ``name`` travels as."""
    keys = {name + SEP + "p", name + SEP + "q"}
    return keys | {k + SEP + "scale" for k in keys} if spec.values == "int8" else keys


def _start(name: str, cols: int, rank: int, state: Mapping[str, torch.Tensor] | None,
           generator: torch.Generator | None, dtype: torch.dtype) -> torch.Tensor:
    q = state.get(state_key(name)) if state is not None else None
    if q is None or tuple(q.shape) != (cols, rank) or not all_finite(q) or not bool(q.abs().sum() > 0):
        q = torch.randn(cols, rank, generator=generator)
    return q.to(dtype)


def encode_lowrank(name: str, x: torch.Tensor, spec: CodecSpec, state: MutableMapping[str, torch.Tensor] | None,
                   generator: torch.Generator | None) -> dict[str, torch.Tensor]:
    """The factors of ``x`` (a tensor :func:`factored` accepts) in the value format; ``state`` gets the new Q."""
    assert spec.rank is not None
    rows, cols = matrix_shape(tuple(x.shape))
    m = x.detach().reshape(rows, cols)
    p = torch.linalg.qr(m @ _start(name, cols, spec.rank, state, generator, m.dtype)).Q   # rows × rank, orthonormal
    q = m.T @ p                                                                           # cols × rank
    if state is not None:
        state[state_key(name)] = q.to(torch.float32)
    out: dict[str, torch.Tensor] = {}
    for key, factor in ((name + SEP + "p", p.T.contiguous()), (name + SEP + "q", q.T.contiguous())):
        packed = pack_values(key, key, factor.reshape(-1), spec, None, spec.rank, generator)
        out.update({k: v.reshape(factor.shape) if k == key else v for k, v in packed.items()})
    return out


def decode_lowrank(wire: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...],
                   spec: CodecSpec) -> torch.Tensor:
    """The tensor ``name`` of ``shape`` rebuilt from its factors, after checking their dtypes, shapes,
    scales and finiteness."""
    assert spec.rank is not None
    rows, cols = matrix_shape(shape)
    factors = []
    for key, width in ((name + SEP + "p", rows), (name + SEP + "q", cols)):
        factor = unpack_values(wire, key, key + SEP + "scale", spec, (spec.rank, width), None, spec.rank)
        if not all_finite(factor):
            raise CodecError(f"wire tensor {key!r} holds non-finite values")
        factors.append(factor)
    return (factors[0].T @ factors[1]).reshape(shape)
