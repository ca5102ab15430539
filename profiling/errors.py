"""The error type of ``fedge-profile``: a message that says what to pass or install instead."""

from __future__ import annotations

from storage.errors import FedgeError

__all__ = ["ProfileError"]


class ProfileError(FedgeError, ValueError):
    """Input the profiling tools cannot use; ``str(err)`` tells the user what to change."""
