"""torch -> ONNX, and the check that ONNX Runtime computes what torch computes.

Exporter and opset are fixed here, in one place (docs/export.md says why): the
TorchScript exporter (``dynamo=False``) at opset 17. It needs only onnx, writes one
self-contained file (IR version 8) that ONNX Runtime 1.13 and later run, which
covers the runtimes shipped for Raspberry Pi OS and JetPack, and it exports the
zoo's models in well under a second. The batch dimension is dynamic.
"""

from __future__ import annotations

import io
import math
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from export.errors import ExportError, ParityError

__all__ = ["OPSET", "EXPORTER", "INPUT_NAME", "OUTPUT_NAME", "ParityLimits", "Parity", "to_onnx", "op_counts",
           "session", "predict", "torch_predict", "check_parity"]

OPSET = 17
EXPORTER = "torchscript"
INPUT_NAME, OUTPUT_NAME = "input", "logits"
# ONNX Runtime's input types -> what predict() feeds them (an app's inputs may be integers: token ids, indices)
_FEED_TYPES = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
               "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8,
               "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_}


def to_onnx(model: nn.Module, sample_shape: tuple[int, ...], metadata: dict[str, str] | None = None,
            dtype: torch.dtype = torch.float32) -> bytes:
    """The serialized ONNX model of ``model`` (eval mode) for inputs ``[batch, *sample_shape]`` of ``dtype``.

    ``metadata`` goes into the file's ``metadata_props``, so a device that has only
    the .onnx file still knows its classes and input normalization.
    """
    model = model.eval()
    example = torch.zeros(2, *sample_shape, dtype=dtype)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        # The TorchScript exporter is chosen on purpose (module docstring); its deprecation notice is known.
        warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export.*")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.onnx.*")
        # GroupNorm's batch-size check is traced as a constant; the graph is still right for every batch
        # (the parity check runs other batch sizes than the one traced).
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        # Likewise the warning on every GRU or LSTM traced at a batch other than 1: it concerns initial states
        # built with the traced batch size, which the parity check's other batch sizes would catch.
        warnings.filterwarnings("ignore", message=".*batch_size other than 1.*", category=UserWarning)
        try:
            torch.onnx.export(model, (example,), buffer, dynamo=False, opset_version=OPSET,
                              input_names=[INPUT_NAME], output_names=[OUTPUT_NAME], do_constant_folding=True,
                              dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}})
        except Exception as exc:   # torch raises many unrelated types from deep inside tracing
            raise ExportError(f"torch could not export {type(model).__name__} to ONNX opset {OPSET}: "
                              f"{type(exc).__name__}: {exc}") from exc
    proto = onnx.load_from_string(buffer.getvalue())
    for key, value in (metadata or {}).items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    try:
        onnx.checker.check_model(proto)
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"the exported graph is not valid ONNX: {exc}") from None
    return proto.SerializeToString()


def op_counts(model: bytes | Path) -> dict[str, int]:
    """How many nodes of each operator type the graph has (used to show a folded constant left nothing behind)."""
    proto = onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(str(model))
    return dict(Counter(node.op_type for node in proto.graph.node))


