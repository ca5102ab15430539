"""The chunk format: how a message larger than a broker's packet limit is cut into pieces.

Brokers cap the size of one publish (EMQX 1 MB by default, AWS IoT Core 128 KB,
Mosquitto's ``max_packet_size``), and a float32 model is often larger. A message
above ``max_message_bytes`` is split into chunks, each a 72-byte header and a
slice of the message:

====================  ======================================================
magic (4 bytes)       ``FDC1``; it can never start an envelope or a
                      compressed message
flags (1 byte)        bit 0: the chunk went to ``TOPIC/INDEX`` (retained)
reserved (3 bytes)    zero
message id (16)       random, new for every publish of a message
index, count (u32)    this chunk's position, the number of chunks
length (u64)          the whole message's length
sha256 (32)           the whole message's SHA-256
====================  ======================================================

A header is checked before the data behind it is copied, so a bad chunk costs no
allocation; putting chunks back together is :mod:`edge_client.wire.reassembly`'s job.
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import NamedTuple

from storage.errors import FedgeError

__all__ = ["MAGIC", "HEADER_BYTES", "MIN_MESSAGE_BYTES", "ChunkError", "ChunkHeader", "split", "read_header",
           "is_chunk"]

MAGIC = b"FDC1"
_HEADER = struct.Struct("<4sB3x16sIIQ32s")
HEADER_BYTES = _HEADER.size
MIN_MESSAGE_BYTES = 1024
_PART_TOPIC = 1


class ChunkError(FedgeError, ValueError):
    """A chunk that cannot be accepted; ``str(err)`` is the logged reason."""


def is_chunk(payload: bytes) -> bool:
    return bytes(payload[:4]) == MAGIC


def split(payload: bytes, max_message_bytes: int, *, part_topic: bool = False) -> list[bytes]:
    """The chunks of ``payload``, each at most ``max_message_bytes`` long."""
    if max_message_bytes < MIN_MESSAGE_BYTES:
        raise ValueError(f"max_message_bytes must be at least {MIN_MESSAGE_BYTES}, got {max_message_bytes}")
    step = max_message_bytes - HEADER_BYTES
    count = max(1, -(-len(payload) // step))
    message_id, digest = os.urandom(16), hashlib.sha256(payload).digest()
    flags = _PART_TOPIC if part_topic else 0
    return [_HEADER.pack(MAGIC, flags, message_id, i, count, len(payload), digest) + payload[i * step:(i + 1) * step]
            for i in range(count)]


class ChunkHeader(NamedTuple):
    """A chunk's header, checked, and the size of the data behind it (not yet copied)."""

    message_id: bytes
    index: int
    count: int
    length: int
    digest: bytes
    part_topic: bool
    size: int


def read_header(payload: bytes) -> ChunkHeader:
    """Check a chunk's header without copying its data, so a bad chunk costs no allocation."""
    if len(payload) < HEADER_BYTES or not is_chunk(payload):
        raise ChunkError(f"not a chunk ({len(payload)} bytes without a complete chunk header)")
    _, flags, message_id, index, count, length, digest = _HEADER.unpack_from(payload)
    size = len(payload) - HEADER_BYTES
    if count < 1 or index >= count or count > max(length, 1) or size > length:
        raise ChunkError(f"chunk {index} of {count} with {size} bytes does not fit a {length}-byte message")
    return ChunkHeader(message_id, index, count, length, digest, bool(flags & _PART_TOPIC), size)
