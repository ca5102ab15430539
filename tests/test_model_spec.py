"""The model spec belongs to the server state; methods bring their defaults.

A strategy may hand back a state with a new spec (Fed2 restructures the network,
FedMA grows it): the coordinator, every device, the checkpoint, ``--resume`` and
the export must all follow it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.ui.cli import main as coordinator_main
from coordinator.config import ConfigError, load_config
from storage.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
WIDEN = ROOT / "tests" / "fixtures" / "widen_run.py"


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _widen_cmd(out: Path, broker: str, prefix: str, rounds: int, *extra: str) -> list[str]:
    return [sys.executable, str(WIDEN), "run", "--data", "digits", "--model", "mlp", "--rounds", str(rounds),
            "--clients", "2", "--spawn-clients", "2", "--broker", broker, "--seed", "3", "--out", str(out),
            "--set", f"transport.prefix={prefix}", "--set", "model.hidden=[16]", *extra]


def test_a_strategy_that_widens_the_model_runs_over_mqtt_and_resumes_to_the_same_rows(tmp_path, mosquitto, prefix,
                                                                                      kill_after_checkpoint):
    rounds = 4
    ref = subprocess.run(_widen_cmd(tmp_path / "ref", mosquitto, prefix + "-ref", rounds),
                         capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    rows = read_metrics(tmp_path / "ref")
    # Round 1 trained the configured network, round 2 on the wider one: devices built it from their tasks.
    assert rows[2]["fp32_bytes_down"] > rows[1]["fp32_bytes_down"] > 0
    assert all(r["returned"] == 2 and r["rejected"] == 0 for r in rows[1:])
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"] + 0.3
    state, _ = load_checkpoint(tmp_path / "ref" / "checkpoints" / "round_0001.safetensors")
    assert state.spec["hidden"] == [24] and tuple(state.params["features.1.weight"].shape) == (24, 64)
    summary = json.loads((tmp_path / "ref" / "summary.json").read_text())
    assert summary["model"]["hidden"] == [24]
    assert "onnx" in summary["export"], summary["export"]   # the export built the wider network too

    out = tmp_path / "resumed"
    proc = subprocess.Popen(_widen_cmd(out, mosquitto, prefix, rounds), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    kill_after_checkpoint(proc, out, 2)
    assert max(r["round"] for r in read_metrics(out)) < rounds

    resumed = subprocess.run(_widen_cmd(out, mosquitto, prefix, rounds, "--resume"),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    again = read_metrics(out)
    assert [r["round"] for r in again] == list(range(rounds + 1))
    for a, b in zip(rows, again):
        assert b["test_accuracy"] == pytest.approx(a["test_accuracy"], abs=1e-3)
        assert b["test_loss"] == pytest.approx(a["test_loss"], abs=1e-3)
        assert b.get("fp32_bytes_down") == a.get("fp32_bytes_down")


def _run_alone(tmp_path: Path, strategy: str, capsys) -> dict:
    out = tmp_path / strategy
    code = coordinator_main(["run", "--strategy", strategy, "--transport", "inproc", "--spawn-clients", "2",
                             "--clients", "2", "--rounds", "1", "--data", "digits", "--model", "mlp",
                             "--set", "model.hidden=[32]", "--out", str(out)])
    assert code == 0, capsys.readouterr().out
    return json.loads((out / "summary.json").read_text())


def test_spherefed_alone_runs_with_the_sphere_head(tmp_path, capsys):
    summary = _run_alone(tmp_path, "spherefed", capsys)
    assert summary["model"]["head"] == "sphere" and summary["ffc_accuracy_after"] > 0.5


def test_dfl_alone_runs_with_a_held_out_split(tmp_path, capsys):
    summary = _run_alone(tmp_path, "dfl", capsys)
    assert summary["model"]["name"] == "dfl" and summary["final_personalized_accuracy"] > 0.2


def test_a_method_default_never_overrides_what_the_user_set():
    assert load_config(None, [("run", "strategy", "dfl")]).data.local_test_fraction == 0.2
    assert load_config(None, [("run", "strategy", "dfl"), ("data", "local_test_fraction", 0.1)]
                       ).data.local_test_fraction == 0.1
    assert load_config(None, [("run", "strategy", "fedavg")]).data.local_test_fraction == 0.0
    assert load_config(None, [("run", "strategy", "spherefed")]).model == {"name": "cnn", "head": "sphere"}
    assert load_config(None, [("run", "strategy", "spherefed"), ("model", "head", "sphere")]).model["head"] == "sphere"


def test_only_a_real_conflict_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"needs model.head = 'sphere', but the configuration sets 'linear'"):
        load_config(None, [("run", "strategy", "spherefed"), ("model", "head", "linear")])
    config_file = tmp_path / "c.toml"
    config_file.write_text('[run]\nstrategy = "dfl"\n[data]\nlocal_test_fraction = 0.0\n[clients]\nspawn = 2\n'
                           'expected = 2\n')
    # the user's explicit 0 stands (dfl's default 0.2 would pass), and dfl says what it needs with the configuration
    with pytest.raises(ConfigError, match="local_test_fraction must be > 0"):
        load_config(config_file)


def test_the_cli_help_names_every_registered_method(capsys):
    from edge_client.registry import METHODS

    with pytest.raises(SystemExit):
        coordinator_main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in METHODS:
        assert name in text
