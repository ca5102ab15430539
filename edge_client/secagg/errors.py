"""The errors of secure aggregation, one root under fedge's own.

Whatever comes from another party (a key, a share, a ciphertext, a masked vector) is
checked before use; a bad one is a :class:`MessageError` (a ``ProtocolError``, so the
transport logs it as it logs any refused message) naming the field and what it must be.
A client that will not answer a request is :class:`RefusedError`; a server that cannot
finish a round is :class:`RoundFailedError`. Neither releases anything partial.
"""

from __future__ import annotations

from edge_client.wire.errors import ProtocolError
from storage.errors import FedgeError

__all__ = ["SecAggError", "ParamsError", "MessageError", "ShareError", "DecryptionError", "RefusedError",
           "RoundFailedError"]


class SecAggError(FedgeError, RuntimeError):
    """Any error of secure aggregation."""


class ParamsError(SecAggError, ValueError):
    """Round parameters that cannot give a correct or private sum (the message says which bound failed)."""


class MessageError(ProtocolError, SecAggError):
    """Data from another party that fails a check: wrong round, unknown client, bad size or range."""


class ShareError(MessageError):
    """Shamir shares that cannot be combined: too few, duplicate or out-of-field points, or inconsistent ones."""


class DecryptionError(MessageError):
    """A ciphertext that does not authenticate: tampered, or sent for another sender, receiver or round."""


class RefusedError(SecAggError):
    """A client refuses a request that would reveal an input or could not lead to a private sum."""


class RoundFailedError(SecAggError):
    """The server cannot compute the sum (too few shares came back); nothing about any input is released."""
