"""What a device loads: the client's run path imports none of the coordinator's or the exporter's heavy parts."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

HEAVY = ("sklearn", "scipy", "matplotlib", "rich", "onnx", "onnxruntime", "amqtt", "pandas", "cryptography",
         "coordinator", "export", "dp_accounting")

PROGRAM = textwrap.dedent("""
    import json, sys
    import numpy as np, torch
    from edge_client import cli, client, registry, bundle                   # the entry point and what run uses
    from edge_client.wire import transport, chunking, codec, updates, compression, protocol
    from edge_client.objectives import LocalData, TaskContext
    from profiling.profiler import Profiler
    x = np.random.default_rng(0).normal(size=(64, 1, 28, 28)).astype(np.float32)
    y = np.arange(64) % 10
    np.savez(sys.argv[1], x=x, y=y)
    data = __import__("edge_client.data", fromlist=["load_dataset"]).load_dataset("npz:" + sys.argv[1])
    own = cli._load_data(cli.build_parser().parse_args(["run", "--data", "npz:" + sys.argv[1], "--client-id", "pi"]))
    model = registry.build_model({"name": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 28})
    local = LocalData(torch.from_numpy(data.x_train), torch.from_numpy(data.y_train))
    ctx = TaskContext(seed=0, round=1, client_id="pi", state_dir=None, profiler=Profiler())
    registry.OBJECTIVES["train"](model, local, {"epochs": 1, "batch_size": 32}, ctx)   # a real local step
    wire = codec.parse_codec("topk:0.1+int8+zstd")
    print(json.dumps(sorted(m.split(".")[0] for m in sys.modules)))
""")


def test_the_device_path_loads_nothing_heavy(tmp_path):
    out = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path / "own.npz")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = set(json.loads(out.stdout.splitlines()[-1]))
    assert {"torch", "paho", "safetensors", "edge_client"} <= loaded
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))
