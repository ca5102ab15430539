"""SecAgg+'s sparse neighbour graph: who masks with whom and who holds whose shares.

Bell et al. replace the complete graph of SecAgg with a random k-regular one (k about
log n), which keeps the sum private and correct with high probability while each client
does O(log n) work. Here it is a ring lattice (a Harary graph) over a random order of
the clients: each is joined to the k/2 nearest on either side, so every client has
exactly k neighbours and the relation is symmetric.

The order comes from SHA-256 of the round's seed and each id, not from numpy's
generators, whose streams may change between versions: a device and the coordinator
with different numpy must compute the same graph.
"""

from __future__ import annotations

import hashlib
import math

from edge_client.secagg.errors import ParamsError

__all__ = ["neighbours", "suggested_degree"]


def suggested_degree(num_clients: int) -> int:
    """An even degree near 2 log2 n, capped at the complete graph: a starting point, not a proof.

    The graph must stay connected among survivors and every client needs a threshold
    of answering neighbours, so the degree sets how many dropouts a round survives.
    """
    if num_clients < 2:
        raise ParamsError("secure aggregation needs at least 2 clients")
    degree = 2 * math.ceil(math.log2(num_clients))
    return min(degree, num_clients - 1)


def neighbours(num_clients: int, degree: int, seed: bytes) -> tuple[tuple[int, ...], ...]:
    """Each client's neighbours (ids 0..n-1, ascending); the complete graph when degree >= n - 1."""
    if num_clients < 2:
        raise ParamsError("secure aggregation needs at least 2 clients")
    if degree >= num_clients - 1:
        return tuple(tuple(j for j in range(num_clients) if j != i) for i in range(num_clients))
    if degree < 2 or degree % 2:
        raise ParamsError(f"graph degree {degree} must be even and at least 2 (k/2 neighbours on either side), "
                          f"or at least {num_clients - 1} for the complete graph")
    order = sorted(range(num_clients), key=lambda i: hashlib.sha256(seed + i.to_bytes(4, "big")).digest())
    joined: list[set[int]] = [set() for _ in range(num_clients)]
    for position, client in enumerate(order):
        for step in range(1, degree // 2 + 1):
            other = order[(position + step) % num_clients]
            joined[client].add(other)
            joined[other].add(client)
    return tuple(tuple(sorted(s)) for s in joined)
