"""Where an exported model comes from: a run's checkpoint, optionally with one device's private state.

Checkpoints (``RUN_DIR/checkpoints/``) are found and read by the reader the coordinator
resumes with, :mod:`storage.checkpoint`, the one place that knows their names and
layout: the server state (round, global parameters, model spec, extra) and the info
the coordinator saved with it (run id, strategy). Nothing is unpickled; every tensor
is checked against the model the spec builds (name, shape, finiteness) before it is
loaded.

A device's personalized model combines the run's global part with what never left
the device; the method that kept parts there assembles it (its export hook,
:mod:`export.hooks`) with the readers and checks here.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from torch import nn

from edge_client.models import ModelSpecError, federated_names
from edge_client.registry import build_aside
from export import hooks
from export.errors import SourceError
from export.records import Checkpoint, Personalized
from storage.checkpoint import CheckpointError, checkpoint_rounds, load_checkpoint
from storage.files import read_jsonl

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["Checkpoint", "RunSource", "Personalized", "open_run", "find_checkpoint", "read_checkpoint", "build",
           "global_model", "personalized_model", "load_tensors", "read_state_file", "run_dir_of_state"]


@dataclass(frozen=True)
class RunSource:
    """A checkpoint plus what its run directory says about it (config, metrics), when there is one."""

    checkpoint: Checkpoint
    run_dir: Path | None
    config: dict[str, Any] = field(default_factory=dict)    # RUN_DIR/config.toml, {} without it
    metrics: dict[str, Any] = field(default_factory=dict)   # the checkpoint round's metrics.jsonl row
    initial: dict[str, Any] = field(default_factory=dict)   # round 0's row: the evaluation of the starting model

    @property
    def data_spec(self) -> str | None:
        return self.config.get("data", {}).get("eval")

    @property
    def partition(self) -> str:
        return self.config.get("data", {}).get("partition", "iid")


def find_checkpoint(source: Path, round: int | None = None) -> tuple[Path, Path | None]:
    """(checkpoint file, run directory or None) for a run directory or a checkpoint file."""
    source = Path(source)
    if source.is_file():
        if round is not None:
            raise SourceError(f"{source} is one checkpoint file; --round applies to a run directory")
        run_dir = source.parent.parent if source.parent.name == "checkpoints" else None
        return source, run_dir if run_dir is not None and (run_dir / "config.toml").is_file() else None
    if not source.is_dir():
        raise SourceError(f"{source} does not exist; pass a run directory (it holds checkpoints/) or a "
                          "checkpoints/round_NNNN.safetensors file")
    found = checkpoint_rounds(source / "checkpoints")
    if not found:
        raise SourceError(f"{source} has no checkpoints/round_NNNN.safetensors; is it a run directory "
                          "(fedge-coordinator run --out DIR) with at least one completed round?")
    if round is None:
        return found[max(found)], source
    if round not in found:
        raise SourceError(f"{source} has no checkpoint of round {round}; available rounds: "
                          f"{', '.join(map(str, sorted(found)))} (checkpoint.keep = \"last\" keeps only the last)")
    return found[round], source


def read_checkpoint(path: Path) -> Checkpoint:
    """Read a checkpoint file; SourceError names the file and the remedy when it is not one."""
    path = Path(path)
    try:
        state, info = load_checkpoint(path)
    except CheckpointError as exc:
        if exc.cause is None:
            raise SourceError(f"checkpoint {path} does not exist; pass a run directory or one of its "
                              "checkpoints/round_NNNN.safetensors files") from None
        raise SourceError(f"checkpoint {path} is not a readable fedge checkpoint ({exc.cause}); "
                          "export another round with --round N") from None
    return Checkpoint.of(path, state, info)


def _read_config(run_dir: Path | None) -> dict[str, Any]:
    path = None if run_dir is None else run_dir / "config.toml"
    if path is None or not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SourceError(f"{path} is not readable TOML ({exc}); restore it or pass --data SPEC") from None


def _read_metrics(run_dir: Path | None, round: int) -> dict[str, Any]:
    path = None if run_dir is None else run_dir / "metrics.jsonl"
    if path is None or not path.is_file():
        return {}
    return next((row for row in read_jsonl(path) if row.get("round") == round), {})


def open_run(source: Path, round: int | None = None) -> RunSource:
    """The checkpoint of ``round`` (default: the latest) of a run directory, or one checkpoint file."""
    path, run_dir = find_checkpoint(Path(source), round)
    checkpoint = read_checkpoint(path)
    return RunSource(checkpoint, run_dir, _read_config(run_dir), _read_metrics(run_dir, checkpoint.round),
                     _read_metrics(run_dir, 0))


def run_dir_of_state(state_dir: Path) -> Path | None:
    """The run directory of a spawned client's state directory (``RUN_DIR/clients/ID``), if it is one."""
    run_dir = Path(state_dir).resolve().parent.parent
    return run_dir if Path(state_dir).resolve().parent.name == "clients" and (run_dir / "checkpoints").is_dir() \
        else None


