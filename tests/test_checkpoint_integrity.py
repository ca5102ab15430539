"""A damaged checkpoint is refused with one line naming the file and the last good round, not resumed.

Checkpoints are written by the coordinator's own writer (real model weights), then damaged
as a disk or a copy damages them: NaN over the last value, or one flipped data byte.
"""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from edge_client.models import federated_names
from edge_client.registry import build_model
from export.errors import SourceError
from export.source import read_checkpoint
from storage.checkpoint import CheckpointError, checkpoint_path, load_checkpoint, save_checkpoint
from storage.state import ServerState

SPEC = {"name": "mlp", "hidden": [16], "num_classes": 10, "in_channels": 1, "image_size": 8}
INFO = {"run_id": "run-1", "strategy": "fedavg"}
QUICK = ["--transport", "inproc", "--spawn-clients", "2", "--clients", "2", "--data", "digits",
         "--model", "mlp", "--set", "model.hidden=[16]", "--set", "export.enabled=false"]


def _params(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = build_model(SPEC)
    names = set(federated_names(model))
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k in names}


def _write_rounds(directory: Path, rounds: int) -> None:
    for r in range(1, rounds + 1):
        save_checkpoint(directory, ServerState(r, _params(r), SPEC, {}), INFO)


def _nan_into_last_value(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-4:] = struct.pack("<f", math.nan)        # every tensor is float32: the file ends with a value
    path.write_bytes(bytes(data))


def _flip_data_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    header = struct.unpack("<Q", data[:8])[0]
    data[8 + header + 5] ^= 0x01                   # the lowest bit of a low mantissa byte: still finite
    path.write_bytes(bytes(data))


def _damaged_line(path: Path, reason: str, good: int) -> str:
    return (f"{path}: damaged ({reason}); the last good checkpoint is round {good}: delete the damaged file(s) "
            "to resume from it")


def test_an_intact_checkpoint_carries_a_digest_and_reads_back_exactly(tmp_path):
    _write_rounds(tmp_path, 1)
    path = checkpoint_path(tmp_path, 1)
    state, info = load_checkpoint(path)
    assert info == INFO and state.round == 1
    for name, value in _params(1).items():
        assert torch.equal(state.params[name], value)


def test_nan_over_the_last_value_is_refused_naming_the_last_good_round(tmp_path):
    _write_rounds(tmp_path, 4)
    damaged = checkpoint_path(tmp_path, 4)
    _nan_into_last_value(damaged)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(damaged)
    assert str(error.value) == _damaged_line(damaged, f"NaN or infinite values in {_last_tensor(damaged)}", 3)
    assert error.value.last_good == 3


def _last_tensor(path: Path) -> str:
    """The tensor whose values end the file (safetensors' data order, read from its header)."""
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    header = json.loads(path.read_bytes()[8:8 + header_len])
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])


def test_one_flipped_data_byte_is_refused_and_older_damage_is_skipped(tmp_path):
    _write_rounds(tmp_path, 4)
    _flip_data_byte(checkpoint_path(tmp_path, 4))
    _flip_data_byte(checkpoint_path(tmp_path, 3))          # the one before is damaged too: round 2 is the good one
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(checkpoint_path(tmp_path, 4))
    assert str(error.value) == _damaged_line(checkpoint_path(tmp_path, 4), "digest mismatch", 2)
    assert "\n" not in str(error.value)


def test_damage_with_no_good_checkpoint_before_it_says_so(tmp_path):
    _write_rounds(tmp_path, 1)
    path = checkpoint_path(tmp_path, 1)
    _flip_data_byte(path)
    with pytest.raises(CheckpointError, match=r"round_0001.safetensors: damaged \(digest mismatch\); no earlier "
                                              r"checkpoint verifies") as error:
        load_checkpoint(path)
    assert error.value.last_good is None


