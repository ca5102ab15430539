"""One device task, replayed outside the run so two machines can be compared tensor by tensor.

Run with the same arguments on this machine and on the emulated aarch64 device: it builds the
run's model, loads the global weights of a checkpoint, trains on a device's npz with the run's
hyperparameters and a fixed seed (edge_client.objectives.train, what a device's training task
runs), and encodes the update with the upload codec (edge_client.wire.updates.encode_upload).
It writes the trained weights and the wire tensors (safetensors) and a JSON line of facts.
Only the ``client`` extra is needed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from edge_client.inputs import load_device_data
from edge_client.objectives import TaskContext, train
from edge_client.registry import build_model
from edge_client.wire.bodies import UploadSettings
from edge_client.wire.codec import parse_codec
from edge_client.wire.updates import ResidualStore, encode_upload
from profiling.profiler import Profiler


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--spec", required=True, help="the model spec, JSON")
    parser.add_argument("--hyper", required=True, help="training hyperparameters, JSON")
    parser.add_argument("--data", required=True, help="npz:PATH")
    parser.add_argument("--codec", default="topk:0.1+int8+zstd")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(json.loads(args.spec))
    state = model.state_dict()
    saved = load_file(args.checkpoint)
    model.load_state_dict({k: saved[k] if k in saved else v for k, v in state.items()})
    received = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = load_device_data(args.data, 0.0, seed=0, client_id="replay")
    ctx = TaskContext(seed=args.seed, round=1, client_id="replay", state_dir=None, profiler=Profiler())
    started = time.perf_counter()
    got = train(model, data, json.loads(args.hyper), ctx)
    seconds = time.perf_counter() - started
    trained = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    params = {k: trained[k] for k, _ in model.named_parameters()}
    wire, _ = encode_upload(params, received, UploadSettings(codec=parse_codec(args.codec), update="delta",
                                                             error_feedback=True), ResidualStore(None), "replay")
    save_file(trained, str(out / "trained.safetensors"))
    save_file({k: v.contiguous() for k, v in wire.items()}, str(out / "wire.safetensors"))
    facts = {"machine": platform.machine(), "torch": torch.__version__, "train_seconds": round(seconds, 3),
             "samples": got.num_samples, "train_loss": got.metrics["train_loss"]}
    (out / "facts.json").write_text(json.dumps(facts) + "\n")
    print(json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