def session(model: bytes | Path, threads: int = 0, *, spinning: bool = False) -> ort.InferenceSession:
    """An ONNX Runtime CPU session; ``threads`` = 0 uses all cores.

    Without ``spinning`` the worker threads sleep between runs instead of spin-waiting
    (ONNX Runtime's default), which leaves the cores to whatever else runs; a
    device dedicated to inference may prefer the default, which wakes faster.
    """
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    source: Any = model if isinstance(model, bytes) else str(model)
    try:
        return ort.InferenceSession(source, sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as exc:   # onnxruntime's own exception types
        raise ExportError(f"ONNX Runtime cannot load the model: {exc}") from None


def predict(sess: ort.InferenceSession, x: np.ndarray, batch_size: int = 512) -> np.ndarray:
    """Outputs of ``sess`` on ``x`` (samples along the first axis: float32 ``[N, C, H, W]`` for fedge's own
    networks), fed as the model's input type, in batches."""
    name, kind = sess.get_inputs()[0].name, sess.get_inputs()[0].type
    dtype = _FEED_TYPES.get(kind, np.float32)
    outs = [sess.run(None, {name: np.ascontiguousarray(x[i:i + batch_size], dtype=dtype)})[0]
            for i in range(0, len(x), batch_size)]
    return np.concatenate(outs) if outs else np.zeros((0, 0), np.float32)


@torch.no_grad()
def torch_predict(model: nn.Module, x: np.ndarray, batch_size: int = 512) -> np.ndarray:
    model.eval()
    outs = [model(torch.from_numpy(np.ascontiguousarray(x[i:i + batch_size]))).numpy()
            for i in range(0, len(x), batch_size)]
    return np.concatenate(outs) if outs else np.zeros((0, 0), np.float32)


@dataclass(frozen=True)
class ParityLimits:
    """How far ONNX Runtime may be from torch. The difference limit scales with the outputs' size beyond 1:
    float32 rounds relative to magnitude, so a model whose logits reach the thousands (a diverged or
    heavily noised one) differs by 1e-3 from rounding alone, and a fixed limit would call that a bad export."""

    max_abs_diff: float = 1e-4       # per unit of output scale (the largest |output|, at least 1)
    min_agreement: float = 0.999     # share of samples with the same argmax


@dataclass(frozen=True)
class Parity:
    samples: int
    max_abs_diff: float
    argmax_agreement: float
    limits: ParityLimits
    output_scale: float = 1.0        # the largest |torch output|, at least 1

    @property
    def allowed_diff(self) -> float:
        return self.limits.max_abs_diff * self.output_scale

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.allowed_diff and self.argmax_agreement >= self.limits.min_agreement

    def as_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "max_abs_diff": self.max_abs_diff, "argmax_agreement": self.argmax_agreement,
                "limit_max_abs_diff": self.allowed_diff, "limit_argmax_agreement": self.limits.min_agreement,
                "output_scale": self.output_scale}


def check_parity(reference: nn.Module, sess: ort.InferenceSession, x: np.ndarray,
                 limits: ParityLimits = ParityLimits()) -> Parity:
    """Compare ONNX Runtime with the torch ``reference`` on ``x``; ParityError with the numbers if they differ."""
    if len(x) == 0:
        raise ExportError("the parity check needs at least one test sample")
    expected, got = torch_predict(reference, x), predict(sess, x)
    if expected.shape != got.shape:
        raise ParityError(f"ONNX Runtime returned outputs of shape {got.shape}, torch {expected.shape}; "
                          "nothing was written")
    diff = float(np.abs(expected.astype(np.float64) - got).max())
    agreement = float((expected.argmax(1) == got.argmax(1)).mean())
    scale = float(np.abs(expected).max(initial=0.0))
    scale = max(1.0, scale) if math.isfinite(scale) else math.inf
    parity = Parity(len(x), diff if math.isfinite(diff) else math.inf, agreement, limits, scale)
    if not math.isfinite(scale):
        raise ParityError(f"torch's own outputs on {len(x)} test samples are not finite: the model diverged, "
                          "and there is nothing sound to export; export an earlier checkpoint (fedge-export "
                          "--round N) or rerun with a lower train.lr (or less DP noise)")
    if not parity.ok:
        raise ParityError(f"ONNX Runtime differs from torch on {len(x)} test samples: max |difference| "
                          f"{parity.max_abs_diff:.3g} (limit {parity.allowed_diff:.3g}), same prediction on "
                          f"{agreement:.2%} (limit {limits.min_agreement:.1%}); nothing was written. "
                          "Report the model spec: an operator exports incorrectly.")
    return parity
