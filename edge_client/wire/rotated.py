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

Below one bit per entry (``eden:P``, EDEN's sparsified variant): each chunk sends the signs of a random
``ceil(P d)`` of its ``d`` rotated entries, the same ones on both sides (drawn from the seed, so no index
travels), and the rest decode to 0. The scale keeps the projection exact, ``S = ||x||^2 / ||(R x)_kept||_1``,
so the decoded vector stays unbiased; its one-round error grows to about ``sqrt(pi / (2 P) - 1)`` of the
chunk's norm (2.1 at P = 0.3), which averaging over a round's devices takes down; error feedback would grow it
below P = pi / 4 (``codec_spec.eden_variance``), where the configuration check refuses it. P = 1 is the dense
variant above, bit for bit.

Each tensor's diagonal comes from a 63-bit seed the sender draws from the task's generator and sends
with the tensor (8 bytes), so decoding needs nothing but the message and the codec spec. Wire entries of
``NAME``: ``NAME:bits`` (U8, the signs of the kept rotated entries, chunk by chunk in position order,
little-endian bit order, 1: >= 0), ``NAME:scale`` (F32, one per chunk) and ``NAME:seed`` (I64, one).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import numpy as np
import torch

from edge_client.wire.codec_spec import SEP, CodecError
from edge_client.wire.values import need

__all__ = ["CHUNK", "KINDS", "padded_chunks", "encode_rotated", "decode_rotated"]

CHUNK = 1 << 14          # entries rotated together: larger gains nothing in error, smaller adds scales
BLOCK_ROWS = 16          # chunks rotated at a time: a few MiB of working space, whatever the tensor's size
KINDS = ("bits", "scale", "seed")
_KEPT_SALT = 0x2545F4914F6CDD1D   # the kept entries' generator is seeded apart from the diagonal's


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


def _diagonal_bits(seed: int, length: int) -> np.ndarray:
    """The rotation's ±1 diagonal, packed: bytes from ``torch.randint(0, 256)`` on a generator seeded with
    ``seed``, whose bits in little-endian order are 1 for +1 and 0 for -1."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, ((length + 7) // 8,), generator=g, dtype=torch.uint8).numpy()


def _diagonal(packed: np.ndarray, start: int, length: int) -> torch.Tensor:
    """Entries ``start`` to ``start + length`` of the diagonal as float32 ±1 (``start`` a multiple of 8)."""
    bits = np.unpackbits(packed[start // 8:(start + length + 7) // 8], bitorder="little")[:length]
    return torch.from_numpy(bits.astype(np.float32)).mul_(2).sub_(1)


def _kept_counts(lengths: list[int], fraction: float) -> list[int]:
    """How many rotated entries each chunk sends: all of them at fraction 1, else ``ceil(fraction d)``."""
    return lengths if fraction >= 1 else [max(1, math.ceil(fraction * d - 1e-9)) for d in lengths]


def _kept_generator(seed: int, fraction: float) -> torch.Generator | None:
    """The generator of the kept entries' positions, chunk after chunk; None: every entry is sent."""
    return None if fraction >= 1 else torch.Generator().manual_seed(seed ^ _KEPT_SALT)


def _kept_rows(g: torch.Generator, rows: int, d: int, k: int) -> torch.Tensor:
    """The next ``rows`` chunks' kept positions (ascending, within each chunk): ``[rows, k]``."""
    return torch.stack([torch.randperm(d, generator=g)[:k].sort().values for _ in range(rows)])


def _blocks(lengths: list[int]) -> Iterator[tuple[int, int, int]]:
    """(first entry, rows, d): the chunks, :data:`BLOCK_ROWS` of one length at a time, so that a tensor of any
    size is rotated in a bounded working space. Every chunk but the last is ``CHUNK`` long, so each starts at a
    multiple of ``CHUNK`` and the last (padded) one may join the others only when it is ``CHUNK`` long too."""
    first = 0
    while first < len(lengths):
        d = lengths[first]
        rows = 1
        while rows < BLOCK_ROWS and first + rows < len(lengths) and lengths[first + rows] == d:
            rows += 1
        yield first * CHUNK, rows, d
        first += rows


def encode_rotated(name: str, x: torch.Tensor, generator: torch.Generator | None,
                   fraction: float = 1.0) -> dict[str, torch.Tensor]:
    """The wire entries of ``x`` (any shape) as the signs of ``fraction`` of its rotated entries, one scale per
    chunk and the rotation's seed."""
    flat = x.detach().reshape(-1).to(torch.float32)
    numel, lengths = flat.numel(), padded_chunks(flat.numel())
    seed = int(torch.randint(0, 2**63 - 1, (1,), generator=generator))
    if not numel:
        return {name + SEP + "bits": torch.zeros(0, dtype=torch.uint8), name + SEP + "scale": torch.zeros(0),
                name + SEP + "seed": torch.tensor([seed], dtype=torch.int64)}
    diagonal, kept_from = _diagonal_bits(seed, sum(lengths)), _kept_generator(seed, fraction)
    scales, signs = [], []
    for start, rows, d in _blocks(lengths):
        block = torch.zeros(rows * d)
        piece = flat[start:start + rows * d]
        block[:len(piece)] = piece
        block *= _diagonal(diagonal, start, rows * d)
        block = block.reshape(rows, d)
        norms_sq = block.pow(2).sum(dim=1, dtype=torch.float64)
        rotated = _hadamard(block)   # sqrt(d) * R x, a row per chunk
        if kept_from is not None:    # the entries not sent count for nothing in the scale's sum
            kept = _kept_rows(kept_from, rows, d, _kept_counts([d], fraction)[0])
            rotated = torch.zeros_like(rotated).scatter_(1, kept, rotated.gather(1, kept))
            signs.append((rotated.gather(1, kept) >= 0).numpy().reshape(-1))
        else:
            signs.append((rotated >= 0).numpy().reshape(-1))
        abs_sums = rotated.abs().sum(dim=1, dtype=torch.float64)
        # S = ||x||^2 / ||(R x)_kept||_1, with R x = rotated / sqrt(d); 0 for a chunk of zeros
        scales.append(torch.where(abs_sums > 0, norms_sq * math.sqrt(d) / abs_sums.clamp_min(1e-300), 0.0))
    scale = torch.cat(scales)
    if not bool(torch.isfinite(scale.to(torch.float32)).all()):
        raise CodecError(f"tensor {name!r} is too large for a float32 scale; clip the update (upload.clip_norm)")
    bits = np.packbits(np.concatenate(signs), bitorder="little")
    return {name + SEP + "bits": torch.from_numpy(bits), name + SEP + "scale": scale.to(torch.float32),
            name + SEP + "seed": torch.tensor([seed], dtype=torch.int64)}


def decode_rotated(wire: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...],
                   fraction: float = 1.0) -> torch.Tensor:
    """The tensor ``name`` of ``shape`` from the rotated signs of ``fraction`` of its entries, after checking
    every entry's dtype and shape."""
    numel = math.prod(shape)
    lengths = padded_chunks(numel)
    total, sent = sum(lengths), sum(_kept_counts(lengths, fraction)) if numel else 0
    bits_key, scale_key, seed_key = (name + SEP + kind for kind in KINDS)
    packed = need(wire, bits_key, (torch.uint8,), ((sent + 7) // 8,))
    scale = need(wire, scale_key, (torch.float32,), (len(lengths),))
    seed = need(wire, seed_key, (torch.int64,), (1,))
    unpacked = np.unpackbits(packed.numpy(), bitorder="little")
    if unpacked[sent:].any():
        raise CodecError(f"wire tensor {bits_key!r} sets bits past the {sent} rotated entries of {name!r} sent")
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise CodecError(f"wire tensor {scale_key!r} holds negative or non-finite scales")
    if int(seed[0]) < 0:
        raise CodecError(f"wire tensor {seed_key!r} holds a negative seed")
    if not total:
        return torch.zeros(shape)
    diagonal, kept_from = _diagonal_bits(int(seed[0]), total), _kept_generator(int(seed[0]), fraction)
    out, read = torch.empty(numel), 0
    for start, rows, d in _blocks(lengths):
        chunk = start // CHUNK
        k = _kept_counts([d], fraction)[0]
        signs = torch.from_numpy(unpacked[read:read + rows * k].astype(np.float32)).mul_(2).sub_(1).reshape(rows, k)
        read += rows * k
        if kept_from is not None:   # the entries not sent decode to 0
            signs = torch.zeros(rows, d).scatter_(1, _kept_rows(kept_from, rows, d, k), signs)
        per_row = (scale[chunk:chunk + rows] / torch.tensor(float(d)).sqrt()).reshape(rows, 1)   # S / sqrt(d)
        rebuilt = (_hadamard(signs) * per_row).reshape(-1) * _diagonal(diagonal, start, rows * d)
        end = min(start + rows * d, numel)
        out[start:end] = rebuilt[:end - start]
    return out.reshape(shape)

