"""A device holds its data once: what loading, normalizing and serving it keep, and what they give back."""

from __future__ import annotations

import gc
import signal
import sys
import weakref

import numpy as np
import pytest

from edge_client import cli
from edge_client.heap import give_back_freed_memory
from edge_client.partitions import holdout_split
from storage.pixels import Normalization


def test_holding_out_nothing_keeps_the_rows_without_copying_them():
    x = np.arange(2 * 1 * 4 * 4, dtype=np.float32).reshape(2, 1, 4, 4)
    y = np.array([0, 1])
    x_tr, y_tr, x_te, y_te = holdout_split(x, y, 0.0, seed=3)
    assert np.shares_memory(x_tr, x) and np.shares_memory(y_tr, y)
    assert x_te.shape == (0, 1, 4, 4) and y_te.shape == (0,)
    held = holdout_split(x, y, 0.5, seed=3)   # holding some out still copies the rows it keeps
    assert not np.shares_memory(held[0], x)


def test_normalizing_in_place_gives_the_same_bits_as_before():
    pixels = np.random.default_rng(0).integers(0, 256, size=(50, 3, 8, 8), dtype=np.uint8)
    norm = Normalization((0.2860, 0.5, 0.1), (0.3530, 0.25, 0.7))
    mean = np.array(norm.mean, np.float64).reshape(1, -1, 1, 1)
    std = np.array(norm.std, np.float64).reshape(1, -1, 1, 1)
    two_arrays = pixels * (1.0 / (255.0 * std)).astype(np.float32) - (mean / std).astype(np.float32)
    got = norm.apply(pixels, 255.0)
    assert got.dtype == np.float32 and got.tobytes() == two_arrays.tobytes()


def test_the_command_line_hands_the_client_the_only_reference_to_the_data(tmp_path, monkeypatch):
    """A task whose model normalizes otherwise makes the inputs again; the first ones must then be freed, so
    nothing between loading the data and the client may keep them (a whole second copy of a device's data)."""
    from edge_client import client as client_module
    from edge_client.wire import transport as transport_module

    np.savez(tmp_path / "own.npz", x=np.zeros((20, 28, 28), np.uint8), y=np.arange(20) % 10)
    seen = {}

    class Transport:
        settings = type("S", (), {"url": "mqtt://127.0.0.1:1"})()
        client_id, protocol = "pi-01", "5"

        def __init__(self, *args, **kwargs) -> None:
            pass

        def connect(self) -> None:
            pass

        def publish(self, *args, **kwargs) -> None:
            pass

        def close(self) -> None:
            pass

    class Client:
        will = staticmethod(client_module.EdgeClient.will)

        def __init__(self, settings, transport, data) -> None:
            seen["x"] = weakref.ref(data.x)

        def run(self, stop) -> None:
            gc.collect()
            seen["alive"] = seen["x"]() is not None

    monkeypatch.setattr(transport_module, "MqttTransport", Transport)
    monkeypatch.setattr(client_module, "EdgeClient", Client)
    monkeypatch.setattr(cli.time, "sleep", lambda s: None)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    code = cli.main(["run", "--data", f"npz:{tmp_path / 'own.npz'}", "--client-id", "pi-01", "--broker",
                     "mqtt://127.0.0.1:1", "--state-dir", str(tmp_path / "state"), "--device", "cpu"])
    # called in-process, the command gives this process its own signal handlers back
    assert {signum: signal.getsignal(signum) for signum in handlers} == handlers
    assert code == 0 and seen["alive"] is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_memory_goes_back_on_glibc():
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")
    assert give_back_freed_memory() is True


TRACED = """
import sys
from profiling import memory_trace, profiler
profiler.reset_peak_rss()
big = b"x" * (64 << 20)   # written, so resident
del big
memory_trace.mark("spike")
memory_trace.mark("quiet")
print(profiler.peak_rss_since_reset())
"""


def test_a_memory_trace_gives_each_phase_its_own_peak_and_the_task_its_whole_one(tmp_path):
    import json
    import os
    import subprocess

    trace = tmp_path / "memory.jsonl"
    out = subprocess.run([sys.executable, "-c", TRACED], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "FEDGE_MEMORY_TRACE": str(trace)})
    assert out.returncode == 0, out.stderr
    spike, quiet = (json.loads(line) for line in trace.read_text().splitlines())
    assert (spike["mark"], quiet["mark"]) == ("spike", "quiet")
    assert spike["peak_rss_bytes"] - spike["rss_bytes"] > 48 << 20     # the freed spike, seen exactly
    assert quiet["peak_rss_bytes"] < spike["peak_rss_bytes"] - (48 << 20)   # the next phase starts afresh
    assert int(out.stdout) >= spike["peak_rss_bytes"]                  # what a task's profile reports keeps it
