"""Secure aggregation over fedge's protocol: a secure FedAvg gives the plain FedAvg model, dropouts are
survived up to the graph's tolerance and beyond it the round fails without releasing anything, one masked
input looks uniform, and bad or replayed stage messages are refused without crashing either side."""

from __future__ import annotations

import json
import os
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import safetensors.torch
import torch
from scipy import stats

import edge_client.secure_device as secure_device
from coordinator.config import ConfigError, load_config
from coordinator.runtime.run import run_federated
from coordinator.runtime.run_error import RunError
from coordinator.runtime.secure_round import SecureRound
from coordinator.strategies.base import TaskPlan
from coordinator.strategy_setup import make_strategy
from edge_client.client import ClientSettings, EdgeClient
from edge_client.data import load_dataset
from edge_client.device_shell import DeviceShell
from edge_client.objectives import LocalData
from edge_client.secagg import (MaskedSum, MessageError, RefusedError, SecAggParams, advertise, collect_keys,
                                masked_input, route_shares, share)
from edge_client.secagg import masking
from edge_client.secagg.stages import MASKED_TENSOR, StageTask, split_sum
from edge_client.secure_device import SecureRounds
from edge_client.wire.protocol import ResultBody, Topics, decode, encode
from edge_client.wire.transport import BrokerSettings, MqttTransport

SMALL = {"run.rounds": 2, "model.name": "cnn", "model.width": 0.5, "data.eval": "digits", "clients.max_attempts": 1,
         "export.enabled": False, "train.epochs": 1, "run.seed": 3}


def _config(tmp_path, **sets):
    merged = {**SMALL, "run.out": str(tmp_path), **sets}
    return load_config(None, [(*k.split(".", 1), v) for k, v in merged.items()])


def _final(out) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(sorted((out / "checkpoints").glob("round_*.safetensors"))[-1])


