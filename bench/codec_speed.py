"""Size, error and encode/decode time of each upload codec, on one core, for one real cnn update.

The update is real: the `cnn` (421,834 parameters) trained for one local epoch on
one Dirichlet(0.5) shard of Fashion-MNIST (of 10), from a fixed initialization;
the client sends the difference from the model it received. For each codec the
whole path a result takes is timed, as the client and the coordinator run it:

- encode: difference + error feedback + codec (``encode_upload``), envelope and compression;
- decode: decompression, envelope checks, codec checks and adding the difference back
  (``decode`` + ``decode_upload``).

Reported: bytes on the wire, how many times smaller than float32, the relative error
of the update received (||sent - true|| / ||true||, one round, before error feedback
makes up for it), the median encode and decode times over the repeats, and the memory
one encode takes: how far the process's resident memory rose above where it stood (the
kernel's high-water mark, reset just before, with glibc's free heap given back first, so
that the encode cannot hide in memory freed earlier), on the ``cnn``'s update and on one larger one:
a single ``[4000, 1000]`` weight's difference (``--large``, Gaussian: the memory an encode takes depends
on the sizes, not on the values), where a device's own larger model would feel it. For
``lowrank`` that round is a run's first, from a random Q (no warm start yet). Writes
bench/results/codec_speed.json.

    python bench/codec_speed.py [--repeats 20] [--data fashion-mnist] [--large 4000000]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch
from rich.console import Console
from rich.table import Table

from edge_client.wire.codec import parse_codec
from edge_client.data import client_split, load_dataset
from edge_client.models import federated_names
from edge_client.registry import build_model
from edge_client.objectives import LocalData, TaskContext, train
from edge_client.wire.protocol import ResultBody, UploadSettings, decode, encode
from edge_client.wire.updates import ResidualStore, decode_upload, encode_upload
from edge_client.heap import give_back_freed_memory
from profiling.profiler import Profiler, peak_rss_since_reset, reset_peak_rss

RESULTS = Path(__file__).resolve().parent / "results"
CODECS = ["fp32", "fp32+zstd", "fp32+lz4", "fp16", "fp16+zstd", "bf16+zstd", "int8", "int8+zstd",
          "int8:stochastic+zstd", "topk:0.1", "topk:0.1+int8", "topk:0.1+int8+zstd", "topk:0.1+int8+lz4",
          "topk:0.01+int8", "topk:0.01+int8+zstd", "eden", "eden+zstd", "eden+lz4", "eden:0.25", "eden:0.2", "lowrank:4", "lowrank:4+fp16",
          "lowrank:4+int8", "lowrank:4+int8+zstd", "lowrank:2+int8+zstd", "lowrank:8+int8+zstd"]


def real_update(data_spec: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """(trained, received) parameters of one client after one local epoch, and the model spec."""
    dataset = load_dataset(data_spec)
    x, y = client_split(dataset, "dirichlet:0.5", 0, 10, 0)
    spec = {"name": "cnn", "num_classes": dataset.num_classes, "in_channels": dataset.in_channels,
            "image_size": dataset.image_size}
    torch.manual_seed(0)
    model = build_model(spec)
    names = federated_names(model)
    received = {k: v.detach().clone() for k, v in model.state_dict().items() if k in names}
    ctx = TaskContext(seed=0, round=1, client_id="bench", state_dir=None, profiler=Profiler())
    train(model, LocalData(torch.from_numpy(x), torch.from_numpy(y)),
          {"epochs": 1, "batch_size": 64, "lr": 0.05, "momentum": 0.9}, ctx)
    trained = {k: v.detach().clone() for k, v in model.state_dict().items() if k in names}
    return trained, received, {"spec": spec, "samples": len(y)}


def encoded(trained, received, spec, settings: UploadSettings) -> bytes:
    """A result message as a device sends it, from the first round of a run (no residual yet)."""
    wire, delta = encode_upload(trained, received, settings, ResidualStore(None), "bench")
    body = ResultBody(num_samples=1, codec=spec, delta=tuple(delta))
    return encode("result", run_id="bench", round=1, task_id="t", sender="bench", body=body.to_body(),
                  tensors=wire, compression=spec)


def encode_memory(trained, received, spec, settings: UploadSettings) -> int | None:
    """Bytes by which one encode raised the resident memory above where it stood; None off Linux."""
    give_back_freed_memory()
    reset_peak_rss()
    before = psutil.Process().memory_info().rss
    encoded(trained, received, spec, settings)
    peak = peak_rss_since_reset()
    return None if peak is None else max(peak - before, 0)


def large_update(params: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(trained, received) of one ``[params / 1000, 1000]`` weight, its difference Gaussian."""
    g = torch.Generator().manual_seed(0)
    received = torch.zeros(params // 1000, 1000)
    return {"w": received + 0.01 * torch.randn(received.shape, generator=g)}, {"w": received}


def measure(text: str, trained, received, repeats: int, large) -> dict:
    spec = parse_codec(text)
    # error feedback as the matrix runs it: off where it would diverge (eden with a share below pi/4)
    settings = UploadSettings(spec, "delta", error_feedback=not text.startswith("eden:"))
    shapes = {k: tuple(v.shape) for k, v in trained.items()}
    memory = encode_memory(trained, received, spec, settings)
    large_memory = encode_memory(*large, spec, settings)
    encode_s, decode_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        payload = encoded(trained, received, spec, settings)
        t1 = time.perf_counter()
        msg = decode(payload)
        got = decode_upload(msg.tensors, ResultBody.from_body(msg.body), shapes, received)
        t2 = time.perf_counter()
        encode_s.append(t1 - t0)
        decode_s.append(t2 - t1)
    true = torch.cat([(trained[k] - received[k]).reshape(-1) for k in trained])
    sent = torch.cat([(got[k] - received[k]).reshape(-1) for k in trained])
    return {"codec": spec.text, "bytes": len(payload), "error": float((sent - true).norm() / true.norm()),
            "encode_ms": 1000 * statistics.median(encode_s), "decode_ms": 1000 * statistics.median(decode_s),
            "encode_memory_kib": None if memory is None else memory / 1024,
            "encode_memory_large_kib": None if large_memory is None else large_memory / 1024}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed repetitions per codec (default 20)")
    parser.add_argument("--data", default="fashion-mnist", help="data spec (default fashion-mnist)")
    parser.add_argument("--large", type=int, default=4_000_000,
                        help="parameters of the larger update whose encode memory is measured too (default 4000000)")
    parser.add_argument("--out", type=Path, default=RESULTS / "codec_speed.json", help="JSON result file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    console = Console(width=None if sys.stdout.isatty() else 120)
    trained, received, info = real_update(args.data)
    params = sum(v.numel() for v in trained.values())
    large = large_update(args.large)
    rows = [measure(text, trained, received, args.repeats, large) for text in CODECS]
    fp32_bytes = next(r["bytes"] for r in rows if r["codec"] == "fp32")
    for r in rows:
        r["times_smaller"] = fp32_bytes / r["bytes"]
    table = Table(title=f"upload codecs: one cnn update ({params:,} parameters), one core, median of {args.repeats}")
    for name in ("codec", "bytes", "x smaller", "rel. error", "encode ms", "decode ms", "encode KiB",
                 f"encode KiB, {args.large:,}"):
        table.add_column(name, justify="left" if name == "codec" else "right", no_wrap=True)
    for r in rows:
        table.add_row(r["codec"], f"{r['bytes']:,}", f"{r['times_smaller']:.1f}", f"{r['error']:.4f}",
                      f"{r['encode_ms']:.1f}", f"{r['decode_ms']:.1f}",
                      *("-" if r[k] is None else f"{r[k]:,.0f}" for k in ("encode_memory_kib", "encode_memory_large_kib")))
    console.print(table)
    report = {"setting": {"data": args.data, "model": info["spec"], "parameters": params,
                          "update": "one local epoch (batch 64, lr 0.05, momentum 0.9) on Dirichlet(0.5) shard 0 "
                                    f"of 10 ({info['samples']} samples), as a difference",
                          "threads": 1, "repeats": args.repeats,
                          "encode": "encode_upload (difference, error feedback, codec) + envelope + compression",
                          "decode": "decompression + envelope checks + body parsing + decode_upload (codec checks, "
                                    "add back)",
                          "error": "||received update - true update|| / ||true update||, one round",
                          "encode_memory": "peak RSS during one encode above the RSS before it (VmHWM reset, "
                                           "malloc_trim first), KiB",
                          "large": f"one [{args.large // 1000}, 1000] weight, Gaussian difference (std 0.01)"},
              "machine": {"python": platform.python_version(), "torch": torch.__version__,
                          "arch": platform.machine(), "cpus": os.cpu_count()},
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
