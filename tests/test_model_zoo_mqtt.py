"""Every model, with PANs off, additive and multiplicative, trains in a federated run over Mosquitto.

Two edge clients run as threads with their own MQTT connections (the real client
loop and transport, without a process start per run) and stay online across the
nine runs; the data are real digits upsampled to 16x16 so that vgg9's three
max-pools fit. The ``mlp`` runs use FedProx, the others FedAvg. A spy connection
records every task, model broadcast and result on the wire, to show that the PAN
encodings never travel.
"""

from __future__ import annotations

import json
import math
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from coordinator.config import load_config
from coordinator.runtime.run import run_federated
from edge_client.client import ClientSettings, EdgeClient
from edge_client.data import DIGITS_MEAN, DIGITS_STD, client_split, load_dataset
from edge_client.models import federated_names
from edge_client.registry import build_model
from edge_client.objectives import LocalData
from methods.pans.model import PositionAwareReLU
from edge_client.wire.chunking import ChunkingTransport
from edge_client.wire.protocol import DEFAULT_MAX_MESSAGE_BYTES, Topics, decode
from edge_client.wire.transport import BrokerSettings, MqttTransport

CLIENTS = 2


@pytest.fixture(scope="module")
def digits16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """500 real digits, each pixel repeated 2x2 (16x16), normalized like the digits spec."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = np.repeat(np.repeat(bunch.images[:500] / 16.0, 2, axis=1), 2, axis=2)
    path = tmp_path_factory.mktemp("zoo") / "digits16.npz"
    np.savez(path, x=((x - DIGITS_MEAN) / DIGITS_STD).astype(np.float32), y=bunch.target[:500].astype(np.int64))
    return path


@pytest.fixture(scope="module")
def zoo_clients(mosquitto: str, digits16: Path) -> str:
    """Two clients online over Mosquitto for the whole module; yields their topic prefix."""
    prefix = f"zoo-{uuid.uuid4().hex[:8]}"   # retained messages never leak between sessions
    dataset = load_dataset(f"npz:{digits16}")
    stop = threading.Event()
    threads, transports = [], []
    for i in range(CLIENTS):
        settings = ClientSettings(client_id=f"zoo-client-{i}", topics=Topics(prefix))
        transport = MqttTransport(BrokerSettings(url=mosquitto), settings.client_id,
                                  will=EdgeClient.will(settings)).connect()
        x, y = client_split(dataset, "iid", i, CLIENTS, seed=0)
        client = EdgeClient(settings, transport, LocalData(torch.from_numpy(x), torch.from_numpy(y)))
        threads.append(threading.Thread(target=client.run, args=(stop,), daemon=True))
        transports.append(transport)
        threads[-1].start()
    yield prefix
    stop.set()
    for thread, transport in zip(threads, transports):
        thread.join(timeout=30)
        transport.close()


@pytest.mark.parametrize("pan", ["none", "add", "mul"])
@pytest.mark.parametrize("model", ["mlp", "cnn", "vgg9"])
def test_model_trains_over_mqtt(model, pan, zoo_clients, mosquitto, digits16, tmp_path):
    spy = ChunkingTransport(MqttTransport(BrokerSettings(url=mosquitto), f"zoo-spy-{model}-{pan}").connect(),
                            max_decoded_bytes=DEFAULT_MAX_MESSAGE_BYTES)   # whole messages, however sent
    spy.subscribe(f"{zoo_clients}/#")   # tasks, results and any broadcast of the global model
    extra = [("model", "hidden", [64, 64])] if model == "mlp" else []
    strategy = "fedprox" if model == "mlp" else "fedavg"   # PANs are a model option: any strategy takes them
    config = load_config(None, [
        ("run", "strategy", strategy), ("run", "rounds", 1), ("run", "out", str(tmp_path / "run")),
        ("run", "diagnostics", pan != "none"),
        ("model", "name", model), ("model", "pan", pan), *extra, ("data", "eval", f"npz:{digits16}"),
        ("clients", "expected", CLIENTS), ("clients", "round_timeout", 120.0), ("clients", "presence_timeout", 60.0),
        ("transport", "broker", mosquitto), ("transport", "prefix", zoo_clients), ("train", "lr", 0.02),
    ])
    result = run_federated(config, say=lambda s: None)
    before, after = (json.loads(line) for line in (result.out_dir / "metrics.jsonl").read_text().splitlines())
    assert (after["selected"], after["returned"], after["rejected"], after["failed"]) == (CLIENTS, CLIENTS, 0, 0)
    assert math.isfinite(after["train_loss"]) and after["test_loss"] < before["test_loss"]   # it learned something
    assert ("weight_divergence" in after) == (pan != "none")
    if pan != "none":
        assert "classifier.weight" in after["weight_divergence"]
        assert all(v > 0 for v in after["weight_divergence"].values())

    # What travelled: exactly the model's parameters, never a PAN encoding.
    net = build_model(result.summary["model"])
    hidden = sum(isinstance(m, (nn.Linear, nn.Conv2d)) for m in net.features)
    assert sum(isinstance(m, PositionAwareReLU) for m in net.modules()) == (0 if pan == "none" else hidden)
    params = {n: tuple(p.shape) for n, p in net.named_parameters()}
    assert set(federated_names(net)) == set(params)
    down: set[str] = set()
    results = 0
    while (incoming := spy.get(0.5)) is not None:
        if not incoming.payload:
            continue
        msg = decode(incoming.payload)
        if msg.run_id != result.summary["run_id"] or not msg.tensors:
            continue
        # a codec may add entries NAME:scale, NAME:idx, ...; each still names a parameter
        bases = {name.split(":")[0] for name in msg.tensors}
        assert bases <= set(params), (msg.kind, sorted(bases - set(params)))
        assert not any("encoding" in name for name in msg.tensors)
        assert all(tuple(t.shape) == params[n] for n, t in msg.tensors.items() if ":" not in n)
        if msg.kind == "result":
            results += 1
            assert bases == set(params)
        else:                      # tasks, and the model broadcast they may reference
            down |= bases
    spy.close()
    assert results >= CLIENTS and down == set(params)
