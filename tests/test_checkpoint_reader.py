"""The export reads checkpoints through the coordinator's one reader: same names, same layout, own errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from export.errors import SourceError
from export.source import find_checkpoint, open_run, read_checkpoint
from storage.checkpoint import (CheckpointError, checkpoint_path, checkpoint_rounds, latest_checkpoint,
                                load_checkpoint, save_checkpoint)
from storage.state import ServerState

SPEC = {"name": "mlp", "hidden": [4], "num_classes": 3, "in_channels": 1, "image_size": 2}
INFO = {"run_id": "run-1", "strategy": "fedavg"}


def _state(round: int) -> ServerState:
    return ServerState(round, {"w": torch.full((2,), float(round))}, SPEC, {"note": round})


def test_export_finds_the_rounds_the_coordinator_wrote(tmp_path):
    directory = tmp_path / "checkpoints"
    for r in (2, 10, 9):
        save_checkpoint(directory, _state(r), INFO)
    (directory / "round_7.safetensors").write_bytes(b"x")            # not a name save_checkpoint writes
    (directory / "round_0011.safetensors.tmp").write_bytes(b"half")
    assert checkpoint_rounds(directory) == {r: checkpoint_path(directory, r) for r in (2, 9, 10)}
    assert find_checkpoint(tmp_path) == (latest_checkpoint(directory), tmp_path)
    assert find_checkpoint(tmp_path, 9)[0] == checkpoint_path(directory, 9)


def test_export_takes_the_model_spec_from_the_state(tmp_path):
    path = save_checkpoint(tmp_path / "checkpoints", _state(3), INFO)
    checkpoint = read_checkpoint(path)
    state, info = load_checkpoint(path)
    assert (checkpoint.round, checkpoint.run_id, checkpoint.strategy) == (3, "run-1", "fedavg")
    assert checkpoint.model_spec == state.spec == SPEC and checkpoint.extra == {"note": 3}
    assert torch.equal(checkpoint.params["w"], torch.full((2,), 3.0))
    assert open_run(tmp_path).checkpoint.model_spec == SPEC


def test_a_checkpoint_written_before_the_spec_was_state_still_reads(tmp_path):
    path = tmp_path / "round_0001.safetensors"
    meta = {**INFO, "model": SPEC, "round": 1, "extra": {}}     # the spec under "model", no "spec" key
    save_file({"w": torch.ones(2)}, str(path), metadata={"fedge": json.dumps(meta)})
    assert load_checkpoint(path)[0].spec == SPEC
    assert read_checkpoint(path).model_spec == SPEC


def test_export_gives_its_own_remedy_for_a_bad_checkpoint(tmp_path):
    missing = tmp_path / "round_0001.safetensors"
    with pytest.raises(CheckpointError) as coordinator_error:
        load_checkpoint(missing)
    assert coordinator_error.value.cause is None and coordinator_error.value.path == missing
    with pytest.raises(SourceError, match="round_0001.safetensors does not exist; pass a run directory"):
        read_checkpoint(missing)

    no_spec = tmp_path / "round_0002.safetensors"
    save_file({"w": torch.ones(2)}, str(no_spec), metadata={"fedge": json.dumps({**INFO, "round": 2})})
    with pytest.raises(CheckpointError, match="no model spec.*delete it to resume"):
        load_checkpoint(no_spec)
    with pytest.raises(SourceError, match=r"round_0002.safetensors is not a readable fedge checkpoint "
                                          r"\(ValueError: .*no model spec.*\); export another round") as error:
        read_checkpoint(no_spec)
    assert "delete it" not in str(error.value)     # that is the coordinator's remedy, not the export's


def test_export_needs_the_run_id_and_strategy_the_coordinator_saves(tmp_path):
    path = save_checkpoint(tmp_path, _state(1), {"run_id": "run-1"})
    assert load_checkpoint(path)[0].round == 1          # a checkpoint to the coordinator...
    with pytest.raises(SourceError, match="no run id or strategy name .* not written by fedge-coordinator"):
        read_checkpoint(path)                           # ...but not one the export can describe
