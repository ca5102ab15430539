"""The root of fedge's own errors.

Every error fedge raises on purpose (a bad configuration, a damaged file, a broker that
refuses, a message that does not decode) derives from :class:`FedgeError` as well as from
the built-in class it always had (``ValueError`` for bad input, ``RuntimeError`` for a
failed operation), and its message says what is wrong and how to fix it. So a command
catches one class and prints one line, and a caller that caught ``ValueError`` still does.
"""

from __future__ import annotations

__all__ = ["FedgeError"]


class FedgeError(Exception):
    """An error of fedge's own, whose message is meant for the person running the command."""
