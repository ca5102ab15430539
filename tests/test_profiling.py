"""On-device profiling: real training, a real client loop, a real MQTT run, ONNX Runtime without torch."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from coordinator.config import load_config
from coordinator.runtime.bookkeeping import RunRecords
from coordinator.runtime.run import run_federated
from edge_client.client import ClientSettings, EdgeClient
from edge_client.data import load_dataset
from edge_client.registry import build_model
from edge_client.objectives import LocalData, TaskContext, train
from edge_client.wire.protocol import Topics, decode, encode
from edge_client.wire.transport import InprocHub
from profiling.cli import main as profile_main
from profiling.device import device_facts
from profiling.history import read_jsonl as history_read_jsonl
from profiling.profiler import STEP_PHASES, NullProfiler, Profiler, percentile
from profiling.schema import clean_profile
from profiling.sensors import cpu_temperature, parse_throttled
from storage.files import read_jsonl, write_jsonl_atomic

CNN = {"name": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 8}


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # see conftest.py


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def local_data(digits, n: int) -> LocalData:
    return LocalData(torch.from_numpy(digits.x_train[:n]), torch.from_numpy(digits.y_train[:n]))


def train_with(profiler: Profiler, data: LocalData) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(CNN)
    with profiler.phase("train"):
        train(model, data, {"epochs": 2, "batch_size": 16},
              TaskContext(seed=3, round=1, client_id="dev", state_dir=None, profiler=profiler))
    return model


def test_profile_of_real_training_has_sane_fields(digits):
    data = local_data(digits, 200)
    train_with(Profiler(), data)   # warm-up: the first optimizer use imports lazily for about a second
    profiler = Profiler()
    train_with(profiler, data)
    p = profiler.summary()
    assert p["steps"] == 2 * math.ceil(200 / 16) and p["samples"] == 400
    assert 0 < p["step_p50"] <= p["step_p95"] <= p["step_max"]
    assert p["samples_per_second"] > 0 and p["seconds"] >= p["phases"]["train"] > 0
    assert set(p["train_phases"]) == set(STEP_PHASES) and all(v > 0 for v in p["train_phases"].values())
    assert sum(p["train_phases"].values()) <= p["phases"]["train"]
    assert sum(p["train_phases"].values()) <= sum(profiler.steps) * 1.0001   # laps are parts of steps
    assert p["peak_rss_bytes"] > 50 * 2**20          # a process with torch loaded
    # USS costs milliseconds with torch loaded: read only within USS_BUDGET of the task, so a short one has none.
    assert p["peak_uss_bytes"] is None or 0 < p["peak_uss_bytes"] <= p["peak_rss_bytes"]
    assert p["cpu_percent"] > 0
    # Absent readings are None, never zero: this machine has no CPU sensor and no vcgencmd.
    if cpu_temperature() is None:
        assert p["temperature_c"] is None and p["temperature_sensor"] is None
    else:
        assert -40 < p["temperature_c"] < 125
    if shutil.which("vcgencmd") is None:
        assert p["throttled"] is None
    assert clean_profile(json.loads(json.dumps(p))) == json.loads(json.dumps(p))   # survives the wire check


def test_uss_is_read_when_the_task_is_long_enough_to_afford_it():
    short = Profiler().summary()
    long = Profiler(started=time.perf_counter() - 60).summary()   # a task that began a minute ago
    assert short["peak_uss_bytes"] is None                        # 0.3 to 9 ms would exceed 1% of it
    assert 0 < long["peak_uss_bytes"] <= long["peak_rss_bytes"]


def test_null_profiler_records_nothing_and_changes_no_result(digits):
    data = local_data(digits, 96)
    profiled, plain = train_with(Profiler(), data), train_with(NullProfiler(), data)
    for name, value in profiled.state_dict().items():
        torch.testing.assert_close(value, plain.state_dict()[name], rtol=0, atol=0)
    null = NullProfiler()
    train_with(null, data)
    assert null.summary() == {} and null.steps == [] and not null.enabled


def test_percentiles_and_absent_values():
    assert percentile([], 50) is None
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 0) == 1.0 and percentile(values, 50) == 3.0 and percentile(values, 100) == 5.0


def test_pi_throttling_flags_are_decoded():
    assert parse_throttled("throttled=0x0") == {"raw": "0x0", "now": [], "since_boot": []}
    flags = parse_throttled("throttled=0x50005\n")
    assert flags["now"] == ["under_voltage", "throttled"] and flags["since_boot"] == ["under_voltage", "throttled"]
    assert parse_throttled("error=1 error_msg=\"Command not registered\"") is None


def test_received_profiles_are_checked_field_by_field():
    assert clean_profile("not a dict") == {} and clean_profile(None) == {}
    raw = {"seconds": float("nan"), "steps": True, "peak_rss_bytes": -5, "step_p50": 0.1, "temperature_c": -12.5,
           "phases": {"train": 1.0, "decode": "fast", 7: 1.0}, "throttled": "yes", "unknown": 1,
           "previous_send": {"task_id": "abc", "encode": 0.01, "publish": -1}}
    assert clean_profile(raw) == {
        "seconds": None, "steps": None, "peak_rss_bytes": None, "step_p50": 0.1, "temperature_c": -12.5,
        "phases": {"train": 1.0}, "throttled": None, "previous_send": {"task_id": "abc", "encode": 0.01}}


def test_device_facts_without_importing_torch():
    code = ("import sys; from profiling.device import device_facts; f = device_facts(); "
            "assert 'torch' not in sys.modules; print(f['torch'], f['torch_threads'], f['cores'], f['ram_bytes'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    version, threads, cores, ram = out.stdout.split()
    assert version == torch.__version__ and threads == "None" and int(cores) >= 1 and int(ram) > 0
    assert device_facts()["torch_threads"] == torch.get_num_threads()   # here torch is loaded


def test_client_profiles_every_phase_and_keeps_its_history(tmp_path, digits, announce_running, client_thread):
    hub = InprocHub()
    state = tmp_path / "state"
    client = EdgeClient(ClientSettings(client_id="dev1", state_dir=state), hub.connect("dev1"),
                        local_data(digits, 128))
    coordinator = hub.connect("coordinator")
    topics = Topics()
    coordinator.subscribe(topics.client("dev1", "result"))
    announce_running(coordinator)
    coordinator.subscribe(topics.client("dev1", "presence"))
    running = client_thread(client)
    model = build_model(CNN)
    params = dict(model.state_dict())
    body = {"objective": "train", "hyper": {"epochs": 1}, "model": CNN, "up": sorted(params), "seed": 1,
            "timeout": 30, "resend_every": 30}
    results, presence = {}, None
    for task_id in ("task-a", "task-b"):
        coordinator.publish(topics.client("dev1", "task"), encode("task", run_id="r", round=int(task_id == "task-b") + 1,
                                                                   task_id=task_id, sender="coordinator", body=body,
                                                                   tensors=params))
        deadline = time.monotonic() + 60
        while task_id not in results and time.monotonic() < deadline:
            incoming = coordinator.get(0.5)
            if incoming is None:
                continue
            msg = decode(incoming.payload)
            if msg.kind == "presence":
                presence = msg.body
            elif msg.kind == "result":
                results[msg.task_id] = msg.body
    running.stop()
    assert set(results) == {"task-a", "task-b"}
    facts = presence["device"]
    for key in ("arch", "cpu_model", "cores", "ram_bytes", "os", "python", "torch", "torch_threads", "onnxruntime"):
        assert key in facts
    assert facts["cores"] >= 1 and facts["ram_bytes"] > 0 and facts["torch_threads"] >= 1
    first, second = results["task-a"]["profile"], results["task-b"]["profile"]
    assert {"receive", "decode", "train"} <= set(first["phases"]) and set(first["train_phases"]) == set(STEP_PHASES)
    assert all(v >= 0 for v in first["phases"].values()) and first["peak_rss_bytes"] > 0
    assert "previous_send" not in first          # encoding the first result came after it was sealed
    sent = second["previous_send"]
    assert sent["task_id"] == "task-a" and sent["encode"] > 0 and sent["publish"] > 0
    lines = [json.loads(line) for line in (state / "profile.jsonl").read_text().splitlines()]
    assert [(l["kind"], l["task_id"], l["round"]) for l in lines] == [("task", "task-a", 1), ("task", "task-b", 2)]
    assert all(l["phases"]["encode"] > 0 and l["phases"]["publish"] > 0 for l in lines)
    assert lines[0]["phases"]["encode"] == sent["encode"]


def test_mqtt_run_leaves_per_device_profiles(tmp_path, mosquitto, prefix):
    out = tmp_path / "run"
    overrides = {"run__rounds": 2, "run__out": str(out), "data__eval": "digits", "clients__expected": 3,
                 "clients__spawn": 3, "clients__round_timeout": 60.0, "clients__presence_timeout": 60.0,
                 "transport__broker": mosquitto, "transport__prefix": prefix}
    result = run_federated(load_config(None, [(*k.split("__"), v) for k, v in overrides.items()]), say=lambda s: None)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = {}
    for cid in ("sim-000", "sim-001", "sim-002"):
        latest = json.loads((out / "clients" / f"{cid}.json").read_text())
        assert latest["device"]["cores"] >= 1 and latest["device"]["torch_threads"] == 1   # spawned: one thread
        lines = [json.loads(line) for line in (out / "clients" / f"{cid}.jsonl").read_text().splitlines()]
        assert [l["round"] for l in lines] == [1, 2] and not any(l["late"] or l["error"] for l in lines)
        for line in lines:   # the coordinator's round time covers the device's own time, transfer included
            assert line["round_seconds"] >= line["profile"]["seconds"] > 0
            records[(cid, line["round"])] = line["profile"]["seconds"]
        history = [json.loads(line) for line in (out / "clients" / cid / "profile.jsonl").read_text().splitlines()]
        assert [h["round"] for h in history] == [1, 2] and all(h["phases"]["publish"] >= 0 for h in history)
    for row in rows[1:]:
        times = {cid: s for (cid, r), s in records.items() if r == row["round"]}
        assert row["slowest_client"] == max(times, key=times.get)
        assert row["slowest_seconds"] == pytest.approx(times[row["slowest_client"]])
        assert row["skipped"] == []
    assert profile_main(["show", str(result.out_dir)]) == 0


def _onnx_cnn(path: Path, batch: int | str = "N") -> Path:
    """A small conv net written with onnx.helper (input [batch, 1, 8, 8], 10 outputs)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = {"W": rng.standard_normal((8, 1, 3, 3)), "B": np.zeros(8), "F": rng.standard_normal((10, 8 * 8 * 8)),
               "C": np.zeros(10)}
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]), helper.make_node("Flatten", ["r"], ["f"], axis=1),
             helper.make_node("Gemm", ["f", "F", "C"], ["y"], transB=1)]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 1, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 10])],
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9   # onnxruntime reads IR versions up to its own
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _infer_without_torch(*args: str) -> subprocess.CompletedProcess:
    code = ("import sys; from profiling.cli import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'infer imported torch'; sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, "infer", *args], capture_output=True, text=True, timeout=120)


def test_infer_benchmarks_onnx_runtime_without_torch(tmp_path):
    model = _onnx_cnn(tmp_path / "cnn.onnx")
    state = tmp_path / "state"
    out = _infer_without_torch(str(model), "--runs", "40", "--warmup", "5", "--batch", "8", "--state-dir", str(state))
    assert out.returncode == 0, out.stderr
    assert "p99 ms" in out.stdout and "appended to" in out.stdout
    images = (np.random.default_rng(1).random((20, 8, 8)) * 255).astype(np.uint8)   # [N, H, W]: channel added
    np.savez(tmp_path / "samples.npz", x=images, y=np.zeros(20, dtype=np.int64))
    out = _infer_without_torch(str(model), "--runs", "20", "--warmup", "2", "--batch", "4", "--state-dir", str(state),
                               "--data", f"npz:{tmp_path / 'samples.npz'}")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in (state / "profile.jsonl").read_text().splitlines()]
    assert [l["kind"] for l in lines] == ["infer", "infer"] and lines[1]["data"].startswith("npz:")
    for line, (runs, batches) in zip(lines, ((40, [1, 8]), (20, [1, 4]))):
        assert [r["batch"] for r in line["results"]] == batches
        for r in line["results"]:
            assert r["runs"] == runs and 0 < r["p50"] <= r["p95"] <= r["p99"] and r["samples_per_second"] > 0
        assert line["peak_rss_bytes"] > 0 and line["device"]["onnxruntime"] and line["device"]["torch_threads"] is None
    assert profile_main(["show", str(state / "profile.jsonl")]) == 0


