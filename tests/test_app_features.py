"""Every feature that does not depend on a network's structure trains a user's app: codecs and error feedback,
robust rules and norm bounds, async, central and local DP, secure aggregation, selection policies and resume.

One in-process run of the regression example per feature, a few rounds each: it must learn (R² up from round
0) and report the app's metrics, never an accuracy."""

from __future__ import annotations

import importlib
import json
import math
import os
from pathlib import Path

import pytest

from coordinator.config import load_config
from coordinator.runtime.run import run_federated

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "diabetes"

FEATURES = {
    "codec": {"codec__up": "topk:0.25+int8+zstd", "codec__down": "int8"},
    "robust": {"aggregate__rule": "median", "aggregate__norm_bound": 3.0},
    "async": {"run__mode": "async", "async__concurrency": 3, "async__buffer_size": 2, "run__rounds": 8},
    "central-dp": {"privacy__mode": "central", "privacy__clip_norm": 5.0, "privacy__noise_multiplier": 0.01,
                   "privacy__allow_swamping_noise": True, "clients__max_attempts": 1},
    "local-dp": {"privacy__mode": "local", "privacy__clip_norm": 5.0, "privacy__noise_multiplier": 0.01},
    "secagg": {"secagg__enabled": True, "secagg__clip": 50.0},
    "profile-selection": {"clients__selection": "profile", "clients__per_round": 2},
    "deadline-selection": {"clients__selection": "deadline"},
}


@pytest.fixture
def diabetes_app(monkeypatch) -> Path:
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(EXAMPLE), *filter(None, [os.environ.get("PYTHONPATH")])]))
    importlib.invalidate_caches()
    return EXAMPLE


def _config(out: Path, **sets):
    base = {"run__rounds": 5, "run__out": str(out), "app__module": "diabetes_app:app", "train__lr": 0.05,
            "data__eval": "sklearn", "clients__expected": 3, "clients__spawn": 3, "transport__kind": "inproc",
            "clients__round_timeout": 60.0, "export__enabled": False}
    base.update(sets)
    return load_config(None, [(*key.split("__", 1), value) for key, value in base.items()])


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_a_feature_trains_an_app(tmp_path, diabetes_app, feature):
    result = run_federated(_config(tmp_path / "run", **FEATURES[feature]), say=lambda s: None)
    rows = [r for r in _rows(tmp_path / "run") if "test_r2" in r]
    assert rows[-1]["test_r2"] > rows[0]["test_r2"] + 0.1, [r["test_r2"] for r in rows]
    assert all(math.isfinite(r["test_mae"]) for r in rows)
    assert not any("accuracy" in key for r in _rows(tmp_path / "run") for key in r)
    assert result.summary["headline"] == "r2"


def test_an_app_run_resumes_where_it_stopped(tmp_path, diabetes_app):
    out = tmp_path / "run"
    run_federated(_config(out, run__rounds=2), say=lambda s: None)
    result = run_federated(_config(out, run__rounds=4), resume=True, say=lambda s: None)
    rows = _rows(out)
    assert [r["round"] for r in rows if "test_r2" in r] == [0, 1, 2, 3, 4]
    assert result.summary["final_r2"] == rows[-1]["test_r2"] and rows[-1]["test_r2"] > rows[0]["test_r2"] + 0.1