# -- refusals at config load ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting, message", [
    ({"aggregate.rule": "median"}, "aggregate.rule = 'mean'"),
    ({"aggregate.norm_bound": 2.0}, "aggregate.norm_bound = 0"),
    ({"run.diagnostics": True}, "run.diagnostics = false"),
    ({"eval.personalized": True, "data.local_test_fraction": 0.2}, "eval.personalized = false"),
    ({"run.mode": "async"}, "run.mode = 'sync'"),
    ({"workers.count": 1, "transport.broker": "mqtt://127.0.0.1:1883"}, "workers.count = 0"),
    ({"codec.up": "topk:0.1+int8"}, "dense codec.up"),
    ({"privacy.mode": "local"}, "privacy.mode 'off' or 'central'"),
    ({"clients.expected": 2}, "at least 3 devices"),
    ({"secagg.degree": 3, "clients.expected": 8}, "secagg.degree must be"),
    ({"run.strategy": "fed2", "model.fed2_groups": 2}, "secagg.enabled = true cannot run"),
    ({"run.strategy": "spherefed", "model.head": "sphere", "ffc.enabled": True}, "secagg.enabled = true cannot run"),
])
def test_what_secure_aggregation_cannot_run_with_is_refused_naming_the_key(tmp_path, setting, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_strategy(_config(tmp_path, **{"secagg.enabled": True, **setting}))


def test_a_secure_round_under_central_dp_releases_what_the_plain_private_round_releases(tmp_path):
    """Central DP over a secure sum: equal weights, the device's own L2 clip, the coordinator's noise after
    unmasking and the fixed denominator. Without noise (z = 0) the models must match a plain private run's."""
    private = {"run.rounds": 2, "clients.expected": 4, "clients.spawn": 4, "transport.kind": "inproc",
               "privacy.mode": "central", "privacy.clip_norm": 0.05, "privacy.noise_multiplier": 0.0}
    plain = run_federated(_config(tmp_path / "plain", **private), say=lambda s: None)
    secure = run_federated(_config(tmp_path / "secure", **private, **{"secagg.enabled": True}), say=lambda s: None)
    a, b = _final(plain.out_dir), _final(secure.out_dir)
    worst = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    assert worst < 1e-5, worst
    rows = [json.loads(line) for line in (secure.out_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["round"] > 0]
    assert all(r["secagg_survivors"] == 4 and "dp_epsilon" in r for r in trained)
    plain_rows = [json.loads(line) for line in (plain.out_dir / "metrics.jsonl").read_text().splitlines()]
    # the clip bound bites (0.05 is below every update's norm here), and the count comes out of the sum
    assert [r["dp_clipped_fraction"] for r in trained] == [r["dp_clipped_fraction"] for r in plain_rows
                                                           if r["round"] > 0]


# -- what one masked input shows ---------------------------------------------------------------------------------------
def test_one_masked_input_looks_uniform_while_the_quantized_update_does_not():
    length = 20_000
    p = SecAggParams(1, 4, 3, 2, length, 1.0, masking.largest_scale(4, 1.0, 32), 32, os.urandom(32))
    states, adverts = zip(*(advertise(p, i) for i in range(4)))
    keys = collect_keys(p, adverts)
    states, bundles = zip(*(share(s, keys) for s in states))
    forwarded = route_shares(p, keys, bundles)
    update = np.random.default_rng(0).normal(0, 0.01, length)   # what a device's weighted update looks like
    _, masked = masked_input(states[0], forwarded[0], update)
    words = masking.from_bytes(masked.vector, length, 32)
    plain = masking.quantize(update, p.clip, p.scale, p.bits)
    # the top byte of each word: uniform over 0..255 when masked, two spikes (0x00 and 0xff) when not
    for vector, uniform in ((words, True), (plain, False)):
        top = np.bincount((vector >> 24).astype(np.int64), minlength=256)
        pvalue = stats.chisquare(top).pvalue
        assert (pvalue > 1e-4) if uniform else (pvalue < 1e-100), pvalue


# -- bad and replayed stage messages ---------------------------------------------------------------------------------------
def _params(n=3) -> SecAggParams:
    return SecAggParams(9, n, 2, 2, 5, 1.0, 1000.0, 32, os.urandom(32))


@pytest.mark.parametrize("body, reason", [
    ({"stage": "dance"}, "stage"),
    ({"stage": "share", "params": {"round_id": 9}}, "num_clients"),
    ({"stage": "advertise", "client": 0, "weight_unit": 1}, "params"),
    ("not an object", "must be an object"),
])
def test_a_malformed_stage_task_is_refused_with_its_reason(body, reason):
    with pytest.raises(MessageError, match=reason):
        StageTask.from_body(body)


def test_the_device_refuses_a_replayed_or_out_of_order_stage_and_forgets_a_finished_round():
    p = _params()
    device = SecureRounds()
    with pytest.raises(RefusedError, match="holds no secure round"):
        device.answer(("r", 1), StageTask("share", p, 0, 0.0, collect_keys(p, [advertise(p, i)[1] for i in range(3)])))
    device.advertise(("r", 1), StageTask("advertise", p, 0, 0.0), np.zeros(5), 10)
    others = [advertise(p, i)[1] for i in (1, 2)]
    keys = collect_keys(p, [device_advert(device, p), *others])
    task = StageTask("share", p, 0, 0.0, keys)
    device.answer(("r", 1), task)
    with pytest.raises(RefusedError, match="runs once, in order"):
        device.answer(("r", 1), task)   # the same stage again, under a new task id
    with pytest.raises(RefusedError, match="holds no secure round"):
        device.answer(("r", 0), task)   # an older round
    with pytest.raises(MessageError, match="differ"):
        device.answer(("r", 1), StageTask("share", _params(), 0, 0.0, keys))


def device_advert(device: SecureRounds, p: SecAggParams):
    """The advertisement matching the device's held keys (as its advertise answer carried it)."""
    from edge_client.secagg.keys import public_key_of
    from edge_client.secagg import Advertise
    return Advertise(p.round_id, 0, public_key_of(device._state.c_sk), public_key_of(device._state.s_sk))


def test_a_malformed_stage_task_is_logged_and_dropped_by_the_client(caplog):
    from edge_client.device_actions import Task
    from edge_client.device_protocol import DeviceProtocol
    from edge_client.device_shell import PhaseClock

    sent = []
    transport = SimpleNamespace(publish=lambda *a, **k: sent.append(a))
    trainer = SimpleNamespace(clock=PhaseClock, train=lambda task, finish: pytest.fail("a stage task never trains"))
    shell = DeviceShell(DeviceProtocol("dev1", Topics()), transport, trainer, secure=SecureRounds())
    msg = decode(encode("task", run_id="r", round=1, task_id="t1", sender="coordinator",
                        body={"objective": "secagg", "model": {}, "up": [], "secagg": {"stage": "mask"}}))
    shell.run(Task.read(msg))
    assert sent == []
    assert any("dropped secure-aggregation task t1" in r.getMessage() for r in caplog.records)


def _round_with_keys():
    p = _params()
    rnd = SecureRound.__new__(SecureRound)
    rnd.params, rnd.ids, rnd.replies = p, {"a": 0, "b": 1, "c": 2}, {}
    states, adverts = zip(*(advertise(p, i) for i in range(3)))
    rnd.keys, rnd.members, rnd.request = collect_keys(p, adverts), frozenset(range(3)), None
    rnd.masked = MaskedSum(p, rnd.members)
    return rnd, p, states, adverts


def _answer(rnd, p, client, stage, secagg, tensors=None, round_id=None):
    plan = TaskPlan(client_id=client, objective="secagg", hyper={}, down={}, up=[],
                    secagg={"stage": stage, "params": {"round_id": p.round_id if round_id is None else round_id}})
    msg = decode(encode("result", run_id="r", round=1, task_id="t", sender=client, body={}, tensors=tensors or {}))
    return rnd.on_answer(plan, msg, ResultBody(num_samples=5, secagg=secagg))


def test_the_coordinator_refuses_malformed_and_replayed_stage_results_naming_why():
    rnd, p, states, adverts = _round_with_keys()
    _answer(rnd, p, "a", "advertise", {"stage": "advertise", "message": adverts[0].to_body()})
    refusals = {
        "says it is from device 2": lambda: _answer(rnd, p, "b", "advertise", {"stage": "advertise",
                                                                         "message": adverts[2].to_body()}),
        "a second advertise message": lambda: _answer(rnd, p, "a", "advertise", {"stage": "advertise",
                                                                       "message": adverts[0].to_body()}),
        "round that is over": lambda: _answer(rnd, p, "b", "advertise", {"stage": "advertise",
                                                                         "message": adverts[1].to_body()},
                                              round_id=p.round_id - 1),
        "stage 'mask'": lambda: _answer(rnd, p, "b", "advertise", {"stage": "mask", "message": {}}),
        "must carry a secagg": lambda: _answer(rnd, p, "b", "advertise", None),
        "exactly the tensor": lambda: _answer(rnd, p, "b", "mask", {"stage": "mask", "message": {
            "round_id": p.round_id, "sender": 1, "masked_with": [0, 2]}}),
        "int32 of shape": lambda: _answer(rnd, p, "b", "mask", {"stage": "mask", "message": {
            "round_id": p.round_id, "sender": 1, "masked_with": [0, 2]}},
            tensors={MASKED_TENSOR: torch.zeros(4, dtype=torch.int32)}),
        "masked with": lambda: _answer(rnd, p, "b", "mask", {"stage": "mask", "message": {
            "round_id": p.round_id, "sender": 1, "masked_with": [0]}},
            tensors={MASKED_TENSOR: torch.zeros(5, dtype=torch.int32)}),
    }
    for reason, attempt in refusals.items():
        with pytest.raises(MessageError, match=reason):
            attempt()


# -- over Mosquitto ---------------------------------------------------------------------------------------------------
def test_a_secure_fedavg_over_mosquitto_with_device_processes_gives_the_plain_model(tmp_path, mosquitto, prefix):
    plain = run_federated(_config(tmp_path / "plain", **{"run.rounds": 1, "clients.expected": 3, "clients.spawn": 3,
                                                         "transport.kind": "inproc"}), say=lambda s: None)
    secure = run_federated(_config(tmp_path / "secure", **{
        "run.rounds": 1, "clients.expected": 3, "clients.spawn": 3, "transport.broker": mosquitto, "transport.prefix": prefix,
        "secagg.enabled": True}), say=lambda s: None)
    a, b = _final(plain.out_dir), _final(secure.out_dir)
    assert a.keys() == b.keys()
    worst = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    assert worst < 1e-5, worst   # 3 devices' rounding to 1 / scale, twice, and float32
    rows = [json.loads(line) for line in (secure.out_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["round"] > 0]
    assert all(r["secagg_survivors"] == 3 and r["secagg_dropped"] == 0 for r in trained)
    assert all(r[f"secagg_{s}_bytes_up"] > 0 and r[f"secagg_{s}_seconds"] >= 0
               for r in trained for s in ("advertise", "share", "mask", "unmask"))
    # the masked words are the vector's length in 4-byte words per device, and little else
    assert trained[0]["secagg_mask_bytes_up"] >= 3 * 4 * trained[0]["secagg_length"]


def _devices(url: str, prefix: str, count: int, drop_at: dict[str, str], client_thread, monkeypatch):
    """``count`` device clients on threads of this process; device ``cid`` in ``drop_at`` stops answering
    at that stage (it has gone away). Their vectors and the model they were sent are recorded."""
    seen: dict = {"vectors": {}, "received": None}
    real_vector, real_step = secure_device.secure_vector, DeviceShell._secure_step

    def recording(stage, trained, received, names, *args):
        vector = real_vector(stage, trained, received, names, *args)
        seen["vectors"][stage.client] = vector
        seen["received"] = {n: received[n].clone() for n in names}
        seen["names"] = names
        return vector

    def dropping(self, msg, stage):
        if drop_at.get(self.client_id) == stage.stage:
            raise RefusedError(f"this device has gone away before its {stage.stage} answer")
        return real_step(self, msg, stage)

    monkeypatch.setattr(secure_device, "secure_vector", recording)
    monkeypatch.setattr(DeviceShell, "_secure_step", dropping)
    digits = load_dataset("digits")
    for i in range(count):
        cid = f"dev{i}"
        transport = MqttTransport(BrokerSettings(url=url, protocol="3.1.1"), cid).connect()
        rows = slice(i * 100, (i + 1) * 100)
        data = LocalData(torch.from_numpy(digits.x_train[rows]), torch.from_numpy(digits.y_train[rows]))
        client_thread(EdgeClient(ClientSettings(client_id=cid, topics=Topics(prefix)), transport, data))
    return seen


def _run_on_thread(config) -> dict:
    outcome: dict = {}

    def go() -> None:
        try:
            outcome["result"] = run_federated(config, say=lambda s: None)
        except RunError as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(120)
    return outcome


@pytest.mark.parametrize("drop_at", [{"dev2": "unmask"}, {"dev1": "mask", "dev4": "unmask"}],
                         ids=["one-after-masking", "tolerance-many"])
def test_dropped_devices_leave_the_sum_of_the_survivors(tmp_path, mosquitto, prefix, client_thread, monkeypatch,
                                                         drop_at):
    seen = _devices(mosquitto, prefix, 6, drop_at, client_thread, monkeypatch)
    outcome = _run_on_thread(_config(tmp_path, **{
        "run.rounds": 1, "clients.expected": 6, "clients.min_results": 4, "transport.broker": mosquitto,
        "transport.prefix": prefix, "secagg.enabled": True, "secagg.stage_timeout": 3.0}))
    assert "result" in outcome, outcome
    # 6 devices, the complete graph, threshold 3: up to 2 may go; one gone before masking is not in the sum
    in_sum = [i for i in range(6) if drop_at.get(f"dev{i}") != "mask"]
    row = json.loads((outcome["result"].out_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert (row["secagg_survivors"], row["secagg_dropped"]) == (len(in_sum), 6 - len(in_sum))
    names = seen["names"]
    shapes = [(n, tuple(seen["received"][n].shape)) for n in names]
    parts = split_sum(sum(seen["vectors"][i] for i in in_sum), shapes, 1.0)
    final = _final(outcome["result"].out_dir)
    for n in names:
        expected = seen["received"][n].double() + parts.sums[n] / parts.weight
        assert torch.allclose(final[n].double(), expected, atol=1e-6), n


def test_more_dropouts_than_the_graph_tolerates_fail_the_round_and_release_nothing(tmp_path, mosquitto, prefix,
                                                                                    client_thread, monkeypatch):
    _devices(mosquitto, prefix, 6, {"dev0": "unmask", "dev3": "unmask", "dev5": "unmask"}, client_thread,
             monkeypatch)
    outcome = _run_on_thread(_config(tmp_path, **{
        "run.rounds": 1, "clients.expected": 6, "clients.min_results": 3, "transport.broker": mosquitto,
        "transport.prefix": prefix, "secagg.enabled": True, "secagg.stage_timeout": 3.0}))
    assert "error" in outcome, outcome
    assert "secure aggregation" in str(outcome["error"]) and "no sum is released" in str(outcome["error"])
    assert not list((tmp_path / "checkpoints").glob("round_0001*"))
