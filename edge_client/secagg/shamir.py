"""t-of-n Shamir secret sharing of 32-byte secrets over the prime field of 2^256 + 297.

A secret is the constant term of a random polynomial of degree t - 1; a share is the
polynomial at a non-zero point. Any t shares give the secret back by Lagrange
interpolation at 0, and t - 1 shares say nothing about it. The prime is the smallest
above 2^256, so every 32-byte value (seeds, X25519 private keys) is a field element as
it is, and a share fits in 33 bytes.

Points are client ids + 1 (:func:`point_of`), so the server knows whose share is whose
and a client cannot claim another's point.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from edge_client.secagg.errors import ShareError

__all__ = ["PRIME", "SECRET_BYTES", "SHARE_BYTES", "point_of", "split", "interpolate", "reconstruct",
           "share_to_bytes", "share_from_bytes"]

PRIME = 2**256 + 297
SECRET_BYTES = 32
SHARE_BYTES = 33


def point_of(client_id: int) -> int:
    """The evaluation point of a client's shares: never 0, where the secret sits."""
    return client_id + 1


def split(secret: bytes, points: Sequence[int], threshold: int) -> list[int]:
    """The shares of ``secret`` at ``points``, any ``threshold`` of which reconstruct it."""
    if not isinstance(secret, bytes) or len(secret) != SECRET_BYTES:
        raise ShareError(f"a shared secret must be {SECRET_BYTES} bytes")
    if len(set(points)) != len(points) or not all(0 < x < PRIME for x in points):
        raise ShareError("share points must be distinct and in 1..PRIME-1")
    if not 1 <= threshold <= len(points):
        raise ShareError(f"threshold {threshold} must be between 1 and the number of shares, {len(points)}")
    coefficients = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    shares = []
    for x in points:
        y = 0
        for c in reversed(coefficients):
            y = (y * x + c) % PRIME
        shares.append(y)
    return shares


def _check_points(points: Sequence[tuple[int, int]]) -> None:
    xs = [x for x, _ in points]
    if len(set(xs)) != len(xs):
        raise ShareError(f"duplicate share points {sorted(x for x in set(xs) if xs.count(x) > 1)}: "
                         "each share must come from a different client")
    for x, y in points:
        if not (0 < x < PRIME and 0 <= y < PRIME):
            raise ShareError(f"share ({x}, ...) is outside the field: points in 1..PRIME-1, values in 0..PRIME-1")


def interpolate(points: Sequence[tuple[int, int]], at: int = 0) -> int:
    """The polynomial through ``points`` (of degree len - 1) evaluated at ``at``."""
    _check_points(points)
    total = 0
    for i, (xi, yi) in enumerate(points):
        num, den = 1, 1
        for j, (xj, _) in enumerate(points):
            if j != i:
                num = num * (at - xj) % PRIME
                den = den * (xi - xj) % PRIME
        total = (total + yi * num * pow(den, -1, PRIME)) % PRIME
    return total


def reconstruct(points: Sequence[tuple[int, int]], threshold: int) -> bytes:
    """The secret from at least ``threshold`` shares; extra shares must lie on the same polynomial.

    Checking the extras catches a corrupted or forged share when there are spare ones,
    instead of silently returning a wrong secret.
    """
    if len(points) < threshold:
        raise ShareError(f"{len(points)} shares cannot reconstruct a secret shared with threshold {threshold}")
    _check_points(points)
    basis, extra = list(points[:threshold]), points[threshold:]
    for x, y in extra:
        if interpolate(basis, x) != y:
            raise ShareError(f"the share at point {x} does not lie on the polynomial of the others: "
                             "a share was altered")
    value = interpolate(basis)
    if value >= 1 << (8 * SECRET_BYTES):
        raise ShareError("the shares combine to no 32-byte secret: a share was altered")
    return value.to_bytes(SECRET_BYTES, "big")


def share_to_bytes(value: int) -> bytes:
    return value.to_bytes(SHARE_BYTES, "big")


def share_from_bytes(raw: bytes) -> int:
    if not isinstance(raw, bytes) or len(raw) != SHARE_BYTES:
        raise ShareError(f"a share must be {SHARE_BYTES} bytes")
    value = int.from_bytes(raw, "big")
    if value >= PRIME:
        raise ShareError("a share is not below the field prime 2^256 + 297")
    return value