def test_infer_explains_what_it_cannot_run(tmp_path):
    fixed = _onnx_cnn(tmp_path / "fixed.onnx", batch=1)
    out = _infer_without_torch(str(fixed), "--runs", "5", "--warmup", "0", "--no-record")
    assert out.returncode == 0 and "batch 32 skipped: the model's batch dimension is fixed at 1" in out.stdout
    missing = _infer_without_torch(str(tmp_path / "nope.onnx"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    np.savez(tmp_path / "wrong.npz", x=np.zeros((4, 3, 28, 28), dtype=np.float32))
    wrong = _infer_without_torch(str(fixed), "--data", f"npz:{tmp_path / 'wrong.npz'}", "--no-record")
    assert wrong.returncode == 2 and "the model takes [1, 8, 8]" in wrong.stderr


def test_read_jsonl_keeps_every_complete_object_and_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "profile.jsonl"
    write_jsonl_atomic(path, [{"round": 1}, {"round": 2}])
    with open(path, "a", encoding="utf-8") as fh:
        fh.write('\n[1, 2]\n"text"\n{"round": 3}\n{"round": 4, "pha')    # blank, non-objects, a crash mid-append
    assert read_jsonl(path) == [{"round": 1}, {"round": 2}, {"round": 3}]
    assert history_read_jsonl is read_jsonl             # one reader, whichever module it is taken from


def test_resume_reads_the_metrics_of_completed_rounds_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert RunRecords.read(tmp_path, 3) == []
    write_jsonl_atomic(path, [{"round": r} for r in range(5)] + [{"no": "round"}])
    assert RunRecords.read(tmp_path, 2) == [{"round": 0}, {"round": 1}, {"round": 2}]
