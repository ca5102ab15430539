"""The model's input normalization travels in its spec: devices, the export and ``fedge-profile infer`` apply it.

A coordinator on ``fashion-mnist`` normalizes with the data set's mean and std; a device whose own
data is an npz of the same uint8 pixels must feed the model the same numbers, and a device serving
the exported model must too. Real data (Fashion-MNIST, digits), real training, real ONNX Runtime,
real Mosquitto and client processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from coordinator.config import load_config
from coordinator.runtime.run import run_federated
from edge_client.data import (FASHION_MNIST_DIR, FASHION_MNIST_NORMALIZATION, client_pixels, holdout_split,
                              load_dataset, load_pixels, model_normalization)
from edge_client.inputs import DeviceData, for_model, load_device_data
from edge_client.models import ModelSpecError
from edge_client.objectives import holdout_seed
from edge_client.registry import build_model
from export.pipeline import ExportOptions, export_global
from profiling.infer import InferSettings, benchmark

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
needs_fmnist = pytest.mark.skipif(not (Path(FASHION_MNIST_DIR) / "t10k-images-idx3-ubyte.gz").is_file(),
                                  reason=f"Fashion-MNIST IDX files not installed in {FASHION_MNIST_DIR}")
pytestmark = [needs_fmnist, pytest.mark.usefixtures("one_torch_thread")]


def _coordinator_spec() -> dict:
    """The model spec a coordinator on ``--data fashion-mnist`` sends, as it arrives (through JSON)."""
    dataset = load_dataset("fashion-mnist", train=False)
    spec = {"name": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 28,
            "normalization": model_normalization(dataset, "iid").to_spec()}
    return json.loads(json.dumps(spec))


def _npz_of_partition(path: Path, index: int, parts: int) -> np.ndarray:
    """An npz of one partition's uint8 Fashion-MNIST pixels (all of them the device's train split); its labels."""
    pixels, labels, _ = client_pixels("fashion-mnist", "iid", index, parts, 0)
    assert pixels.values.dtype == np.uint8
    np.savez(path, x=pixels.values[:, 0], y=labels, x_test=pixels.values[:4, 0], y_test=labels[:4])
    return labels


def test_an_npz_device_under_a_fashion_mnist_spec_feeds_the_model_what_the_built_in_loader_does(tmp_path):
    _npz_of_partition(tmp_path / "own.npz", 3, 60)
    spec = _coordinator_spec()
    assert spec["normalization"] == {"mean": [0.286], "std": [0.353]}
    device = load_device_data(f"npz:{tmp_path / 'own.npz'}", 0.25, seed=0, client_id="pi-01")
    assert isinstance(device, DeviceData) and float(device.x[:].max()) == 1.0   # as loaded: pixels / 255
    inputs = for_model(device, spec)
    built_in = load_device_data("fashion-mnist", 0.25, seed=0, client_id="pi-01", partition="iid",
                                partition_index=3, num_partitions=60)
    assert torch.equal(inputs.x[:], built_in.x[:]) and torch.equal(inputs.x_test[:], built_in.x_test[:])
    assert torch.equal(inputs.y, built_in.y) and torch.equal(inputs.y_test, built_in.y_test)
    # the built-in loader's inputs are the coordinator's normalization of those rows
    pixels, _, _ = client_pixels("fashion-mnist", "iid", 3, 60, 0)
    train_rows = holdout_split(np.arange(len(pixels)), np.zeros(len(pixels)), 0.25, holdout_seed(0, "pi-01"))[0]
    assert np.array_equal(built_in.x[:].numpy(), pixels.normalized(FASHION_MNIST_NORMALIZATION)[train_rows])
    assert for_model(inputs, spec) is inputs          # made once, kept for the next task
    assert for_model(built_in, spec) is built_in      # already normalized as the spec says


def test_a_spec_without_normalization_leaves_the_data_as_loaded_and_a_bad_one_is_refused(tmp_path):
    _npz_of_partition(tmp_path / "own.npz", 0, 100)
    device = load_device_data(f"npz:{tmp_path / 'own.npz'}", 0.0, seed=0, client_id="pi-02")
    old = {k: v for k, v in _coordinator_spec().items() if k != "normalization"}   # a spec from before
    assert for_model(device, old) is device
    build_model(old)
    for bad in ({"mean": [0.5, 0.5], "std": [0.5, 0.5]}, {"mean": [0.5], "std": [0.0]}, {"mean": 0.5}):
        with pytest.raises(ModelSpecError, match="normalization"):
            build_model({**old, "normalization": bad})
    rgb = {**old, "in_channels": 3, "normalization": {"mean": [0.5] * 3, "std": [0.5] * 3}}
    with pytest.raises(ValueError, match="the model normalizes 3 channel"):
        for_model(device, rgb)


def _fashion_mnist_run(out: Path) -> Path:
    """One short FedAvg round on Fashion-MNIST (10 in-process clients, one trains): its run directory."""
    sets = {"run__rounds": 1, "run__out": str(out), "model__name": "mlp", "model__hidden": [64],
            "data__eval": "fashion-mnist", "clients__expected": 10, "clients__spawn": 10, "clients__per_round": 1,
            "clients__round_timeout": 120.0, "clients__presence_timeout": 60.0, "transport__kind": "inproc",
            "export__enabled": False}
    run_federated(load_config(None, [(*k.split("__", 1), v) for k, v in sets.items()]), say=lambda s: None)
    return out


def test_the_cards_accuracy_is_what_fedge_profile_infer_measures_on_the_same_samples(tmp_path):
    run = _fashion_mnist_run(tmp_path / "run")
    exported = export_global(run, options=ExportOptions(test_samples=2000, parity_samples=200))
    card = exported.card
    assert card["input"]["normalization"]["mean"] == [0.286] and card["model"]["normalization"]["std"] == [0.353]
    # the same 2000 labelled test images as a device holds them: uint8 pixels
    raw = load_pixels("fashion-mnist", train=False)
    samples = tmp_path / "device-test.npz"
    np.savez(samples, x_test=raw.x_test.values[:2000, 0], y_test=raw.y_test[:2000])
    record = benchmark(exported.path, InferSettings(runs=2, warmup=0, batch=64, data=f"npz:{samples}"))
    assert record["accuracy_samples"] == 2000 and record["normalization"] == {"mean": [0.286], "std": [0.353]}
    assert record["accuracy"] == card["test_accuracy"] > 0.5
    cli = subprocess.run([sys.executable, "-m", "profiling.cli", "infer", str(exported.path), "--data",
                          f"npz:{samples}", "--runs", "2", "--warmup", "0", "--no-record"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert f"accuracy {100 * card['test_accuracy']:.2f}% on the 2000 labelled samples" in cli.stdout


def _run_with_device(run_beside_device, tmp_path: Path, mosquitto: str, prefix: str, name: str,
                     data: list[str]) -> tuple[Path, str]:
    """One round on ``--data fashion-mnist`` with one ``fedge-client`` process (client id pi-01) on ``data``."""
    out = tmp_path / name
    sets = {"run.rounds": 1, "run.out": str(out), "model.name": "cnn", "model.width": 0.25,
            "data.eval": "fashion-mnist", "clients.expected": 1, "clients.spawn": 0, "clients.round_timeout": 120.0,
            "transport.broker": mosquitto, "transport.prefix": prefix, "export.enabled": False}
    config = load_config(None, [(*k.split(".", 1), v) for k, v in sets.items()])
    cmd = [sys.executable, "-m", "edge_client.cli", "run", "--broker", mosquitto, "--client-id", "pi-01",
           *data, "--state-dir", str(tmp_path / f"state-{name}"), "--prefix", prefix, "--torch-threads", "1",
           "--exit-after-run"]
    return out, run_beside_device(config, cmd, ENV)


def test_over_processes_an_npz_device_trains_the_model_a_built_in_device_does(tmp_path, mosquitto, prefix,
                                                                            run_beside_device):
    """The deployment case: the coordinator on fashion-mnist, the device on its own npz of the same pixels.
    The device trains on exactly the coordinator's inputs, so the round's model is bit for bit the one a
    device on the built-in loader (the same rows) returns."""
    _npz_of_partition(tmp_path / "own.npz", 0, 40)
    npz_run, npz_err = _run_with_device(run_beside_device, tmp_path, mosquitto, prefix + "-a", "npz",
                                        ["--data", f"npz:{tmp_path / 'own.npz'}"])
    built_run, built_err = _run_with_device(run_beside_device, tmp_path, mosquitto, prefix + "-b", "builtin",
                                            ["--data", "fashion-mnist", "--partition", "iid", "--partition-index",
                                             "0", "--num-partitions", "40", "--seed", "0"])
    assert "inputs normalized as the model says: mean [0.286], std [0.353]" in npz_err, npz_err
    assert "inputs normalized" not in built_err, built_err
    got = load_file(npz_run / "checkpoints" / "round_0001.safetensors")
    want = load_file(built_run / "checkpoints" / "round_0001.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    rows = [json.loads(line) for line in (npz_run / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["returned"] == 1 and rows[1]["test_accuracy"] > 0.5


def test_a_device_trains_on_every_image_of_its_own_npz_unless_the_run_holds_some_out(tmp_path):
    pixels, labels, _ = client_pixels("fashion-mnist", "iid", 1, 60, 0)
    np.savez(tmp_path / "own.npz", x=pixels.values[:, 0], y=labels)   # no x_test: all of it the device's
    everything = load_device_data(f"npz:{tmp_path / 'own.npz'}", 0.0, seed=0, client_id="pi-03")
    assert len(everything.y) == len(labels) and everything.x_test is None
    held_out = load_device_data(f"npz:{tmp_path / 'own.npz'}", 0.25, seed=0, client_id="pi-03")
    assert len(held_out.y) + len(held_out.y_test) == len(labels)   # the held-out share comes from its own rows
