"""Compact updates end to end: codecs in real runs, the model broadcast, and a broker with a 128 KB packet limit."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
import torch

from coordinator.config import load_config
from coordinator.runtime.downlink import shared_tensors
from coordinator.runtime.engine import RunError
from coordinator.ops.mosquitto import LocalMosquitto, mosquitto_binary
from coordinator.runtime.run import run_federated
from coordinator.strategies.base import TaskPlan
from edge_client.client import ClientSettings, EdgeClient, presence_payload
from edge_client.data import load_dataset
from edge_client.models import state_shapes
from edge_client.registry import build_model
from edge_client.objectives import LocalData
from edge_client.wire.protocol import PresenceBody, Topics, decode, encode
from edge_client.wire.transport import BrokerSettings, InprocHub, MqttTransport

MODEL_BYTES = 53_194 * 4   # the float32 cnn on 8x8 digits


def config_for(out: Path, **sets):
    base = {"run__rounds": 2, "run__out": str(out), "model__name": "cnn", "data__eval": "digits",
            "clients__expected": 3, "clients__spawn": 3, "clients__round_timeout": 60.0,
            "clients__presence_timeout": 60.0}
    base.update(sets)
    return load_config(None, [(*key.split("__", 1), value) for key, value in base.items()])


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_compact_codecs_train_and_account_every_byte(tmp_path):
    config = config_for(tmp_path / "run", transport__kind="inproc", run__rounds=3,
                        codec__up="topk:0.1+int8+zstd", codec__down="fp16+zstd")
    result = run_federated(config, say=lambda s: None)
    rows = read_metrics(result.out_dir)
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"] + 0.3
    for row in rows[1:]:
        assert (row["returned"], row["rejected"], row["failed"]) == (3, 0, 0)
        assert row["fp32_bytes_up"] == row["fp32_bytes_down"] == 3 * MODEL_BYTES
        assert row["bytes_up"] < row["fp32_bytes_up"] / 10                       # top-k 10% in int8, compressed
        assert 0 < row["bytes_broadcast"] < row["bytes_down"] < MODEL_BYTES / 2   # the fp16 model, once
        per_client = row["bytes_per_client"]
        assert sorted(per_client) == ["sim-000", "sim-001", "sim-002"]
        assert sum(c["up"] for c in per_client.values()) == row["bytes_up"]
        assert sum(c["down"] for c in per_client.values()) + row["bytes_broadcast"] == row["bytes_down"]
    s = result.summary
    assert s["bytes_up"] == sum(r["bytes_up"] for r in rows) and s["fp32_bytes_up"] == 9 * MODEL_BYTES
    assert s["ratio_up_vs_fp32"] < 0.1 and s["ratio_vs_fp32"] < 0.3


def test_lossless_run_matches_the_plain_float32_aggregate(tmp_path):
    """Differences added back to the exact sent model give FedAvg's result to float precision."""
    a = run_federated(config_for(tmp_path / "a", transport__kind="inproc", run__rounds=1), say=lambda s: None)
    b = run_federated(config_for(tmp_path / "b", transport__kind="inproc", run__rounds=1, codec__up="fp32+lz4",
                                 codec__broadcast=False, transport__max_message_bytes=65536), say=lambda s: None)
    ra, rb = read_metrics(a.out_dir)[1], read_metrics(b.out_dir)[1]
    assert ra["test_accuracy"] == pytest.approx(rb["test_accuracy"], abs=1e-3)
    assert ra["bytes_broadcast"] > 0 and rb["bytes_broadcast"] == 0
    assert rb["bytes_down"] > 3 * MODEL_BYTES       # without the broadcast, every task carries the model


def test_only_tensors_every_task_shares_go_in_the_broadcast():
    g = torch.ones(3)
    plans = [TaskPlan(c, "train", {}, {"global": g, "own": torch.full((2,), float(i)), "same": torch.zeros(2)}, [])
             for i, c in enumerate(("a", "b", "c"))]
    assert sorted(shared_tensors(plans)) == ["global", "same"]      # equal values count, not only the same object
    assert shared_tensors(plans[:1]).keys() == plans[0].down.keys()
    assert shared_tensors([]) == {}


# --------------------------------------------------------------------------- the broadcast, client side

SPEC = {"name": "mlp", "hidden": [16], "num_classes": 10, "in_channels": 1, "image_size": 8}


def _model_message(round: int, seed: int) -> tuple[bytes, str]:
    torch.manual_seed(seed)
    payload = encode("model", run_id="r", round=round, task_id="", sender="coordinator", body={"codec": "fp32"},
                     tensors=dict(build_model(SPEC).state_dict()))
    return payload, hashlib.sha256(payload).hexdigest()