def test_a_checkpoint_written_before_digests_still_loads_but_not_with_nan(tmp_path):
    meta = {"fedge": json.dumps({**INFO, "round": 1, "spec": SPEC, "extra": {}})}
    old = checkpoint_path(tmp_path, 1)
    save_file(_params(1), str(old), metadata=meta)
    assert load_checkpoint(old)[0].round == 1
    params = _params(2)
    next(iter(params.values())).view(-1)[0] = math.inf
    save_file(params, str(checkpoint_path(tmp_path, 2)),
              metadata={"fedge": json.dumps({**INFO, "round": 2, "spec": SPEC, "extra": {}})})
    with pytest.raises(CheckpointError, match=r"round_0002.safetensors: damaged \(NaN or infinite values in .*\); "
                                              r"the last good checkpoint is round 1"):
        load_checkpoint(checkpoint_path(tmp_path, 2))


def test_the_export_refuses_a_damaged_checkpoint_in_one_line(tmp_path):
    _write_rounds(tmp_path / "checkpoints", 2)
    _flip_data_byte(checkpoint_path(tmp_path / "checkpoints", 2))
    with pytest.raises(SourceError, match=r"round_0002.safetensors .*digest mismatch.*last good checkpoint is "
                                          r"round 1.*--round") as error:
        read_checkpoint(checkpoint_path(tmp_path / "checkpoints", 2))
    assert "\n" not in str(error.value)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> Path:
    """A real two-round run directory (in-process clients on digits)."""
    from coordinator.ui.cli import main

    out = tmp_path_factory.mktemp("run") / "run"
    assert main(["run", *QUICK, "--rounds", "2", "--out", str(out)]) == 0
    return out


def _copy_run(run: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(run, to)
    return to


@pytest.mark.parametrize("damage", [_nan_into_last_value, _flip_data_byte], ids=["nan", "flipped-byte"])
def test_resume_refuses_a_damaged_checkpoint_in_one_line_at_once(short_run, tmp_path, damage):
    out = _copy_run(short_run, tmp_path / "run")
    newest = checkpoint_path(out / "checkpoints", 2)
    damage(newest)
    started = time.monotonic()
    resumed = subprocess.run([sys.executable, "-m", "coordinator.ui.cli", "run", "--resume", "--out", str(out),
                              "--rounds", "3"], capture_output=True, text=True, timeout=120)
    lines = (resumed.stdout + resumed.stderr).strip().splitlines()
    assert resumed.returncode != 0 and len(lines) == 1, resumed.stdout + resumed.stderr
    assert f"{newest}: damaged (" in lines[0] and "the last good checkpoint is round 1" in lines[0]
    assert time.monotonic() - started < 30                 # no round was started, no timeout burnt
    assert not checkpoint_path(out / "checkpoints", 3).exists()


def test_fedge_export_refuses_a_damaged_run(short_run, tmp_path):
    out = _copy_run(short_run, tmp_path / "run")
    newest = checkpoint_path(out / "checkpoints", 2)
    _flip_data_byte(newest)
    exported = subprocess.run([sys.executable, "-m", "export.cli", str(out)], capture_output=True, text=True,
                              timeout=120)
    err = exported.stdout + exported.stderr
    refusal = [line for line in err.splitlines() if "damaged" in line]   # beside any progress line
    assert exported.returncode == 2 and len(refusal) == 1 and "Traceback" not in err, err
    assert str(newest) in refusal[0] and "last good checkpoint is round 1" in refusal[0]
    assert not (out / "export").exists()


def test_deleting_the_damaged_file_resumes_from_the_last_good_round(short_run, tmp_path):
    from coordinator.ui.cli import main

    out = _copy_run(short_run, tmp_path / "run")
    newest = checkpoint_path(out / "checkpoints", 2)
    _flip_data_byte(newest)
    assert main(["run", "--resume", "--out", str(out), "--rounds", "2"]) == 2
    newest.unlink()                                        # the remedy the refusal names
    assert main(["run", "--resume", "--out", str(out), "--rounds", "2"]) == 0
    assert load_checkpoint(newest)[0].round == 2
