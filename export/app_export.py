"""Export a run on an app (edge_client.app) to ONNX: the graph from the app's example input, parity with torch
on the app's evaluation data, and a card that says what the served model scores by the app's own metrics.

An app's inputs are whatever its loader makes (not images with a normalization), and its outputs whatever
its model gives (class scores, a value, a sequence), so the card records shapes and dtypes as traced, the
app's identity and ``preprocessing``, and each metric measured on ONNX Runtime's outputs: what a device
serving the file gets, not what torch got.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from edge_client.app import App, app_options, check_samples, example_input, load_app, spec_app
from export.card import provenance, sha256, write_card
from export.errors import SourceError
from export.onnx_graph import INPUT_NAME, OUTPUT_NAME, check_parity, predict, session, to_onnx
from export.source import RunSource, global_model, open_run
from storage.files import write_atomic

__all__ = ["export_app", "run_app_of"]

log = logging.getLogger("fedge.export")


def run_app_of(source: RunSource) -> App | None:
    """The app a run trained (its config's ``app.module`` loaded first, so an app given by import path is found
    by its name), checked against the checkpoint's spec; None for fedge's own networks."""
    module = source.config.get("app", {}).get("module", "")
    if module not in ("", "vision"):
        load_app(module)
    return spec_app(source.checkpoint.model_spec)


def export_app(source_path: Path, *, round: int | None = None, out: Path | None = None, data: str | None = None,
               parity_samples: int = 1000) -> dict[str, Any]:
    """The global model of a run on an app to ``RUN_DIR/export/model.onnx`` (or ``out``) with its card; the card."""
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
                                          "fedge.preprocessing": json.dumps(dict(app.preprocessing))})
    sess = session(blob)
    samples = check_samples(app.eval_data(location), app, "eval_data")
    x = samples.x.numpy()
    parity = check_parity(model, sess, x[:max(parity_samples, 1)])
    served = torch.from_numpy(predict(sess, x))
    scores = {f"test_{name}": float(metric.fn(served, samples.y)) for name, metric in app.metrics.items()}
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
    return card | {"onnx": str(out)}