def test_client_fetches_a_broadcast_only_when_it_does_not_hold_it(tmp_path, announce_running, client_thread):
    hub = InprocHub()
    digits = load_dataset("digits")
    client = EdgeClient(ClientSettings(client_id="dev1"), hub.connect("dev1"),
                        LocalData(torch.from_numpy(digits.x_train[:100]), torch.from_numpy(digits.y_train[:100])))
    running = client_thread(client)
    me, topics = hub.connect("coord"), Topics()
    me.subscribe(topics.client("dev1", "result"))
    announce_running(me)
    first, first_hash = _model_message(1, 0)
    second, second_hash = _model_message(2, 1)
    up = sorted(state_shapes(build_model(SPEC)))

    def ask(task_id: str, digest: str, timeout: float = 30):
        body = {"objective": "train", "hyper": {"epochs": 1}, "model": SPEC, "up": up, "seed": 1,
                "timeout": timeout, "resend_every": 30, "broadcast": digest,
                "upload": {"codec": "fp32", "update": "delta", "error_feedback": False}}
        me.publish(topics.client("dev1", "task"), encode("task", run_id="r", round=1, task_id=task_id,
                                                         sender="coordinator", body=body))
        incoming = me.get(30)
        assert incoming is not None, f"no answer to {task_id}"
        return decode(incoming.payload)

    me.publish(topics.model, first, retain=True)
    one = ask("t1", first_hash)
    assert one.body["delta"] == up and set(one.tensors) == set(up)     # differences from the broadcast model
    me.publish(topics.model, second, retain=True)
    # It holds the first model: a task referencing it runs without a fetch, though the broker now
    # retains the second (a fetch would deliver that one, and the task would wait in vain).
    two = ask("t2", first_hash)
    assert "error" not in two.body
    three = ask("t3", second_hash)                                      # a new hash: fetched on demand
    assert "error" not in three.body
    missing = ask("t4", "0" * 64, timeout=1)                            # never arrives: an error at the timeout
    # The error says what this device saw instead of blaming the broker's ACL: the retained second model.
    assert "did not arrive" in missing.body["error"] and "ACL" not in missing.body["error"]
    assert "brought only the broadcast of round 2" in missing.body["error"], missing.body["error"]
    torch.manual_seed(0)
    poisoned = {k: torch.full_like(v, float("nan")) for k, v in build_model(SPEC).state_dict().items()}
    me.publish(topics.model, encode("model", run_id="r", round=3, task_id="", sender="coordinator",
                                    body={"codec": "fp32"}, tensors=poisoned), retain=True)
    refused = ask("t5", "1" * 64, timeout=1)
    running.stop()
    assert "a broadcast that was refused" in refused.body["error"] and "NaN" in refused.body["error"], refused.body


# --------------------------------------------------------------------------- a broker with a 128 KB packet limit


@pytest.fixture(scope="module")
def small_broker(tmp_path_factory: pytest.TempPathFactory) -> str:
    if mosquitto_binary() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    broker = LocalMosquitto(workdir=tmp_path_factory.mktemp("mosquitto-128k"), extra_config="max_packet_size 131072\n")
    broker.start()
    yield broker.url
    broker.stop()


def test_round_through_a_broker_with_a_128k_packet_limit_works_with_chunking(tmp_path, small_broker, prefix):
    config = config_for(tmp_path / "run", transport__broker=small_broker, transport__prefix=prefix,
                        transport__max_message_bytes=65536, codec__up="fp16", run__rounds=1)
    result = run_federated(config, say=lambda s: None)
    rows = read_metrics(result.out_dir)
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"] + 0.2
    for row in rows[1:]:
        assert (row["selected"], row["returned"], row["rejected"], row["late"]) == (3, 3, 0, 0)
        assert MODEL_BYTES < row["bytes_broadcast"] < MODEL_BYTES * 1.01        # the model went in 4 chunks
        assert 3 * MODEL_BYTES / 2 < row["bytes_up"]                            # fp16 results, 2 chunks each
    for i in range(3):   # fp16 is lossy: each device keeps its error-feedback residual in its state directory
        assert (result.out_dir / "clients" / f"sim-00{i}" / "residual.safetensors").is_file()


@pytest.mark.parametrize("sets, reason", [
    ({"transport__max_message_bytes": 65536, "transport__chunking": False}, "chunking is off"),
    ({"transport__max_message_bytes": 1 << 20}, "maximum packet size of 131072"),
])
def test_oversize_messages_fail_cleanly_and_fast(tmp_path, small_broker, prefix, sets, reason):
    """The first task cannot be sent: the run stops at once with the remedy, no hang, no resend loop."""
    device = MqttTransport(BrokerSettings(url=small_broker), f"{prefix}-dev1").connect()
    device.publish(Topics(prefix).client("dev1", "presence"),
                   presence_payload("dev1", PresenceBody("online", num_samples=10)), retain=True)
    config = config_for(tmp_path / "run", transport__broker=small_broker, transport__prefix=prefix,
                        clients__expected=1, clients__spawn=0, **sets)
    started = time.monotonic()
    try:
        with pytest.raises(RunError, match=reason):
            run_federated(config, say=lambda s: None)
    finally:
        device.close()
    assert time.monotonic() - started < 10
