"""The disk fills while a checkpoint is written: the run stops with an error that says what to do, nothing
partial is left beside the checkpoints, and the run resumes from the last whole one once there is space."""

from __future__ import annotations

import errno
import json

import pytest

from coordinator.config import load_config
from coordinator.runtime.engine import RunError
from coordinator.runtime.run import run_federated
from storage import files
from storage.checkpoint import latest_checkpoint, load_checkpoint


def _config(out, rounds):
    sets = {"run.rounds": rounds, "run.out": str(out), "model.name": "cnn", "data.eval": "digits",
            "clients.expected": 2, "clients.spawn": 2, "transport.kind": "inproc", "export.enabled": False}
    return load_config(None, [(*k.split(".", 1), v) for k, v in sets.items()])


class _FullDisk:
    """A file whose writes fail as a full disk's do (the real OSError, ENOSPC)."""

    def __init__(self, path, mode):
        self._fh = open(path, mode)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()

    def write(self, data):
        self._fh.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_at_a_checkpoint_stops_the_run_cleanly_and_it_resumes(tmp_path, monkeypatch):
    out = tmp_path / "run"
    real_open = open

    def filling_open(path, mode="r", *args, **kwargs):
        if "round_0003" in str(path) and "w" in mode:
            return _FullDisk(path, mode)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(files, "open", filling_open, raising=False)
    with pytest.raises(RunError, match=r"could not write the checkpoint of round 3 .*No space left on device.*"
                                       r"free space and run again with --resume"):
        run_federated(_config(out, 4), say=lambda s: None)
    checkpoints = out / "checkpoints"
    names = sorted(p.name for p in checkpoints.iterdir())
    assert names[-2:] == ["round_0001.safetensors", "round_0002.safetensors"] and not any(".tmp" in n for n in names)
    state, _ = load_checkpoint(latest_checkpoint(checkpoints))
    assert state.round == 2
    monkeypatch.undo()                                   # space again
    result = run_federated(_config(out, 4), resume=True, say=lambda s: None)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2, 3, 4]
    assert result.summary["this_session"]["resumed_after_round"] == 2
