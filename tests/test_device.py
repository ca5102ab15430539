"""Training on the device's accelerator: ``--device``, what goes on the wire, what the profile says.

The CPU path runs everywhere. The CUDA tests are the same behaviours on the GPU and run
where torch sees one (a Jetson with NVIDIA's torch wheel: docs/deploy.md says how);
elsewhere they are skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coordinator.config import ConfigError, load_config
from edge_client.device import GpuMeter, DeviceError, gpu_temperature, resolve_device
from profiling.schema import clean_profile

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on a Jetson)")
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")


def test_auto_takes_cuda_only_when_torch_sees_it():
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "cpu:0", "tpu", ""])
def test_an_unknown_device_names_the_choices(name):
    with pytest.raises(DeviceError, match="choose one of auto, cpu, cuda, mps"):
        resolve_device(name)


@NO_CUDA
def test_cuda_without_a_gpu_says_what_to_install():
    with pytest.raises(DeviceError, match="sees no CUDA GPU: on a Jetson install NVIDIA's torch wheel"):
        resolve_device("cuda")
    with pytest.raises(ConfigError, match="eval.device: .*sees no CUDA GPU"):
        load_config(None, [("eval", "device", "cuda")])


def test_gpu_temperature_reads_the_jetson_gpu_zone_only(tmp_path):
    for i, (kind, milli) in enumerate([("CPU-therm", "52000"), ("GPU-therm", "41500"), ("PMIC-Die", "100000")]):
        zone = tmp_path / f"thermal_zone{i}"
        zone.mkdir()
        (zone / "type").write_text(kind + "\n")
        (zone / "temp").write_text(milli + "\n")
    assert gpu_temperature(tmp_path) == 41.5
    assert gpu_temperature(tmp_path / "absent") is None
    (tmp_path / "thermal_zone1" / "type").write_text("AO-therm\n")
    assert gpu_temperature(tmp_path) is None


def test_on_the_cpu_the_gpu_readings_stay_absent():
    meter = GpuMeter(torch.device("cpu"))
    meter.start()
    assert meter.summary() == {"device": "cpu"}
    kept = clean_profile({"device": "cuda:0", "gpu_peak_bytes": 12_345_678, "gpu_temperature_c": 41.5})
    assert kept == {"device": "cuda:0", "gpu_peak_bytes": 12_345_678, "gpu_temperature_c": 41.5}
    assert clean_profile({"gpu_peak_bytes": -1, "device": 7}) == {"gpu_peak_bytes": None, "device": None}


def test_a_bad_device_is_one_line_and_exit_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "edge_client.cli", "run", "--client-id", "pi", "--data", "digits",
                          "--device", "gpu", "--broker", "mqtt://127.0.0.1:1", "--state-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unknown device 'gpu'" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def _run_with_device(run_beside_device, tmp_path: Path, mosquitto: str, prefix: str,
                     device: str) -> tuple[list[dict], list[dict]]:
    """Two rounds with one device process training on ``device`` and the coordinator evaluating there too:
    the metrics rows and the device's task profiles as the coordinator stored them."""
    out = tmp_path / device
    sets = {"run.rounds": 2, "run.out": str(out), "model.name": "cnn", "data.eval": "digits",
            "clients.expected": 1, "clients.spawn": 0, "clients.round_timeout": 60.0, "transport.broker": mosquitto,
            "transport.prefix": prefix, "eval.device": device, "export.enabled": False}
    config = load_config(None, [(*k.split(".", 1), v) for k, v in sets.items()])
    cmd = [sys.executable, "-m", "edge_client.cli", "run", "--broker", mosquitto, "--client-id", "dev-0",
           "--data", "digits", "--partition", "iid", "--num-partitions", "2", "--seed", "0", "--device", device,
           "--state-dir", str(tmp_path / f"state-{device}"), "--prefix", prefix, "--torch-threads", "1",
           "--exit-after-run"]
    err = run_beside_device(config, cmd, {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert f"training on {resolve_device(device)}" in err, err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tasks = [json.loads(line) for line in (out / "clients" / "dev-0.jsonl").read_text().splitlines()]
    return rows, tasks


def test_a_device_training_on_the_cpu_says_so(tmp_path, mosquitto, prefix, run_beside_device):
    rows, tasks = _run_with_device(run_beside_device, tmp_path, mosquitto, prefix, "cpu")
    assert [r["returned"] for r in rows[1:]] == [1, 1]
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"] + 0.2
    for task in tasks:
        assert task["profile"]["device"] == "cpu"
        assert "gpu_peak_bytes" not in task["profile"] and "gpu_temperature_c" not in task["profile"]


@CUDA
def test_a_device_training_on_cuda_sends_what_a_cpu_device_sends(tmp_path, mosquitto, prefix, run_beside_device):
    cpu_rows, _ = _run_with_device(run_beside_device, tmp_path, mosquitto, prefix + "-cpu", "cpu")
    rows, tasks = _run_with_device(run_beside_device, tmp_path, mosquitto, prefix, "cuda")
    assert [r["returned"] for r in rows[1:]] == [1, 1]
    # the same protocol and the same bytes: nothing on the wire says where the device trained
    assert [r["bytes_up"] for r in rows[1:]] == [r["bytes_up"] for r in cpu_rows[1:]]
    # the same learning, up to the GPU's floating-point order of operations
    assert rows[-1]["test_accuracy"] == pytest.approx(cpu_rows[-1]["test_accuracy"], abs=0.03)
    for task in tasks:
        assert task["profile"]["device"].startswith("cuda")
        assert task["profile"]["gpu_peak_bytes"] > 0


@CUDA
def test_the_gpu_meter_measures_what_a_task_allocates():
    meter = GpuMeter(torch.device("cuda"))
    meter.start()
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    facts = meter.summary()
    assert facts["device"].startswith("cuda") and facts["gpu_peak_bytes"] >= 64 * 2**20
    del block
