"""Lossless byte compression of whole messages (zstd or lz4), used only when it pays.

A compressed message is a 4-byte magic followed by one compressed frame. The magic
can never start a plain envelope (whose first 8 bytes are a header length below
4 MiB, so its bytes 3 to 7 are zero), so a receiver tells the two apart without a
flag. Decompression is bounded: a frame that would expand past the receiver's
limit is refused before the memory is spent. The compressor libraries are
imported only when used, so a device without them still runs uncompressed codecs.
"""

from __future__ import annotations

from types import ModuleType

from storage.errors import FedgeError

__all__ = ["COMPRESSORS", "CompressionError", "compress", "decompress", "check_available"]

# name -> (magic, default level, valid levels, pip package)
COMPRESSORS: dict[str, tuple[bytes, int, range, str]] = {
    "zstd": (b"FDZ1", 3, range(1, 23), "zstandard"),
    "lz4": (b"FDL1", 0, range(0, 17), "lz4"),
}
_BY_MAGIC = {magic: name for name, (magic, *_rest) in COMPRESSORS.items()}


class CompressionError(FedgeError, ValueError):
    """A compressor is unknown or missing, or a compressed frame is corrupt or too large."""


def _module(name: str) -> ModuleType:
    package = COMPRESSORS[name][3]
    try:
        if name == "zstd":
            import zstandard
            return zstandard
        import lz4.frame
        return lz4.frame
    except ImportError:
        raise CompressionError(f"{name} compression needs the {package} package: pip install {package} "
                               "(it is part of fedge[client])") from None


def check_available(name: str) -> None:
    """Raise CompressionError naming the package to install when ``name`` cannot be used here."""
    if name not in COMPRESSORS:
        raise CompressionError(f"unknown compressor {name!r}; choose one of {', '.join(COMPRESSORS)}")
    _module(name)


def compress(payload: bytes, name: str, level: int | None = None) -> bytes:
    """The framed compressed payload, or ``payload`` itself when compression does not shrink it."""
    check_available(name)
    magic, default, levels, _ = COMPRESSORS[name]
    level = default if level is None else level
    if level not in levels:
        raise CompressionError(f"{name} level must be in {levels.start}..{levels.stop - 1}, got {level}")
    if name == "zstd":
        packed = _module(name).ZstdCompressor(level=level, write_content_size=True).compress(payload)
    else:
        packed = _module(name).compress(payload, compression_level=level, store_size=True)
    framed = magic + packed
    return framed if len(framed) < len(payload) else payload


def decompress(payload: bytes, max_bytes: int) -> bytes:
    """Undo :func:`compress`; a payload without a compression magic is returned as it is.

    Raises CompressionError when the frame is corrupt, truncated, or would expand to
    more than ``max_bytes``.
    """
    name = _BY_MAGIC.get(bytes(payload[:4]))
    if name is None:
        return payload
    module = _module(name)
    body = bytes(payload[4:])
    try:
        if name == "zstd":
            declared = module.frame_content_size(body)
            if declared > max_bytes:
                raise CompressionError(f"compressed message declares {declared} bytes, over the limit of {max_bytes}")
            # With an unknown content size, max_output_size bounds the output; a frame
            # that needs more fails like a truncated one.
            out = module.ZstdDecompressor().decompress(body, max_output_size=max_bytes)
            complete = True
        else:
            decompressor = module.LZ4FrameDecompressor()
            out = decompressor.decompress(body, max_length=max_bytes + 1)
            complete = decompressor.eof
    except CompressionError:
        raise
    except Exception as exc:  # zstandard.ZstdError, RuntimeError from lz4: a corrupt frame
        raise CompressionError(f"{name} frame is corrupt ({exc})") from None
    if len(out) > max_bytes:
        raise CompressionError(f"compressed message expands past the limit of {max_bytes} bytes")
    if not complete:
        raise CompressionError(f"{name} frame is truncated")
    return out
