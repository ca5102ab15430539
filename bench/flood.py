"""One device's result topic flooded at full speed during a run: what is dropped, what still counts.

A 6-round run on scikit-learn's digits over a local Mosquitto with 3 client processes,
once undisturbed and once while this process publishes ``--messages`` garbage,
truncated and oversized messages (QoS 0, as fast as paho sends them) on the result
topic of one of the devices. Prints each flooded round's results, rejections, drops by
reason and seconds, and both runs' peak RSS; writes ``bench/results/flood.json``.

    python bench/flood.py [--messages 50000]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import psutil
from paho.mqtt.enums import CallbackAPIVersion

from bench_io import RESULTS, write_result
from coordinator.config import load_config
from coordinator.ops.mosquitto import LocalMosquitto
from coordinator.runtime.run import run_federated

FLOODED = "sim-002"


def flooded_run(out: Path, broker: str, prefix: str, messages: int) -> tuple[list[dict[str, Any]], float]:
    """The run's ``metrics.jsonl`` rows and this process's peak RSS in MB, with ``messages`` published
    on the flooded device's result topic once the run has started (none: an undisturbed run)."""
    sets = {"run.rounds": 6, "run.out": str(out), "model.name": "cnn", "data.eval": "digits",
            "clients.expected": 3, "clients.spawn": 3, "clients.min_results": 2, "clients.round_timeout": 30.0,
            "clients.presence_timeout": 60.0, "transport.broker": broker, "transport.prefix": prefix,
            "export.enabled": False}
    config = load_config(None, [(*k.split(".", 1), v) for k, v in sets.items()])
    me, peak, stop = psutil.Process(), [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], me.memory_info().rss)
            time.sleep(0.02)

    def flooder() -> None:
        host, port = broker.removeprefix("mqtt://").split(":")
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"flood-{uuid.uuid4().hex[:8]}")
        client.connect(host, int(port))
        client.loop_start()
        while not (out / "metrics.jsonl").exists() and not stop.is_set():
            time.sleep(0.01)
        for i in range(messages):
            client.publish(f"{prefix}/clients/{FLOODED}/result", bytes([i % 251]) * (1 + i % 700), qos=0)
        client.loop_stop()
        client.disconnect()

    threads = [threading.Thread(target=watch, daemon=True)]
    if messages:
        threads.append(threading.Thread(target=flooder, daemon=True))
    for t in threads:
        t.start()
    try:
        run_federated(config, say=lambda s: None)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], peak[0] / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--out", type=Path, default=RESULTS / "flood.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        broker = LocalMosquitto(workdir=Path(scratch) / "mosquitto")
        broker.start()
        try:
            _, calm_mb = flooded_run(Path(scratch) / "calm", broker.url, "calm", 0)
            rows, flooded_mb = flooded_run(Path(scratch) / "flooded", broker.url, "flooded", args.messages)
        finally:
            broker.stop()
    print("round  returned  rejected  dropped on arrival                     seconds  accuracy")
    for r in rows[1:]:
        print(f"{r['round']:5d}  {r['returned']:8d}  {r['rejected']:8d}  {json.dumps(r.get('inbox_dropped', {})):37s}"
              f"  {r['seconds']:7.2f}  {r['test_accuracy']:.3f}")
    print(f"peak RSS: {calm_mb:.0f} MB undisturbed, {flooded_mb:.0f} MB flooded")
    result = {"messages": args.messages, "flooded_device": FLOODED, "rows": rows[1:],
              "peak_rss_mb": {"undisturbed": calm_mb, "flooded": flooded_mb}}
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
