"""The transport's errors, below every transport module so each can raise them.

Each message says what to check; :class:`TlsError` and :class:`BrokerUrlError` are
configuration errors that no retry can fix, which is why callers tell them apart.
"""

from __future__ import annotations

from storage.errors import FedgeError

__all__ = ["TransportError", "MessageTooLarge", "TlsError", "BrokerUrlError"]


class TransportError(FedgeError, RuntimeError):
    """The broker could not be reached or refused us; the message says what to check."""


class MessageTooLarge(TransportError):
    """A message over our size limit (with chunking off) or over the broker's maximum packet size."""


class TlsError(TransportError):
    """TLS cannot work as configured (missing file, unknown CA, wrong host name, a TLS port given as
    mqtt:// or a plain one as mqtts://): no retry can fix it."""


class BrokerUrlError(TransportError, ValueError):
    """A broker URL fedge cannot use; no retry can fix it."""
