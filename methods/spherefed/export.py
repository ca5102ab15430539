"""SphereFed's export hook: the card says which head the model ends in, and a device's personalized model.

With ``ffc.personalize`` each device keeps the classifier it solved from its own FFC statistics
(``STATE_DIR/sphere_classifier.safetensors``, :func:`methods.spherefed.device.save_personal_classifier`).
Its personalized model is the run's global model (extractor and calibrated classifier) with the
sphere head's classifier replaced by that one. The file is checked before it is used: readable,
only ``classifier.weight``, the model's shape, a finite float tensor, solved in the checkpoint's round.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from export.errors import SourceError
from export.hooks import ExportHook
from export.records import Checkpoint, Personalized
from export.source import global_model
from methods.spherefed.device import PERSONAL_CLASSIFIER_FILE, PERSONAL_METADATA, sphere_head
from methods.spherefed.model import CLASSIFIER

__all__ = ["HOOK", "personalized"]


def _prepare(model: nn.Module, spec: Mapping[str, Any]) -> tuple[nn.Module, dict[str, Any]]:
    """The model as it is (the sphere head exports as ONNX operators); the card's output names its head."""
    return model, {"output": {"head": spec.get("head", "linear")}}


def _read(path: Path) -> tuple[torch.Tensor, dict[str, Any]]:
    """The device's classifier and what its file says about it; SourceError says what to do when it is not one."""
    if not path.is_file():
        raise SourceError(f"{path} does not exist: a SphereFed device keeps its own classifier there only when "
                          "the run calibrates with ffc.personalize = true (devices then solve and keep their own "
                          "classifier); check that --client-state is the device's state directory (its "
                          "--state-dir; for a spawned client RUN_DIR/clients/ID), or export the global model "
                          "without --client-state")
    try:
        with safe_open(str(path), framework="pt") as fh:
            names = list(fh.keys())
            info = json.loads((fh.metadata() or {}).get(PERSONAL_METADATA, "{}"))
            weight = fh.get_tensor(CLASSIFIER) if CLASSIFIER in names else None
        if not isinstance(info, dict):
            raise ValueError(f"its {PERSONAL_METADATA} metadata is not a JSON object")
    except (SafetensorError, OSError, ValueError) as exc:
        raise SourceError(f"{path} is not a readable safetensors file ({exc}); the device rewrites it at the "
                          "run's next FFC with ffc.personalize = true (delete it if it is damaged)") from None
    if weight is None or names != [CLASSIFIER]:
        raise SourceError(f"{path} holds {names}, not the one tensor {CLASSIFIER!r} of a device's sphere "
                          "classifier; it was not written by fedge's ffc_stats (ffc.personalize = true)")
    return weight, info


def _check(path: Path, weight: torch.Tensor, info: Mapping[str, Any], expected: tuple[int, ...],
           checkpoint: Checkpoint) -> None:
    """The classifier fits the checkpoint's model and round."""
    if tuple(weight.shape) != expected:
        raise SourceError(f"{path}: {CLASSIFIER} has shape {tuple(weight.shape)}, the model of run "
                          f"{checkpoint.run_id} expects C x d = {expected}; the device solved it for another "
                          "model spec (another run?): pass the state directory of a device of this run")
    if not weight.is_floating_point():
        raise SourceError(f"{path}: {CLASSIFIER} is {weight.dtype}, not a float tensor; it was not written by "
                          "fedge's ffc_stats, rerun the FFC with ffc.personalize = true")
    if not bool(torch.isfinite(weight).all()):
        raise SourceError(f"{path}: {CLASSIFIER} holds NaN or infinity; the device's features diverged, "
                          "export the global model (without --client-state) or an earlier round")
    solved = info.get("round")
    if solved is not None and solved != checkpoint.round:
        raise SourceError(f"{path} was solved in round {solved} on that round's extractor, but the checkpoint is "
                          f"of round {checkpoint.round}; export with --round {solved} (if the run kept that "
                          "checkpoint), or let this device take part in the run's last FFC")


def personalized(checkpoint: Checkpoint, state_dir: Path) -> Personalized | None:
    """The global model with the classifier the device solved from its own FFC statistics; None for a model
    without the sphere head."""
    if checkpoint.model_spec.get("head") != "sphere":
        return None
    path = Path(state_dir) / PERSONAL_CLASSIFIER_FILE
    weight, info = _read(path)
    model = global_model(checkpoint)
    head = sphere_head(model)
    _check(path, weight, info, tuple(head.weight.shape), checkpoint)
    with torch.no_grad():
        head.weight.copy_(weight.to(head.weight.dtype))
    parts = {"global_parts": ["extractor"], "device_parts": ["classifier"], "device_file": path.name,
             "device_classifier": {k: info[k] for k in ("round", "ridge", "samples") if k in info}}
    return Personalized(model, parts)


HOOK = ExportHook(prepare=_prepare, personalized=personalized)
