"""How much memory a device's client process holds, phase by phase, against torch's own footprint.

A device-like client: its own npz of 6,000 Fashion-MNIST training images, model ``cnn``,
one local epoch (batch 64), results sent with the ``topk:0.1+int8+zstd`` codec, over a
local Mosquitto to a coordinator in this process. The client runs as ``fedge-client
run`` in its own process; this script samples that process's RSS and USS (psutil, every
``--every`` seconds) and assigns each sample to a phase:

- ``start-up``: from the process start until it says it is online (imports, its data,
  the connection);
- ``idle``: online, no task (before the first task and between tasks);
- ``receive + decode``, ``train``, ``encode + send``: inside a task, from the phase
  times the client itself writes to its profile history (``profile.jsonl``: each task's
  end time and the seconds of each phase, laid back from the end).

The client also writes a memory trace (``FEDGE_MEMORY_TRACE``, :mod:`profiling.memory_trace`):
at each of its marks the kernel's exact peak RSS since the previous mark, the RSS then, its
anonymous memory and glibc's heap (in use, and freed but kept). Those give the breakdown by
phase (:data:`MARKS`): imports, data, model, weights, optimizer, training, codec, message, publish.

The baselines are fresh interpreters that import torch and nothing else, and torch with
the rest of the client's libraries (numpy, paho-mqtt, safetensors, zstandard). The goal
for a device: peak RSS at most torch's import footprint + 100 MB.

    python bench/device_footprint.py [--rounds 3] [--samples 6000] [--every 0.05]

Prints the table and writes ``bench/results/device_footprint.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench_io import RESULTS, write_result
from coordinator.config import load_config
from coordinator.ops.flash_kit import LOW_MEMORY_ENV
from coordinator.ops.mosquitto import LocalMosquitto
from coordinator.runtime.run import run_federated
from edge_client.data import FASHION_MNIST_DIR, read_fashion_mnist

MB = 2**20
PHASES = ("start-up", "idle", "receive + decode", "train", "encode + send")
# profile phases laid back from a task's end, last first, and the reported phase each belongs to
TASK_PHASES = (("publish", "encode + send"), ("encode", "encode + send"), ("codec", "encode + send"),
               ("train", "train"), ("fetch_model", "receive + decode"), ("decode", "receive + decode"),
               ("receive", "receive + decode"))
# The client's memory-trace marks, in the order a task passes them, and what each phase did.
MARKS = {"interpreter": "Python and fedge's command line", "imports": "import torch, numpy, paho, fedge's client",
         "data": "its npz loaded (pixels)", "connected": "connected to the broker",
         "online": "subscribed, warm-up, announced", "received": "a message received and decoded (broadcast, task)",
         "model": "model built", "inputs": "inputs normalized as the model spec says",
         "weights": "received weights decoded and loaded", "optimizer": "optimizer built",
         "training": "training (one epoch)", "codec": "update encoded (codec)",
         "message": "result message assembled (envelope)", "published": "published (chunks)",
         "memory given back": "the task's freed memory given back (malloc_trim)"}
BASELINES = {"import torch": "import torch",
             "import torch, numpy, paho, safetensors, zstandard":
                 "import torch, numpy, paho.mqtt.client, safetensors.torch, zstandard"}


def _memory(process: psutil.Process) -> tuple[int, int | None]:
    """(RSS, USS) in bytes; USS None where psutil cannot read it."""
    try:
        full = process.memory_full_info()
        return full.rss, full.uss
    except psutil.AccessDenied:
        return process.memory_info().rss, None


def baseline(code: str) -> dict[str, float]:
    """RSS and USS of a fresh interpreter after running ``code``, in MB."""
    probe = (f"{code}\nimport psutil\nm = psutil.Process().memory_full_info()\n"
             "print(m.rss, m.uss)")
    rss, uss = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                              timeout=300).stdout.split()
    return {"rss_mb": int(rss) / MB, "uss_mb": int(uss) / MB}


def device_npz(path: Path, samples: int, seed: int = 0) -> Path:
    """A device's own data: ``samples`` Fashion-MNIST training images (uint8) and labels."""
    images, labels = read_fashion_mnist(Path(FASHION_MNIST_DIR), "train")
    rows = np.sort(np.random.default_rng(seed).choice(len(labels), samples, replace=False))
    np.savez(path, x=images[rows], y=labels[rows])
    return path


def task_intervals(history: Path) -> list[tuple[float, float, str]]:
    """(start, end, phase) of every task phase the client recorded, on the wall clock."""
    spans = []
    for line in history.read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") != "task":
            continue
        end, phases = record["time"], record.get("phases") or {}
        for name, phase in TASK_PHASES:
            seconds = phases.get(name, 0.0)
            spans.append((end - seconds, end, phase))
            end -= seconds
    return spans


