"""The export package's one error type and its kinds; each message says how to fix the problem."""

from __future__ import annotations

from storage.errors import FedgeError

__all__ = ["ExportError", "SourceError", "ParityError", "QuantizationError"]


class ExportError(FedgeError, RuntimeError):
    """An export cannot be done as asked."""


class SourceError(ExportError):
    """A run directory, checkpoint or client state is missing, unreadable or does not fit the model."""


class ParityError(ExportError):
    """ONNX Runtime does not reproduce torch's outputs closely enough; nothing was written."""


class QuantizationError(ExportError):
    """The int8 model lost more accuracy than allowed, or quantization failed; nothing was written."""
