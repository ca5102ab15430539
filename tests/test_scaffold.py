"""``fedge-coordinator new``: each template writes an app package that passes its own test and trains at once."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest

from coordinator.config import load_config
from coordinator.ops.scaffold import TEMPLATES, ScaffoldError, write_app
from coordinator.runtime.run import run_federated
from coordinator.ui.cli import main


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_a_new_app_passes_its_own_test_and_trains_in_a_simulation(template, tmp_path, monkeypatch, capsys):
    name = f"new_{template}"
    assert main(["new", name, "--template", template, "--dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert f"--set app.module={name}_app:app --data {TEMPLATES[template][1]}" in printed
    root = tmp_path / name
    assert f'{name} = "{name}_app:app"' in (root / "pyproject.toml").read_text()   # devices find it by name
    own_test = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(root / "tests")],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.getcwd()])})
    assert own_test.returncode == 0, own_test.stdout + own_test.stderr
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    sets = {"run": {"rounds": 10, "out": str(tmp_path / "run")}, "app": {"module": f"{name}_app:app"},
            "data": {"eval": TEMPLATES[template][1]}, "clients": {"expected": 3, "spawn": 3},
            "transport": {"kind": "inproc"}}
    suited = [(*key.split("."), value) for key, value in TEMPLATES[template][2].items()]   # as the printed command
    config = load_config(None, [(s, k, v) for s, keys in sets.items() for k, v in keys.items()] + suited)
    result = run_federated(config, say=lambda text: None)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    headline = result.summary["headline"]
    assert rows[-1][f"test_{headline}"] > rows[0][f"test_{headline}"]   # both templates' headlines: higher is better
    assert (tmp_path / "run" / "export" / "model.onnx").is_file()


def test_new_refuses_a_bad_name_an_unknown_template_and_a_directory_in_use(tmp_path):
    with pytest.raises(ScaffoldError, match="lower-case letter"):
        write_app("My App", "tabular", tmp_path)
    with pytest.raises(ScaffoldError, match="unknown template 'images'"):
        write_app("mine", "images", tmp_path)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(ScaffoldError, match="exists and is not empty"):
        write_app("taken", "tabular", tmp_path)