def build(spec: Mapping[str, Any]) -> nn.Module:
    """The checkpoint's network, untrained; SourceError when its spec does not build."""
    try:
        return build_aside(spec)
    except ModelSpecError as exc:
        raise SourceError(f"cannot build the checkpoint's model: {exc}") from None


def load_tensors(model: nn.Module, tensors: Mapping[str, torch.Tensor], required: Iterable[str], *,
                 origin: str) -> None:
    """Load ``tensors`` into ``model`` after checking them: every ``required`` name present, no name
    the model lacks, the model's shapes, finite values."""
    state = model.state_dict()
    missing = sorted(set(required) - set(tensors))
    unknown = sorted(set(tensors) - set(state))
    if missing or unknown:
        raise SourceError(f"{origin} does not fit the model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                          f"unknown {unknown[:5]}{'...' if len(unknown) > 5 else ''}; it was written for another "
                          "model spec or is incomplete")
    for name, value in tensors.items():
        if tuple(value.shape) != tuple(state[name].shape):
            raise SourceError(f"{origin}: {name} has shape {tuple(value.shape)}, the model expects "
                              f"{tuple(state[name].shape)}; it was written for another model spec")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise SourceError(f"{origin}: {name} holds NaN or infinity; the training diverged at or before "
                              "this round, export an earlier one with --round N")
    model.load_state_dict({k: v.to(state[k].dtype) for k, v in tensors.items()}, strict=False)


def global_model(checkpoint: Checkpoint) -> nn.Module:
    """The run's global model in eval mode, with every exchanged tensor from the checkpoint."""
    spec = checkpoint.model_spec
    reason = hooks.no_global(spec)
    if reason:
        raise SourceError(f"run {checkpoint.run_id}: {reason}")
    model = build(spec)
    load_tensors(model, checkpoint.params, federated_names(model), origin=f"checkpoint {checkpoint.path}")
    return model.eval()


def read_state_file(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a file in a device's state directory; SourceError says what to do when it cannot be read."""
    if not path.is_file():
        raise SourceError(f"{path} does not exist; --client-state takes the state directory of a device that "
                          "has trained in the run (its --state-dir; for a spawned client RUN_DIR/clients/ID)")
    try:
        return load_safetensors(path.read_bytes())
    except (SafetensorError, OSError, ValueError) as exc:
        raise SourceError(f"{path} is not a readable safetensors file ({exc}); the device rewrites it "
                          "after its next training task") from None


def personalized_model(checkpoint: Checkpoint, state_dir: Path) -> Personalized:
    """One device's model: the run's global part with the parts that stayed on that device, assembled by the
    export hook of the method that kept them there."""
    found = hooks.personalized(checkpoint, Path(state_dir))
    if found is None:
        raise SourceError(f"run {checkpoint.run_id} ({checkpoint.strategy}, model "
                          f"{checkpoint.model_spec.get('name')!r}) keeps no personalized parts on its devices that "
                          "fedge can export; export the global model (without --client-state)")
    return found
