"""An app's network as every party builds it: its starting weights loaded, and with ``trainable``, the rest frozen.

Federated fine-tuning adapts a pretrained network to each site's data while only a small part of it
learns. The frozen part never travels: every party loads it from the app's own weights file (pinned by
its sha256 in the app's identity), and :func:`edge_client.models.federated_names` then lists only the
trainable part, so the coordinator's model, each task's broadcast and upload, the codecs, clipping and
secure aggregation all see that part alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn

from edge_client.app import App, AppError, trainable_names, weights_path
from edge_client.models import federated_names, limit_exchange

__all__ = ["prepare_app_model"]


def prepare_app_model(app: App, model: nn.Module) -> nn.Module:
    """``model`` (just built by the app's factory) with the app's weights loaded and its frozen part frozen."""
    if not isinstance(model, nn.Module):
        raise AppError(f"app {app.name!r}: model(options) must return a torch.nn.Module, got {type(model).__name__}")
    loaded = _load_weights(app, model)
    if not app.trainable:
        return model
    every = federated_names(model)
    kept = set(trainable_names(app, every))
    frozen = [name for name in every if name not in kept]
    missing = [name for name in frozen if name not in loaded]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise AppError(f"app {app.name!r}: frozen tensors ({', '.join(missing[:3])}{more}) are not in its weights "
                       "file, so parties would hold different values for them; put them in App.weights or make them "
                       "trainable")
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in kept)
    _keep_frozen_statistics(model, kept)
    return limit_exchange(model, kept)


def _load_weights(app: App, model: nn.Module) -> set[str]:
    """Load the app's weights file into ``model``; the names it gave. Every tensor in the file must fit."""
    path = weights_path(app)
    if path is None:
        return set()
    if any(t.is_meta for t in model.state_dict().values()):   # built only to be counted: no values to hold
        return set(_names_in(path))
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise AppError(f"app {app.name!r}: its weights file {path} is not a readable safetensors file ({exc})") from exc
    state = model.state_dict()
    unknown = sorted(set(tensors) - set(state))
    if unknown:
        raise AppError(f"app {app.name!r}: its weights file {path.name} has tensors the model does not ({unknown[:3]});"
                       " it was saved from another network")
    for name, tensor in tensors.items():
        want = state[name]
        if tensor.shape != want.shape or tensor.dtype != want.dtype:
            raise AppError(f"app {app.name!r}: {name} in {path.name} is {tuple(tensor.shape)} {tensor.dtype}, the "
                           f"model's is {tuple(want.shape)} {want.dtype}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise AppError(f"app {app.name!r}: {name} in {path.name} is not finite (NaN or infinite)")
    model.load_state_dict(tensors, strict=False)
    return set(tensors)


def _names_in(path: Path) -> list[str]:
    """The tensor names in a safetensors file, read from its header alone."""
    with safe_open(str(path), "pt") as fh:
        return list(fh.keys())


def _keep_frozen_statistics(model: nn.Module, trainable: set[str]) -> None:
    """Frozen normalization layers keep their running statistics in training, too: those are not exchanged,
    so a device updating them would drift from what every other party evaluates with."""
    for prefix, module in model.named_modules():
        if not getattr(module, "track_running_stats", False):
            continue
        own = [f"{prefix}.{name}" if prefix else name
               for name, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]]
        if not any(name in trainable for name in own):
            module.register_forward_pre_hook(_in_eval_mode)


def _in_eval_mode(module: nn.Module, _inputs: Any) -> None:
    module.train(False)
