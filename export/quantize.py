"""Static int8 quantization (QDQ) with ONNX Runtime's tools, behind an accuracy guard.

Static rather than dynamic: the activation ranges are measured once, on
calibration samples from the training data, so the device never computes them at
run time, and convolutions are quantized too (dynamic quantization covers only
MatMul/Gemm-like operators). QDQ format (QuantizeLinear/DequantizeLinear pairs
around int8 operators) is the one ONNX Runtime recommends for CPUs, including ARM;
weights are int8 per output channel, activations int8 per tensor, ranges by
MinMax. The int8 model is only written when its test accuracy is at most
``max_drop`` points below the float32 model's; an app's (:mod:`export.app_export`)
when its headline metric is at most ``max_headline_drop`` (a fraction of float32's
value) worse, in the metric's direction (:class:`HeadlineDrop`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from export.errors import QuantizationError
from export.onnx_graph import INPUT_NAME, predict, session

__all__ = ["QuantSettings", "QuantResult", "HeadlineDrop", "quantize_int8", "quantize_static_int8", "calibration_set",
           "accuracy"]

log = logging.getLogger("fedge.export")
progress = logging.getLogger("fedge.export.progress")   # the step running, shown by fedge-export


@dataclass(frozen=True)
class QuantSettings:
    calibration_samples: int = 512
    calibration_batch: int = 32
    max_drop: float = 1.0            # accuracy points (percentage points) the int8 model may lose
    max_headline_drop: float = 0.01  # an app's: how much worse its headline may be, as a fraction of float32's
    per_channel: bool = True
    seed: int = 0                    # which training samples calibrate

    def describe(self) -> dict[str, str]:
        """What the card says of the quantization's form."""
        return {"format": "QDQ", "weights": "int8 per channel" if self.per_channel else "int8 per tensor",
                "activations": "int8 per tensor (MinMax calibration)"}


@dataclass(frozen=True)
class QuantResult:
    """The int8 model (serialized) and how it compares with the float32 one on the test split."""

    model: bytes
    float_accuracy: float
    int8_accuracy: float
    float_bytes: int
    int8_bytes: int
    calibration_samples: int
    test_samples: int

    @property
    def drop_points(self) -> float:
        return 100.0 * (self.float_accuracy - self.int8_accuracy)

    def as_dict(self) -> dict[str, Any]:
        return {"float32_accuracy": self.float_accuracy, "int8_accuracy": self.int8_accuracy,
                "accuracy_drop_points": self.drop_points, "float32_bytes": self.float_bytes,
                "int8_bytes": self.int8_bytes, "size_ratio": self.int8_bytes / self.float_bytes,
                "calibration_samples": self.calibration_samples, "test_samples": self.test_samples}


@dataclass(frozen=True)
class HeadlineDrop:
    """An app's int8 model against its float32 one by the app's headline metric, in the metric's direction.

    ``worse_by`` is how much worse int8 is as a fraction of float32's value (its magnitude): 0.01 is 1% worse
    whether the metric is an R² that should rise or an MAE that should fall; negative when int8 is better.
    A relative limit suits metrics of any scale (an MAE in the targets' units, a share in [0, 1])."""

    metric: str
    higher_is_better: bool
    float_value: float
    int8_value: float
    limit: float                     # the largest ``worse_by`` allowed (QuantSettings.max_headline_drop)

    @property
    def worse_by(self) -> float:
        loss = self.float_value - self.int8_value if self.higher_is_better else self.int8_value - self.float_value
        if self.float_value == 0:
            return math.inf if loss > 0 else 0.0
        return loss / abs(self.float_value)

    def check(self) -> None:
        """QuantizationError naming the metric and both values when int8 is worse than the limit allows."""
        if self.worse_by > self.limit:
            direction = "higher" if self.higher_is_better else "lower"
            raise QuantizationError(
                f"the int8 model's test {self.metric} is {self.int8_value:.4f} against {self.float_value:.4f} in "
                f"float32 ({100 * self.worse_by:.2f}% worse, {direction} is better; limit {100 * self.limit:g}%); "
                "not written. Calibrate on more samples (--calibration-samples) or allow more (--max-headline-drop)")

    def as_dict(self) -> dict[str, Any]:
        return {"headline": self.metric, "higher_is_better": self.higher_is_better,
                f"float32_{self.metric}": self.float_value, f"int8_{self.metric}": self.int8_value,
                "headline_worse_by": self.worse_by, "max_headline_drop": self.limit}


def accuracy(model: bytes, x: np.ndarray, y: np.ndarray) -> float:
    """Share of ``x`` that the ONNX model classifies as ``y``."""
    return float((predict(session(model), x).argmax(1) == y).mean()) if len(y) else 0.0


class _Batches:
    """ONNX Runtime's CalibrationDataReader protocol: ``get_next()`` returns a feed or None."""

    def __init__(self, x: np.ndarray, batch: int) -> None:
        self._batches: Iterator[np.ndarray] = (x[i:i + batch] for i in range(0, len(x), batch))
        self._done = False

    def get_next(self) -> dict[str, np.ndarray] | None:
        chunk = next(self._batches, None)
        if chunk is None:
            if not self._done:   # the quantizer asks once more when it has every range it needs
                progress.info("int8: quantizing weights and activations")
            self._done = True
            return None
        floating = np.issubdtype(chunk.dtype, np.floating)   # an app's integer inputs stay integers
        return {INPUT_NAME: np.ascontiguousarray(chunk, dtype=np.float32 if floating else chunk.dtype)}


