"""Export a run's model: prepare it, write ONNX, verify it against torch, write its card; optionally int8.

Every export goes the same way, whether from ``fedge-export`` or at the end of a
training run:

1. the model comes from a checkpoint (the global model) or a checkpoint plus a
   device's state directory (a personalized model), see :mod:`export.source`;
2. the methods' export hooks prepare it for ONNX (:mod:`export.hooks`: folding a
   method's constants into the weights, for one) and add their entries to the card;
3. the prepared model is exported to ONNX (:mod:`export.onnx_graph`);
4. ONNX Runtime runs it on real test samples and must match the torch model as it
   was before the hooks (max |difference| <= 1e-4, same argmax on >= 99.9%), which checks
   the export and the hooks at once; otherwise nothing is written;
5. the file and its model card are written atomically, the card with the test
   accuracy ONNX Runtime measured on the test split, set against the run's initial
   model's (:mod:`export.baseline`: a model worse than its start is said to be).

``export_int8`` then quantizes a float32 export and writes it only when its
accuracy passes the guard in :mod:`export.quantize`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from edge_client.data import (DataError, client_split, evaluation_split, load_dataset, parse_attribute_skew,
                               pixel_normalization)
from export import hooks
from export.baseline import against_start
from export.card import class_names, input_normalization, portable_path, provenance, sha256, write_card
from export.errors import ExportError, SourceError
from export.onnx_graph import (EXPORTER, INPUT_NAME, OPSET, OUTPUT_NAME, Parity, ParityLimits, check_parity, predict,
                               session, to_onnx)
from export.quantize import QuantResult, QuantSettings, quantize_int8
from export.source import RunSource, global_model, open_run, personalized_model, run_dir_of_state
from storage.files import write_atomic
from storage.pixels import Normalization, normalization_of

__all__ = ["ExportOptions", "ExportData", "Exported", "load_export_data", "export_model", "export_global",
           "export_personalized", "export_int8", "export_after_run", "int8_path"]

log = logging.getLogger("fedge.export")


@dataclass(frozen=True)
class ExportOptions:
    out: Path | None = None          # the .onnx path; None: EXPORT_DIR/model.onnx
    data: str | None = None          # data spec for the parity check and test accuracy; None: the run's data.eval
    parity_samples: int = 1000       # test samples ONNX Runtime and torch must agree on
    test_samples: int = 0            # test samples for the card's accuracy; 0: the whole test split
    parity: ParityLimits = field(default_factory=ParityLimits)


@dataclass(frozen=True, eq=False)
class ExportData:
    """Samples as the run's clients saw them: the test split, and training images for calibration, normalized
    as the model spec says (``normalization``; None for a spec from before specs carried one: the data set's own)."""

    spec: str
    partition: str
    x_test: np.ndarray
    y_test: np.ndarray
    x_train: np.ndarray
    normalization: Normalization | None = None


@dataclass(frozen=True, eq=False)
class Exported:
    path: Path
    card_path: Path
    card: dict[str, Any]
    model: bytes
    data: ExportData


def load_export_data(source: RunSource, data: str | None = None) -> ExportData:
    """The run's data (or ``data``) as the model's inputs: normalized as its spec says, with the run's
    attribute skew applied when it had one."""
    spec = data or source.data_spec
    if not spec:
        raise SourceError(f"{source.checkpoint.path} has no run directory with a config.toml naming its data; "
                          "pass --data SPEC (the data the run trained on) for the parity check")
    partition = source.partition
    try:
        normalization = normalization_of(source.checkpoint.model_spec)
        dataset = load_dataset(spec, normalization=pixel_normalization(normalization, partition))
        x_test, y_test = evaluation_split(dataset, partition)
        skew = parse_attribute_skew(partition)
        if skew is None:
            x_train = dataset.x_train
        else:   # every domain's look, as its clients trained on it
            seed = int(source.config.get("run", {}).get("seed", 0))
            x_train = np.concatenate([client_split(dataset, partition, i, skew.domains, seed)[0]
                                      for i in range(skew.domains)])
    except DataError as exc:
        raise SourceError(f"cannot load the data {spec!r}: {exc}") from None
    spec_shape = tuple(source.checkpoint.model_spec.get(k) for k in ("in_channels", "image_size"))
    if (x_test.shape[1], x_test.shape[2]) != spec_shape:
        raise SourceError(f"the data {spec!r} has {x_test.shape[1]}-channel {x_test.shape[2]}x{x_test.shape[3]} "
                          f"images, the model takes {spec_shape[0]} channels at {spec_shape[1]}x{spec_shape[1]}; "
                          "pass --data with the data the run trained on")
    return ExportData(spec, partition, x_test, y_test, x_train, normalization)


def _versions() -> dict[str, str]:
    return {"exporter": EXPORTER, "opset": str(OPSET), "torch": torch.__version__, "onnx": onnx.__version__,
            "onnxruntime": ort.__version__}


def export_model(model: nn.Module, source: RunSource, out: Path, data: ExportData, options: ExportOptions,
                 personalized: dict[str, Any] | None = None) -> Exported:
    """Steps 2 to 5 of the module docstring for an assembled torch ``model`` (eval mode)."""
    spec = source.checkpoint.model_spec
    shape = (int(spec["in_channels"]), int(spec["image_size"]), int(spec["image_size"]))
    num_classes = int(spec["num_classes"])
    classes = class_names(data.spec, num_classes)
    normalization = input_normalization(data.spec, data.partition, shape[0], data.normalization)
    prepared, entries = hooks.prepare(model, spec)
    metadata = {"fedge.run_id": source.checkpoint.run_id, "fedge.round": str(source.checkpoint.round),
                "fedge.classes": json.dumps(classes), "fedge.normalization": json.dumps(normalization)}
    blob = to_onnx(prepared, shape, metadata)
    sess = session(blob)
    parity: Parity = check_parity(model, sess, data.x_test[:max(options.parity_samples, 1)], options.parity)
    n_test = options.test_samples or len(data.y_test)
    test_acc = float((predict(sess, data.x_test[:n_test]).argmax(1) == data.y_test[:n_test]).mean())
    write_atomic(out, blob)
    card = {
        "file": out.name, "sha256": sha256(blob), "bytes": len(blob), "precision": "float32",
        "input": {"name": INPUT_NAME, "dtype": "float32", "shape": ["batch", *shape], "normalization": normalization},
        "output": {"name": OUTPUT_NAME, "dtype": "float32", "shape": ["batch", num_classes],
                   "meaning": "class scores; the predicted class is the argmax"},
        "classes": classes,
        **provenance(source),
        "personalized": personalized,
        "test_accuracy": test_acc,
        "test_data": {"spec": data.spec, "partition": data.partition, "samples": n_test,
                      "run_reported_accuracy": source.metrics.get("test_accuracy")},
        "parity": parity.as_dict(),
        "export": _versions(),
    }
    start = against_start(test_acc, source, data.spec)
    if start is not None:
        card["initial_model"] = start
    if start is not None and start["worse"]:
        card["warnings"] = [start["warning"]]
        log.warning("%s: %s", out, start["warning"])
    card = hooks.merged(card, entries)
    card_file = write_card(out, card)
    log.info("exported %s (%d bytes, test accuracy %.4f, parity max diff %.2g)", out, len(blob), test_acc,
             parity.max_abs_diff)
    return Exported(out, card_file, card, blob, data)


def export_global(source_path: Path, *, round: int | None = None,
                  options: ExportOptions = ExportOptions()) -> Exported:
    """The global model of a run (``RUN_DIR`` or a checkpoint file) to ``RUN_DIR/export/model.onnx``."""
    source = open_run(Path(source_path), round)
    model = global_model(source.checkpoint)
    default_dir = (source.run_dir or source.checkpoint.path.parent) / "export"
    out = Path(options.out) if options.out else default_dir / "model.onnx"
    return export_model(model, source, out, load_export_data(source, options.data), options)


def export_personalized(source_path: Path | None, state_dir: Path, *, round: int | None = None,
                        options: ExportOptions = ExportOptions()) -> Exported:
    """One device's model (the run's global part with its own parts) to ``STATE_DIR/export/model.onnx``.

    Which parts come from where is the business of the method that kept some on the device (its export
    hook); the card's ``personalized`` entry names them (:class:`export.records.Personalized`).

    ``source_path`` may be omitted for a spawned client, whose state directory is ``RUN_DIR/clients/ID``.
    """
    state_dir = Path(state_dir)
    if not state_dir.is_dir():
        raise SourceError(f"client state directory {state_dir} does not exist; pass the device's --state-dir")
    if source_path is None:
        source_path = run_dir_of_state(state_dir)
        if source_path is None:
            raise SourceError(f"{state_dir} is not inside a run directory (RUN_DIR/clients/ID); pass the run "
                              "directory or checkpoint too: fedge-export RUN_DIR --client-state DIR")
    source = open_run(Path(source_path), round)
    device = personalized_model(source.checkpoint, state_dir)
    out = Path(options.out) if options.out else state_dir / "export" / "model.onnx"
    personalized = {"client_state": portable_path(state_dir, source.run_dir), "client": state_dir.resolve().name,
                    **device.parts}
    return export_model(device.model, source, out, load_export_data(source, options.data), options, personalized)


def int8_path(float_path: Path) -> Path:
    """``model.onnx`` -> ``model.int8.onnx``."""
    return float_path.with_name(float_path.stem + ".int8.onnx")


def export_int8(exported: Exported, settings: QuantSettings = QuantSettings(), out: Path | None = None) -> Exported:
    """Quantize a float32 export to int8 beside it; QuantizationError (nothing written) when accuracy drops
    by more than ``settings.max_drop`` points."""
    data = exported.data
    n_test = exported.card["test_data"]["samples"]
    result: QuantResult = quantize_int8(exported.model, data.x_train, data.x_test[:n_test], data.y_test[:n_test],
                                        settings, float_accuracy=exported.card["test_accuracy"])
    path = Path(out) if out else int8_path(exported.path)
    write_atomic(path, result.model)
    card = {**exported.card, "file": path.name, "sha256": sha256(result.model), "bytes": len(result.model),
            "precision": "int8", "test_accuracy": result.int8_accuracy,
            "parity": None,   # int8 is not meant to match torch to 1e-4; the accuracy guard stands in for it
            "quantization": {**settings.describe(), "float32_file": exported.path.name,
                             "float32_sha256": exported.card["sha256"], "float32_parity": exported.card["parity"],
                             "max_accuracy_drop_points": settings.max_drop, **result.as_dict()}}
    return Exported(path, write_card(path, card), card, result.model, data)


def export_after_run(run_dir: Path) -> dict[str, Any]:
    """The automatic export at the end of a training run, into ``RUN_DIR/export/``.

    Never raises for a model that cannot be exported: the run's checkpoints are
    what matters, so the reason is logged and returned for ``summary.json``.
    """
    try:
        source = open_run(Path(run_dir))
        reason = hooks.no_global(source.checkpoint.model_spec)
        if reason:
            log.info("no automatic export: %s", reason)
            return {"skipped": reason}
        exported = export_global(Path(run_dir))
    except ExportError as exc:
        log.warning("the automatic ONNX export of %s failed: %s", run_dir, exc)
        return {"error": str(exc)}
    return {"onnx": str(exported.path), "card": str(exported.card_path), "bytes": exported.card["bytes"],
            "test_accuracy": exported.card["test_accuracy"],
            "parity_max_abs_diff": exported.card["parity"]["max_abs_diff"],
            **({"warnings": exported.card["warnings"]} if "warnings" in exported.card else {})}

