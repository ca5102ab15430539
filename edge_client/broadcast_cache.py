"""The model broadcasts a device holds, by the SHA-256 of their bytes.

A task names its model by the hash of the broadcast it came in, so the device must keep broadcasts
until a task asks for one; and many clients in one process (simulated clients, the fleet
benchmark's stand-in devices) would each decode the same broadcast if they did not share the store.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Protocol

import torch

from edge_client.wire.codec import CodecSpec

__all__ = ["Broadcast", "BroadcastCache", "Broadcasts"]

Broadcast = tuple[dict[str, torch.Tensor], CodecSpec, int]   # a decoded broadcast: wire tensors, codec, round


class BroadcastCache:
    """Model broadcasts by SHA-256, oldest first: their wire tensors, codec and round. Keeps the
    current model and the one before; safe to share between clients in one process, which then
    decode each broadcast once."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._items: OrderedDict[str, Broadcast] = OrderedDict()

    def __contains__(self, digest: object) -> bool:
        with self._lock:
            return digest in self._items

    def get(self, digest: str) -> tuple[dict[str, torch.Tensor], CodecSpec] | None:
        with self._lock:
            item = self._items.get(digest)
        return None if item is None else (item[0], item[1])

    def add(self, digest: str, tensors: dict[str, torch.Tensor], codec: CodecSpec, round: int = 0) -> None:
        with self._lock:
            self._items[digest] = (tensors, codec, round)
            while len(self._items) > self.keep:
                self._items.popitem(last=False)

    def receive(self, digest: str, read: Callable[[], Broadcast | None]) -> int | None:
        """Take the broadcast whose bytes hash to ``digest`` and return its round; ``read()`` decodes
        it (or says it is no broadcast: None), only if it is not held already: same hash, same bytes."""
        with self._lock:
            item = self._items.get(digest)
        if item is not None:
            return item[2]
        got = read()
        if got is not None:
            self.add(digest, *got)
        return None if got is None else got[2]


class Broadcasts(Protocol):
    """What the protocol needs of a broadcast store: whether this device holds one, taking one in, and reading
    one (the base a delta broadcast applies to).
    A caller may bring its own store (shared, or counting what it decodes) instead of a cache."""

    def __contains__(self, digest: object) -> bool: ...

    def get(self, digest: str) -> tuple[dict[str, torch.Tensor], CodecSpec] | None: ...

    def receive(self, digest: str, read: Callable[[], Broadcast | None]) -> int | None: ...
