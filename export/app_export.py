"""Export a run on an app (edge_client.app) to ONNX: the graph from the app's example input, parity with torch
on the app's evaluation data, and a card that says what the served model scores by the app's own metrics.

An app's inputs are whatever its loader makes (not images with a normalization), and its outputs whatever
its model gives (class scores, a value, a sequence), so the card records shapes and dtypes as traced, the
app's identity and ``preprocessing``, and each metric measured on ONNX Runtime's outputs: what a device
serving the file gets, not what torch got.

``export_app_int8`` quantizes such an export with fedge's quantizer (:mod:`export.quantize`), calibrated on
the app's evaluation data (an app declares no training data on the coordinator), and writes it only when
the app's headline metric is at most ``max_headline_drop`` worse than float32's (:class:`HeadlineDrop`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge_client.app import App, Samples, app_options, check_samples, example_input, load_app, spec_app
from export.card import provenance, sha256, write_card
from export.errors import SourceError
from export.onnx_graph import INPUT_NAME, OUTPUT_NAME, check_parity, predict, session, to_onnx
from export.pipeline import int8_path
from export.quantize import HeadlineDrop, QuantSettings, calibration_set, quantize_static_int8
from export.source import RunSource, global_model, open_run
from storage.files import write_atomic

__all__ = ["AppExported", "export_app", "export_app_float32", "export_app_int8", "run_app_of"]

log = logging.getLogger("fedge.export")
progress = logging.getLogger("fedge.export.progress")   # the step running, shown by fedge-export


@dataclass(frozen=True, eq=False)
class AppExported:
    """A written export of an app's model: the file, its card, its bytes, and what int8 needs to score it."""

    path: Path
    card: dict[str, Any]
    model: bytes
    app: App
    samples: Samples                 # the app's evaluation data the card's figures were measured on


def run_app_of(source: RunSource) -> App | None:
    """The app a run trained (its config's ``app.module`` loaded first, so an app given by import path is found
    by its name), checked against the checkpoint's spec; None for fedge's own networks."""
    module = source.config.get("app", {}).get("module", "")
    if module not in ("", "vision"):
        load_app(module)
    return spec_app(source.checkpoint.model_spec)


def _scores(app: App, served: np.ndarray, samples: Samples) -> dict[str, float]:
    """Each of the app's metrics (``test_NAME``) on ONNX Runtime's outputs ``served`` over ``samples``."""
    outputs = torch.from_numpy(served)
    return {f"test_{name}": float(metric.fn(outputs, samples.y)) for name, metric in app.metrics.items()}


def export_app_float32(source_path: Path, *, round: int | None = None, out: Path | None = None,
                       data: str | None = None, parity_samples: int = 1000) -> AppExported:
    """The global model of a run on an app to ``RUN_DIR/export/model.onnx`` (or ``out``) with its card."""
    source = open_run(Path(source_path), round)
    app = run_app_of(source)
    if app is None:
        raise SourceError(f"{source.checkpoint.path} was not trained on an app; use fedge-export")
    spec = source.checkpoint.model_spec
    location = data or source.data_spec
    if not location:
        raise SourceError("the run directory names no evaluation data; pass the app's data location")
    model = global_model(source.checkpoint).eval()
    example = example_input(app, app_options(spec))
    blob = to_onnx(model, example.shape, {"fedge.run_id": source.checkpoint.run_id,
                                          "fedge.round": str(source.checkpoint.round),
                                          "fedge.app": json.dumps(spec["app"]),
                                          "fedge.preprocessing": json.dumps(dict(app.preprocessing))}, example.dtype)
    sess = session(blob)
    samples = check_samples(app.eval_data(location), app, "eval_data")
    x = samples.x.numpy()
    parity = check_parity(model, sess, x[:max(parity_samples, 1)])
    served = predict(sess, x)
    scores = _scores(app, served, samples)
    out = out or (source.run_dir or source.checkpoint.path.parent) / "export" / "model.onnx"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, blob)
    card = {
        "file": out.name, "sha256": sha256(blob), "bytes": len(blob), "precision": "float32",
        "app": spec["app"], "preprocessing": dict(app.preprocessing),
        "input": {"name": INPUT_NAME, "dtype": str(example.dtype).removeprefix("torch."),
                  "shape": ["batch", *example.shape]},
        "output": {"name": OUTPUT_NAME, "dtype": "float32", "shape": ["batch", *served.shape[1:]]},
        **provenance(source),
        "headline": app.headline,
        **scores,
        "test_data": {"location": location, "samples": len(samples),
                      "run_reported": {k: source.metrics.get(k) for k in scores}},
        "parity": parity.as_dict(),
    }
    write_card(out, card)
    log.info("exported %s (%d bytes, test %s %.4f)", out, len(blob), app.headline, scores[f"test_{app.headline}"])
    return AppExported(out, card, blob, app, samples)


def export_app(source_path: Path, *, round: int | None = None, out: Path | None = None, data: str | None = None,
               parity_samples: int = 1000) -> dict[str, Any]:
    """:func:`export_app_float32`'s card, with ``onnx``: the file's path."""
    exported = export_app_float32(source_path, round=round, out=out, data=data, parity_samples=parity_samples)
    return exported.card | {"onnx": str(exported.path)}


def export_app_int8(exported: AppExported, settings: QuantSettings = QuantSettings(),
                    out: Path | None = None) -> AppExported:
    """Quantize an app's float32 export to int8 beside it (``model.int8.onnx``), calibrated on the app's
    evaluation data; QuantizationError, nothing written, when its headline metric is more than
    ``settings.max_headline_drop`` worse than float32's (the message names the metric and both values)."""
    app, samples = exported.app, exported.samples
    calibration = calibration_set(samples.x.numpy(), settings)
    int8 = quantize_static_int8(exported.model, calibration, settings, samples="samples of the app's evaluation data")
    progress.info("int8: checking its test %s on %d samples", app.headline, len(samples))
    scores = _scores(app, predict(session(int8), samples.x.numpy()), samples)
    name = app.headline
    drop = HeadlineDrop(name, app.metrics[name].higher_is_better, exported.card[f"test_{name}"],
                        scores[f"test_{name}"], settings.max_headline_drop)
    log.info("int8: %s %.4f -> %.4f, %d -> %d bytes", name, drop.float_value, drop.int8_value, len(exported.model),
             len(int8))
    drop.check()
    path = Path(out) if out else int8_path(exported.path)
    write_atomic(path, int8)
    card = {**exported.card, "file": path.name, "sha256": sha256(int8), "bytes": len(int8), "precision": "int8",
            **scores,
            "parity": None,   # int8 is not meant to match torch to 1e-4; the headline guard stands in for it
            "quantization": {**settings.describe(), "float32_file": exported.path.name,
                             "float32_sha256": exported.card["sha256"], "float32_parity": exported.card["parity"],
                             **drop.as_dict(), "float32_bytes": len(exported.model), "int8_bytes": len(int8),
                             "size_ratio": len(int8) / len(exported.model),
                             "calibration_data": "the app's evaluation data",
                             "calibration_samples": len(calibration), "test_samples": len(samples)}}
    write_card(path, card)
    return AppExported(path, card, int8, app, samples)
