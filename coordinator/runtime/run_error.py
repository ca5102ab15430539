"""The error that ends a run, apart from the engine so that each of its parts can raise it."""

from __future__ import annotations

from storage.errors import FedgeError

__all__ = ["RunError"]


class RunError(FedgeError, RuntimeError):
    """The run cannot go on (too few clients, repeated failed rounds)."""
