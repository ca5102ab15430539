"""Modular quantization and the masks that hide one client's vector but cancel in the sum.

A float vector is clipped to [-clip, clip], scaled and rounded to integers, and kept
modulo 2^bits in two's complement, so a sum of n vectors is exact as long as
n * round(clip * scale) < 2^(bits - 1) (:func:`capacity_ok`) and decodes with its sign
without knowing n. Arithmetic is numpy's unsigned wrap-around in uint32 (bits <= 32)
or uint64, then a mask to ``bits``: 2^bits divides 2^32 and 2^64, so the residue is right.

A mask is a pseudorandom vector: the ChaCha20 keystream of a 32-byte seed, cut into
``bits``-bit words. Each seed is used for one stream only (self seeds are fresh each
round, pairwise seeds are derived with the round in their HKDF info), so a fixed nonce
is safe.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from edge_client.secagg.errors import MessageError, ParamsError

__all__ = ["MIN_BITS", "MAX_BITS", "word_dtype", "capacity_ok", "quantize", "dequantize", "prg", "combined_mask",
           "add_mod", "sub_mod", "to_bytes", "from_bytes", "largest_scale"]

MIN_BITS, MAX_BITS = 8, 64
_NONCE = bytes(16)   # ChaCha20 in cryptography: 4-byte counter then 12-byte nonce, both zero


def _check_bits(bits: int) -> None:
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ParamsError(f"modulus bits {bits} must be in {MIN_BITS}..{MAX_BITS}")


def word_dtype(bits: int) -> np.dtype:
    """The unsigned type arithmetic mod 2^bits runs in."""
    _check_bits(bits)
    return np.dtype("<u4") if bits <= 32 else np.dtype("<u8")


def _mask_bits(values: np.ndarray, bits: int) -> np.ndarray:
    if bits % 32:
        values &= values.dtype.type((1 << bits) - 1)
    return values


def capacity_ok(num_clients: int, clip: float, scale: float, bits: int) -> bool:
    """Whether the sum of ``num_clients`` quantized vectors cannot wrap around 2^bits."""
    _check_bits(bits)
    return num_clients * round(clip * scale) < 1 << (bits - 1)


def quantize(values: np.ndarray, clip: float, scale: float, bits: int,
             rng: np.random.Generator | None = None) -> np.ndarray:
    """Clipped, scaled, rounded integers mod 2^bits; ``rng`` rounds stochastically (unbiased), else to nearest."""
    scaled = np.clip(np.asarray(values, dtype=np.float64), -clip, clip) * scale
    rounded = np.floor(scaled + rng.random(scaled.shape)) if rng is not None else np.rint(scaled)
    return _mask_bits(rounded.astype(np.int64).astype(word_dtype(bits)), bits)


def dequantize(residues: np.ndarray, scale: float, bits: int) -> np.ndarray:
    """Floats from residues mod 2^bits read as signed (two's complement in ``bits``)."""
    shift = np.uint64(64 - bits)
    signed = (residues.astype(np.uint64) << shift).view(np.int64) >> np.int64(shift)
    return signed.astype(np.float64) / scale


def prg(seed: bytes, length: int, bits: int) -> np.ndarray:
    """``length`` uniform words mod 2^bits from a 32-byte seed."""
    if not isinstance(seed, bytes) or len(seed) != 32:
        raise MessageError("a mask seed must be 32 bytes")
    dtype = word_dtype(bits)
    stream = Cipher(algorithms.ChaCha20(seed, _NONCE), mode=None).encryptor().update(bytes(length * dtype.itemsize))
    return _mask_bits(np.frombuffer(stream, dtype=dtype).copy(), bits)


def combined_mask(length: int, bits: int, plus: Iterable[bytes], minus: Iterable[bytes]) -> np.ndarray:
    """Sum of PRG(seed) over ``plus`` minus over ``minus``, mod 2^bits.

    The one place masks are composed: a client builds its mask with it, and the server
    builds the masks it must remove with it, so the two cannot drift apart.
    """
    total = np.zeros(length, dtype=word_dtype(bits))
    for seed in plus:
        total += prg(seed, length, bits)
    for seed in minus:
        total -= prg(seed, length, bits)
    return _mask_bits(total, bits)


def add_mod(a: np.ndarray, b: np.ndarray, bits: int) -> np.ndarray:
    return _mask_bits(a + b, bits)


def sub_mod(a: np.ndarray, b: np.ndarray, bits: int) -> np.ndarray:
    return _mask_bits(a - b, bits)


def to_bytes(residues: np.ndarray, bits: int) -> bytes:
    """Little-endian words (4 bytes each up to 32 bits, else 8), as a masked input travels."""
    return np.ascontiguousarray(residues, dtype=word_dtype(bits)).tobytes()


def from_bytes(raw: bytes, length: int, bits: int) -> np.ndarray:
    """Words from the wire, checked for count and for range mod 2^bits."""
    dtype = word_dtype(bits)
    if not isinstance(raw, bytes) or len(raw) != length * dtype.itemsize:
        raise MessageError(f"a masked vector of {length} entries at {bits} bits must be "
                           f"{length * dtype.itemsize} bytes, got {len(raw) if isinstance(raw, bytes) else raw!r}")
    values = np.frombuffer(raw, dtype=dtype).copy()
    if bits % 32 and values.size and int(values.max()) >> bits:
        raise MessageError(f"a masked vector holds values at or above 2^{bits}")
    return values


def largest_scale(num_clients: int, clip: float, bits: int) -> float:
    """The finest scale at which ``num_clients`` vectors clipped to ``clip`` still sum without wrapping."""
    scale = ((1 << (bits - 1)) - 1) // num_clients / clip
    while scale > 0 and not capacity_ok(num_clients, clip, scale, bits):
        scale = float(np.nextafter(scale, 0.0))
    return scale