def phase_of(t: float, online_at: float | None, spans: list[tuple[float, float, str]]) -> str:
    if online_at is None or t < online_at:
        return "start-up"
    return next((phase for start, end, phase in spans if start <= t <= end), "idle")


TRACE_FIELDS = {"peak_rss_mb": "peak_rss_bytes", "rss_mb": "rss_bytes", "anon_mb": "anon_bytes",
                "heap_in_use_mb": "heap_in_use_bytes", "heap_free_kept_mb": "heap_free_kept_bytes"}


def breakdown(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per mark of the client's memory trace, its first pass (the first task's, in MB): the phase's peak RSS,
    the RSS at its end, anonymous memory, glibc's heap in use and freed but kept; the loaded modules; and
    over all its passes (later tasks too) how many there were and the largest peak."""
    rows: dict[str, dict[str, Any]] = {}
    for record in records:
        row = rows.get(record["mark"])
        if row is None:
            row = rows[record["mark"]] = {name: record[key] / MB for name, key in TRACE_FIELDS.items()
                                          if record.get(key) is not None}
            row.update(modules=record.get("modules"), passes=0, largest_peak_rss_mb=0.0)
        row["passes"] += 1
        row["largest_peak_rss_mb"] = max(row["largest_peak_rss_mb"], (record.get("peak_rss_bytes") or 0) / MB)
    return {mark: rows[mark] for mark in [*MARKS, *sorted(set(rows) - set(MARKS))] if mark in rows}


def measure(workdir: Path, *, rounds: int, samples: int, every: float,
            env: dict[str, str] | None = None) -> dict[str, Any]:
    data = device_npz(workdir / "own.npz", samples)
    broker = LocalMosquitto(workdir=workdir / "mosquitto")
    broker.start()
    state = workdir / "state"
    try:
        sets = {"run.rounds": rounds, "run.out": str(workdir / "run"), "model.name": "cnn",
                "data.eval": "fashion-mnist", "clients.expected": 1, "clients.spawn": 0,
                "clients.round_timeout": 600.0, "clients.presence_timeout": 300.0, "transport.broker": broker.url,
                "transport.prefix": "footprint", "codec.up": "topk:0.1+int8+zstd", "train.epochs": 1,
                "train.batch_size": 64, "train.lr": 0.02, "eval.every": rounds, "export.enabled": False}
        config = load_config(None, [(*k.split(".", 1), v) for k, v in sets.items()])
        cmd = [sys.executable, "-m", "edge_client.cli", "run", "--broker", broker.url, "--client-id", "pi-01",
               "--data", f"npz:{data}", "--state-dir", str(state), "--prefix", "footprint", "--torch-threads", "1",
               "--device", "cpu", "--exit-after-run"]
        started = time.time()
        trace = workdir / "memory.jsonl"
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "FEDGE_MEMORY_TRACE": str(trace),
                                     **(env or {})})
        online: list[float] = []
        lines: list[str] = []

        def read_stderr() -> None:
            for line in proc.stderr:   # type: ignore[union-attr]
                lines.append(line.rstrip())
                if "online with" in line and not online:
                    online.append(time.time())

        reader = threading.Thread(target=read_stderr, daemon=True)
        reader.start()
        samples_taken: list[tuple[float, int, int | None]] = []
        process = psutil.Process(proc.pid)

        def sample() -> None:
            while proc.poll() is None:
                try:
                    rss, uss = _memory(process)
                except psutil.NoSuchProcess:
                    break
                samples_taken.append((time.time(), rss, uss))
                time.sleep(every)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        run_federated(config, say=lambda s: None)
        proc.wait(120)
        sampler.join(10)
        reader.join(10)
    finally:
        broker.stop()
    spans = task_intervals(state / "profile.jsonl")
    online_at = online[0] if online else None
    table: dict[str, dict[str, Any]] = {}
    for t, rss, uss in samples_taken:
        row = table.setdefault(phase_of(t, online_at, spans), {"samples": 0, "peak_rss_mb": 0.0, "peak_uss_mb": None})
        row["samples"] += 1
        row["peak_rss_mb"] = max(row["peak_rss_mb"], rss / MB)
        if uss is not None:
            row["peak_uss_mb"] = max(row["peak_uss_mb"] or 0.0, uss / MB)
    tasks = [json.loads(line) for line in (state / "profile.jsonl").read_text().splitlines()]
    tasks = [t for t in tasks if t.get("kind") == "task"]
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    return {"phases": {p: table[p] for p in PHASES if p in table}, "marks": breakdown(records), "trace": records,
            "peak_rss_mb": max(r for _, r, _ in samples_taken) / MB,
            "peak_uss_mb": max((u for _, _, u in samples_taken if u is not None), default=0) / MB,
            "client_reported_peak_rss_mb": max(t.get("peak_rss_bytes") or 0 for t in tasks) / MB,
            "train_seconds": [round((t.get("phases") or {}).get("train", 0.0), 3) for t in tasks],
            "task_cpu_seconds": [round(t["seconds"] * t["cpu_percent"] / 100, 3) for t in tasks
                                 if t.get("seconds") and t.get("cpu_percent") is not None],
            "tasks": len(tasks), "seconds": time.time() - started, "samples_taken": len(samples_taken),
            "online_after_seconds": (online_at - started) if online_at else None,
            "client_log_tail": lines[-5:]}


def print_breakdown(marks: dict[str, dict[str, Any]]) -> None:
    """The memory trace's breakdown by phase: its first pass (MB), and the largest peak of all passes."""
    print(f"\n{'phase (memory trace, first pass)':52s} {'peak RSS':>9s} {'RSS after':>9s} {'anon':>7s} "
          f"{'heap used':>9s} {'heap kept':>9s} {'modules':>7s} {'largest peak':>12s}")
    for mark, row in marks.items():
        cells = [f"{row.get(k, float('nan')):{w}.1f}" for k, w in (("peak_rss_mb", 9), ("rss_mb", 9), ("anon_mb", 7),
                                                                   ("heap_in_use_mb", 9), ("heap_free_kept_mb", 9))]
        print(f"{mark + ': ' + MARKS.get(mark, ''):52.52s} {' '.join(cells)} {row['modules'] or 0:7d} "
              f"{row['largest_peak_rss_mb']:12.1f} ({row['passes']}x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds (one task each) the device runs (default 3)")
    parser.add_argument("--samples", type=int, default=6000, help="images in the device's own npz (default 6000)")
    parser.add_argument("--every", type=float, default=0.05, help="seconds between memory samples (default 0.05)")
    parser.add_argument("--low-memory", action="store_true",
                        help="run the client with the allocator settings of a flash kit's --low-memory")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="another setting in the client's environment (repeatable), e.g. an allocator's")
    parser.add_argument("--out", type=Path, default=None,
                        help="default bench/results/device_footprint.json (device_footprint_low_memory.json)")
    args = parser.parse_args(argv)
    env = dict(LOW_MEMORY_ENV) if args.low_memory else {}
    for setting in args.env:
        key, sep, value = setting.partition("=")
        if not sep or not key:
            parser.error(f"--env takes KEY=VALUE, got {setting!r}")
        env[key] = value
    out = args.out or RESULTS / ("device_footprint_low_memory.json" if args.low_memory else "device_footprint.json")
    print("baselines (fresh interpreters) ...", flush=True)
    baselines = {name: baseline(code) for name, code in BASELINES.items()}
    print(f"device client: {args.samples} images, cnn, {args.rounds} rounds, topk:0.1+int8+zstd ...", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        device = measure(Path(scratch), rounds=args.rounds, samples=args.samples, every=args.every, env=env)
    torch_rss = baselines["import torch"]["rss_mb"]
    print(f"\n{'':52s} {'peak RSS MB':>12s} {'peak USS MB':>12s}")
    for name, b in baselines.items():
        print(f"{name:52s} {b['rss_mb']:12.1f} {b['uss_mb']:12.1f}")
    for phase, row in device["phases"].items():
        uss = f"{row['peak_uss_mb']:12.1f}" if row["peak_uss_mb"] is not None else f"{'-':>12s}"
        print(f"{'client: ' + phase:52s} {row['peak_rss_mb']:12.1f} {uss}  ({row['samples']} samples)")
    goal = torch_rss + 100
    print_breakdown(device["marks"])
    print(f"{'client: whole run':52s} {device['peak_rss_mb']:12.1f} {device['peak_uss_mb']:12.1f}")
    print(f"training per task: {', '.join(f'{s:.2f}' for s in device['train_seconds'])} s; the task's CPU time: "
          f"{', '.join(f'{s:.2f}' for s in device['task_cpu_seconds'])} s")
    print(f"\ngoal: peak RSS <= torch's import footprint + 100 MB = {goal:.0f} MB: "
          f"{'met' if device['peak_rss_mb'] <= goal else 'missed'} ({device['peak_rss_mb'] - torch_rss:+.0f} MB "
          "over torch alone)")
    result = {"samples": args.samples, "rounds": args.rounds, "model": "cnn", "codec_up": "topk:0.1+int8+zstd",
              "sample_every_seconds": args.every, "client_env": env, "baselines": baselines, "device": device,
              "goal_rss_mb": goal, "goal_met": device["peak_rss_mb"] <= goal}
    write_result(out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
