"""DFL's export hook: a DFL run has no global model, only devices' personalized ones.

A device's model is the run's global invariant extractor (from the checkpoint) with that
device's specific extractor and predictor (``STATE_DIR/dfl_state.safetensors``), both checked
for names, shapes and finite values against the model spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edge_client.models import federated_names
from export.hooks import ExportHook
from export.records import Checkpoint, Personalized
from export.source import build, load_tensors, read_state_file
from methods.dfl.device import STATE_FILE, DeviceState
from methods.dfl.model import INVARIANT, PREDICTOR, SPECIFIC, part_names

__all__ = ["HOOK", "personalized"]


def _no_global(spec: Mapping[str, Any]) -> str | None:
    if spec.get("name") != "dfl":
        return None
    return ("DFL has no global model: the coordinator holds only the invariant extractor and each predictor stays "
            "on its device; export a device's model with fedge-export RUN_DIR --client-state STATE_DIR")


def personalized(checkpoint: Checkpoint, state_dir: Path) -> Personalized | None:
    """The global invariant extractor with the device's own branches; None for a run that is not DFL's."""
    spec = checkpoint.model_spec
    if spec.get("name") != "dfl":
        return None
    model = build(spec)
    invariant = {k: checkpoint.params[k] for k in part_names(checkpoint.params, INVARIANT)}
    load_tensors(model, invariant, part_names(federated_names(model), INVARIANT),
                 origin=f"checkpoint {checkpoint.path}")
    path = Path(state_dir) / STATE_FILE
    load_tensors(model, read_state_file(path), DeviceState.tensors(model), origin=str(path))  # type: ignore[arg-type]
    return Personalized(model.eval(), {"global_parts": [INVARIANT], "device_parts": [SPECIFIC, PREDICTOR],
                                       "device_file": path.name})


HOOK = ExportHook(personalized=personalized, no_global=_no_global)
