"""The wire stack's error type, below every wire module so each can raise it.

Everything the wire refuses (an envelope, a body field, a codec spec, a tensor
layout) is a :class:`ProtocolError`; ``str(err)`` is the reason that gets logged
or sent back. :mod:`edge_client.wire.protocol` re-exports it.
"""

from __future__ import annotations

from storage.errors import FedgeError

__all__ = ["ProtocolError"]


class ProtocolError(FedgeError, ValueError):
    """A message that cannot be accepted; ``str(err)`` is the logged reason."""