def _ort_quantization() -> Any:
    """``onnxruntime.quantization``, imported without its side effect: on import it calls
    ``logging.basicConfig(level=INFO)``, which would make every INFO record of the process print."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    import onnxruntime.quantization
    import onnxruntime.quantization.shape_inference  # noqa: F401  (quant_pre_process lives there)

    root.handlers[:] = handlers
    root.setLevel(level)
    return onnxruntime.quantization


class _DropQuantizerNotes(logging.Filter):
    """ONNX Runtime's quantizer warns on the root logger when a per-channel axis does not apply to a
    1-D constant (GroupNorm's scale); it then quantizes that constant per tensor, which is what we want."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not ("onnxruntime" in record.pathname and "quantization" in record.pathname
                    and record.levelno < logging.ERROR)


@contextlib.contextmanager
def _quiet_quantizer() -> Iterator[None]:
    root, note_filter = logging.getLogger(), _DropQuantizerNotes()
    root.addFilter(note_filter)
    try:
        yield
    finally:
        root.removeFilter(note_filter)


def calibration_set(x_train: np.ndarray, settings: QuantSettings) -> np.ndarray:
    """``settings.calibration_samples`` of ``x_train`` (all of them when it has fewer), drawn with its seed."""
    if settings.calibration_samples < 1:
        raise QuantizationError("--calibration-samples must be at least 1")
    n = min(settings.calibration_samples, len(x_train))
    return x_train[np.random.default_rng(settings.seed).choice(len(x_train), n, replace=False)]


def _used_opsets_only(model: bytes) -> bytes:
    """Drop the opset imports the quantizer's preprocessing declares but no node uses (ONNX Runtime's
    own domains among them), so a device's older runtime is not asked for versions it does not know."""
    import onnx

    proto = onnx.load_from_string(model)
    used = {node.domain for node in proto.graph.node}
    kept = [entry for entry in proto.opset_import if entry.domain in used or entry.domain in ("", "ai.onnx")]
    del proto.opset_import[:]
    proto.opset_import.extend(kept)
    onnx.checker.check_model(proto)
    return proto.SerializeToString()


def quantize_static_int8(float_model: bytes, calibration: np.ndarray, settings: QuantSettings = QuantSettings(), *,
                         samples: str = "training samples") -> bytes:
    """The int8 (QDQ) model of ``float_model``, its activation ranges measured on ``calibration`` (``samples``
    says what they are, in the progress line); no guard: the callers score it (:func:`quantize_int8` by
    accuracy, an app's export by its headline metric)."""
    q = _ort_quantization()
    CalibrationMethod, QuantFormat, QuantType = q.CalibrationMethod, q.QuantFormat, q.QuantType
    quantize_static, quant_pre_process = q.quantize_static, q.shape_inference.quant_pre_process
    with tempfile.TemporaryDirectory(prefix="fedge-int8-") as tmp:
        src, prepared, out = Path(tmp) / "float.onnx", Path(tmp) / "prepared.onnx", Path(tmp) / "int8.onnx"
        src.write_bytes(float_model)
        try:
            progress.info("int8: preparing the graph")
            # Symbolic shape inference fails on the Expand that F.normalize exports (an L2-normalizing head);
            # ONNX's own shape inference and the graph optimization still run.
            quant_pre_process(str(src), str(prepared), skip_symbolic_shape=True)
            progress.info("int8: calibrating activation ranges on %d %s", len(calibration), samples)
            with _quiet_quantizer():
                quantize_static(str(prepared), str(out), _Batches(calibration, settings.calibration_batch),
                                quant_format=QuantFormat.QDQ, activation_type=QuantType.QInt8,
                                weight_type=QuantType.QInt8, per_channel=settings.per_channel,
                                calibrate_method=CalibrationMethod.MinMax)
        except Exception as exc:   # onnxruntime.quantization raises plain Exceptions of many kinds
            raise QuantizationError(f"ONNX Runtime could not quantize the model: {type(exc).__name__}: {exc}; "
                                    "the float32 model is unaffected") from exc
        return _used_opsets_only(out.read_bytes())


def quantize_int8(float_model: bytes, x_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray,
                  settings: QuantSettings = QuantSettings(), *,
                  float_accuracy: float | None = None) -> QuantResult:
    """Quantize ``float_model``; QuantizationError (with both accuracies) when it loses too much."""
    calibration = calibration_set(x_train, settings)
    int8_model = quantize_static_int8(float_model, calibration, settings)
    progress.info("int8: checking its test accuracy on %d samples", len(y_test))
    base = accuracy(float_model, x_test, y_test) if float_accuracy is None else float_accuracy
    result = QuantResult(int8_model, base, accuracy(int8_model, x_test, y_test), len(float_model), len(int8_model),
                         len(calibration), len(y_test))
    log.info("int8: accuracy %.4f -> %.4f, %d -> %d bytes", result.float_accuracy, result.int8_accuracy,
             result.float_bytes, result.int8_bytes)
    if result.drop_points > settings.max_drop:
        raise QuantizationError(f"the int8 model's test accuracy is {result.int8_accuracy:.2%} against "
                                f"{result.float_accuracy:.2%} in float32 ({result.drop_points:.2f} points lower, "
                                f"limit {settings.max_drop:g}); not written. Calibrate on more samples "
                                "(--calibration-samples) or allow more (--max-accuracy-drop)")
    return result
