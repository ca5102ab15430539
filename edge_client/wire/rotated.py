"""The rotated 1-bit quantizer of DRIVE (Vargaftik et al., NeurIPS 2021) and EDEN (ICML 2022), codec ``eden``.

A difference is cut into chunks of at most :data:`CHUNK` entries (the last one zero-padded to a power
of two), and each chunk ``x`` of ``d`` entries is rotated by the randomized Hadamard transform
``R x = H D x / sqrt(d)`` (``D`` a random ±1 diagonal, ``H`` the Walsh-Hadamard matrix). After the
rotation every coordinate is nearly Gaussian with the same variance, so one sign bit per coordinate
and one scale per chunk describe it well. The receiver rebuilds ``S * R^-1 sign(R x)``.

The scale is the unbiased one of DRIVE and of 1-bit EDEN, ``S = ||x||^2 / ||R x||_1``: it makes the
decoded vector's projection on ``x`` exactly ``||x||^2``, so over the rotation's randomness the
decoded vector's mean is ``x`` (exactly for a uniform random rotation, closely for the Hadamard one;
``test_eden_is_unbiased_over_rotations``). Its error is about ``sqrt(pi/2 - 1) = 0.76`` of the
chunk's norm in one round; error feedback carries it into the next.

Each tensor's diagonal comes from a 63-bit seed the sender draws from the task's generator and sends
with the tensor (8 bytes), so decoding needs nothing but the message. Wire entries of ``NAME``:
``NAME:bits`` (U8, the signs of the padded rotated entries, little-endian bit order, 1: >= 0),
``NAME:scale`` (F32, one per chunk) and ``NAME:seed`` (I64, one).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from edge_client.wire.codec_spec import SEP, CodecError
from edge_client.wire.values import need

__all__ = ["CHUNK", "KINDS", "padded_chunks", "encode_rotated", "decode_rotated"]

CHUNK = 1 << 14          # entries rotated together: larger gains nothing in error, smaller adds scales
KINDS = ("bits", "scale", "seed")


def padded_chunks(numel: int) -> list[int]:
    """The rotated lengths of a tensor of ``numel`` entries: full chunks, then the rest padded to a power of 2."""
    full, rest = divmod(numel, CHUNK)
    return [CHUNK] * full + ([1 << (rest - 1).bit_length()] if rest else [])


def _hadamard(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform of each row of ``x`` (rows of a power-of-two length), in
    log2(d) butterfly passes between two buffers (no allocation per pass)."""
    rows, d = x.shape
    src, dst = x.clone(), torch.empty_like(x)
    h = 1
    while h < d:
        a, o = src.view(rows, d // (2 * h), 2, h), dst.view(rows, d // (2 * h), 2, h)
        torch.add(a[:, :, 0], a[:, :, 1], out=o[:, :, 0])
        torch.sub(a[:, :, 0], a[:, :, 1], out=o[:, :, 1])
        src, dst = dst, src
        h *= 2
    return src


def _diagonal(seed: int, length: int) -> torch.Tensor:
    """The rotation's ±1 diagonal: bytes from ``torch.randint(0, 256)`` on a generator seeded with ``seed``,
    their bits unpacked in little-endian order, 1 for +1 and 0 for -1."""
    g = torch.Generator().manual_seed(seed)
    random_bytes = torch.randint(0, 256, ((length + 7) // 8,), generator=g, dtype=torch.uint8)
    bits = np.unpackbits(random_bytes.numpy(), bitorder="little")[:length]
    return torch.from_numpy(bits.astype(np.float32)).mul_(2).sub_(1)


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def _by_chunk(flat: torch.Tensor, numel: int, fn) -> list[torch.Tensor]:
    """``fn`` applied to the full chunks as one (n, CHUNK) batch and to the padded rest as a (1, d) row."""
    full = numel // CHUNK
    out = [fn(flat[:full * CHUNK].reshape(full, CHUNK))] if full else []
    if len(flat) > full * CHUNK:
        out.append(fn(flat[full * CHUNK:].reshape(1, -1)))
    return out


def encode_rotated(name: str, x: torch.Tensor, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
    """The wire entries of ``x`` (any shape) as rotated signs, one scale per chunk and the rotation's seed."""
    flat = x.detach().reshape(-1).to(torch.float32)
    numel, lengths = flat.numel(), padded_chunks(flat.numel())
    seed = int(torch.randint(0, 2**63 - 1, (1,), generator=generator))
    if not numel:
        return {name + SEP + "bits": torch.zeros(0, dtype=torch.uint8), name + SEP + "scale": torch.zeros(0),
                name + SEP + "seed": torch.tensor([seed], dtype=torch.int64)}
    padded = torch.zeros(sum(lengths))
    padded[:numel] = flat
    padded *= _diagonal(seed, len(padded))
    rotated = torch.cat([r.reshape(-1) for r in _by_chunk(padded, numel, _hadamard)])   # sqrt(d) * R x
    norms_sq = torch.cat([c.pow(2).sum(dim=1, dtype=torch.float64) for c in _by_chunk(padded, numel, _same)])
    abs_sums = torch.cat([r.abs().sum(dim=1, dtype=torch.float64) for r in _by_chunk(rotated, numel, _same)])
    # S = ||x||^2 / ||R x||_1, with R x = rotated / sqrt(d); 0 for a chunk of zeros
    lengths_t = torch.tensor(lengths, dtype=torch.float64)
    scales = torch.where(abs_sums > 0, norms_sq * lengths_t.sqrt() / abs_sums.clamp_min(1e-300), 0.0)
    if not bool(torch.isfinite(scales.to(torch.float32)).all()):
        raise CodecError(f"tensor {name!r} is too large for a float32 scale; clip the update (upload.clip_norm)")
    bits = np.packbits((rotated >= 0).numpy(), bitorder="little")
    return {name + SEP + "bits": torch.from_numpy(bits), name + SEP + "scale": scales.to(torch.float32),
            name + SEP + "seed": torch.tensor([seed], dtype=torch.int64)}


def decode_rotated(wire: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor ``name`` of ``shape`` from its rotated signs, after checking every entry's dtype and shape."""
    numel = math.prod(shape)
    lengths = padded_chunks(numel)
    total = sum(lengths)
    bits_key, scale_key, seed_key = (name + SEP + kind for kind in KINDS)
    packed = need(wire, bits_key, (torch.uint8,), ((total + 7) // 8,))
    scale = need(wire, scale_key, (torch.float32,), (len(lengths),))
    seed = need(wire, seed_key, (torch.int64,), (1,))
    unpacked = np.unpackbits(packed.numpy(), bitorder="little")
    if unpacked[total:].any():
        raise CodecError(f"wire tensor {bits_key!r} sets bits past the {total} rotated entries of {name!r}")
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise CodecError(f"wire tensor {scale_key!r} holds negative or non-finite scales")
    if int(seed[0]) < 0:
        raise CodecError(f"wire tensor {seed_key!r} holds a negative seed")
    if not total:
        return torch.zeros(shape)
    signs = torch.from_numpy(unpacked[:total].astype(np.float32)).mul_(2).sub_(1)
    sizes = torch.tensor(lengths)
    per_entry = torch.repeat_interleave(scale / sizes.to(torch.float32).sqrt(), sizes)   # S / sqrt(d), each chunk
    rebuilt = torch.cat([r.reshape(-1) for r in _by_chunk(signs, numel, _hadamard)])    # H sign(R x), per chunk
    rebuilt = rebuilt * per_entry * _diagonal(int(seed[0]), total)
    return rebuilt[:numel].reshape(shape)

