"""The configuration error, apart from the config module so strategies can raise it without importing it."""

from __future__ import annotations

from storage.errors import FedgeError

__all__ = ["ConfigError"]


class ConfigError(FedgeError, ValueError):
    """A configuration key or value is invalid; the message says which and why."""
