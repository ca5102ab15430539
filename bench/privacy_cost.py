"""What differential privacy costs a device and the coordinator per round, in seconds and bytes.

The update is the real one ``bench/codec_speed.py`` times: the ``cnn`` (421,834 parameters) after one
local epoch on one Dirichlet(0.5) shard of Fashion-MNIST, sent as a difference. For each upload codec
the device's whole encoding path is timed as a device runs it (``encode_clipped_upload``: difference,
error feedback, clipping, local noise, codec; then the envelope and compression) in three modes:

- ``off``: no clipping (``privacy.mode = "off"``);
- ``central``: clipped to ``--clip`` (``privacy.mode = "central"``; the device adds nothing else);
- ``local``: clipped, then N(0, (z C)^2) per coordinate from the OS's entropy (``privacy.mode = "local"``,
  z = ``--local-z``: 4.033 is epsilon 8 over 10 participations at delta 1e-5).

Reported per codec and mode: the result message's bytes and the median encode time over the repeats;
the coordinator's extra work under central DP, the noise on the folded sum of one round
(``noisy_mean``), is timed on the same shapes. Noise makes a lossless compressor's job harder (and a
top-k codec keeps noise, not signal), which the bytes show. Writes bench/results/privacy_cost.json.

    python bench/privacy_cost.py [--repeats 20] [--clip 0.6] [--local-z 4.033] [--data fashion-mnist]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import RESULTS, write_result  # noqa: E402
from codec_speed import real_update  # noqa: E402
from coordinator.aggregation import WeightedSum  # noqa: E402
from coordinator.privacy import fresh_generator, noisy_mean  # noqa: E402
from edge_client.wire.codec import parse_codec  # noqa: E402
from edge_client.wire.protocol import ResultBody, UploadSettings, encode  # noqa: E402
from edge_client.wire.updates import ResidualStore, encode_clipped_upload  # noqa: E402

CODECS = ["fp32", "fp32+zstd", "int8+zstd", "topk:0.1+int8+zstd"]


def device_cost(codec: str, mode: str, trained, received, clip: float, z: float, repeats: int) -> dict:
    """Bytes and median seconds of one result's encoding in ``mode`` (a fresh run each time: no residual)."""
    spec = parse_codec(codec)
    settings = UploadSettings(spec, "delta", error_feedback=spec.lossy,
                              clip_norm=None if mode == "off" else clip,
                              noise_multiplier=z if mode == "local" else None)
    seconds, size = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        wire, delta, _ = encode_clipped_upload(trained, received, settings, ResidualStore(None), "bench")
        body = ResultBody(num_samples=1, codec=spec, delta=tuple(delta))
        payload = encode("result", run_id="bench", round=1, task_id="t", sender="bench", body=body.to_body(),
                         tensors=wire, compression=spec)
        seconds.append(time.perf_counter() - t0)
        size = len(payload)
    return {"codec": spec.text, "mode": mode, "bytes": size, "encode_ms": 1000 * statistics.median(seconds)}


def coordinator_noise_ms(shapes: dict[str, tuple[int, ...]], repeats: int) -> float:
    """Median milliseconds of the coordinator's one extra step under central DP: noise on a round's sum."""
    total = WeightedSum({k: torch.zeros(s, dtype=torch.float64) for k, s in shapes.items()}, 10.0)
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        noisy_mean(total, 0.6, 10, fresh_generator())
        seconds.append(time.perf_counter() - t0)
    return 1000 * statistics.median(seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed repetitions per cell (default 20)")
    parser.add_argument("--clip", type=float, default=0.6, help="the clip norm C (default 0.6)")
    parser.add_argument("--local-z", type=float, default=4.033, help="local DP's noise multiplier (default 4.033)")
    parser.add_argument("--data", default="fashion-mnist", help="data spec (default fashion-mnist)")
    parser.add_argument("--out", type=Path, default=RESULTS / "privacy_cost.json", help="JSON result file")
    args = parser.parse_args()
    if args.repeats < 1 or not args.clip > 0 or not args.local_z > 0:
        parser.error("--repeats, --clip and --local-z must be positive")
    torch.set_num_threads(1)
    console = Console(width=None if sys.stdout.isatty() else 120)
    console.print("training the update (one local epoch)...")
    trained, received, info = real_update(args.data)
    norm = float(torch.cat([(trained[k] - received[k]).reshape(-1) for k in trained]).norm())
    rows = []
    for codec in CODECS:
        for mode in ("off", "central", "local"):
            rows.append(device_cost(codec, mode, trained, received, args.clip, args.local_z, args.repeats))
            console.print(f"  {codec:<20} {mode:<8} {rows[-1]['bytes']:>10,} bytes {rows[-1]['encode_ms']:8.1f} ms")
    plain = {r["codec"]: r for r in rows if r["mode"] == "off"}
    for r in rows:
        r["bytes_vs_off"] = r["bytes"] / plain[r["codec"]]["bytes"]
        r["encode_ms_vs_off"] = r["encode_ms"] - plain[r["codec"]]["encode_ms"]
    noise_ms = coordinator_noise_ms({k: tuple(v.shape) for k, v in trained.items()}, args.repeats)
    table = Table(title=f"DP on one cnn update (norm {norm:.3f}, C {args.clip}, local z {args.local_z}), one core, "
                        f"median of {args.repeats}")
    for name in ("codec", "mode", "bytes", "x off", "encode ms", "+ms vs off"):
        table.add_column(name, justify="left" if name in ("codec", "mode") else "right", no_wrap=True)
    for r in rows:
        table.add_row(r["codec"], r["mode"], f"{r['bytes']:,}", f"{r['bytes_vs_off']:.2f}", f"{r['encode_ms']:.1f}",
                      f"{r['encode_ms_vs_off']:+.1f}")
    console.print(table)
    console.print(f"coordinator, central DP: noise on one round's sum {noise_ms:.1f} ms")
    write_result(args.out, {
        "setting": {"data": args.data, "model": info["spec"], "update_norm": norm, "clip_norm": args.clip,
                    "local_noise_multiplier": args.local_z, "repeats": args.repeats, "threads": 1,
                    "encode": "encode_clipped_upload (difference, error feedback for lossy codecs, clipping, local "
                              "noise) + envelope + compression, a fresh residual store each time",
                    "coordinator_noise": "noisy_mean on a float64 sum of the cnn's shapes, denominator 10"},
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "arch": platform.machine(),
                    "cpus": os.cpu_count()},
        "rows": rows, "coordinator_noise_ms": noise_ms})
    return 0


if __name__ == "__main__":
    sys.exit(main())
