"""Disentangled FL: the MI estimator, attribute skew, frozen stages, device state, uploads, runs over MQTT."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from coordinator.config import ConfigError, load_config
from coordinator.runtime.run import run_federated
from coordinator.strategy_setup import make_strategy
from edge_client.client import ClientSettings, EdgeClient
from edge_client.data import (client_split, domain_palette, evaluation_split, load_dataset, parse_attribute_skew,
                              partition_indices)
from edge_client.models import federated_names
from edge_client.objectives import LocalData, ObjectiveError, TaskContext, TrainHyper
from edge_client.registry import build_model
from edge_client.seeding import seed_global_rng
from edge_client.wire.protocol import Topics, decode, encode
from methods.dfl.device import (PREVIOUS_FILE, STATE_FILE, DeviceState, DflHyper, device_seed, dfl_evaluate, dfl_train,
                                global_stage, local_stage)
from methods.dfl.model import PairCritic, jsd_mutual_information, part_names
from edge_client.wire.transport import InprocHub
from profiling.history import read_jsonl
from profiling.profiler import Profiler
from storage.state import ServerState

COLOR_SPEC = {"name": "dfl", "backbone": "cnn", "num_classes": 10, "in_channels": 3, "image_size": 8}


@pytest.fixture(autouse=True)
def one_thread():
    """Small tensors: one torch thread is faster, and much faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.fixture(scope="module")
def colored(digits) -> LocalData:
    x, y = client_split(digits, "attribute:color:3", 0, 3, 0)
    return LocalData(torch.from_numpy(x), torch.from_numpy(y))


def context(tmp_path: Path, client_id: str = "dev1", round: int = 1) -> TaskContext:
    return TaskContext(seed=5, round=round, client_id=client_id, state_dir=tmp_path / client_id, profiler=Profiler())


def snapshot(model: torch.nn.Module, *parts: str) -> dict[str, torch.Tensor]:
    """Every state entry (parameters and buffers) of the named parts, copied."""
    state = model.state_dict()
    return {k: state[k].clone() for k in part_names(state, *parts)}


def changed(before: dict[str, torch.Tensor], model: torch.nn.Module) -> set[str]:
    state = model.state_dict()
    return {k for k, v in before.items() if not torch.equal(v, state[k])}


# --------------------------------------------------------------------------- mutual information

def trained_estimate(dependent: bool, steps: int = 150, dim: int = 8) -> float:
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    critic = PairCritic(dim, dim, 64)
    opt = torch.optim.Adam(critic.parameters(), lr=1e-3)

    def pairs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.randn(n, dim, generator=gen)
        b = a + 0.1 * torch.randn(n, dim, generator=gen) if dependent else torch.randn(n, dim, generator=gen)
        return a, b

    for _ in range(steps):
        loss = -jsd_mutual_information(critic, *pairs(64), generator=gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return float(jsd_mutual_information(critic, *pairs(4096), generator=gen))


def test_mi_estimate_is_clearly_higher_on_dependent_pairs():
    dependent, independent = trained_estimate(True), trained_estimate(False)
    assert dependent > 0.5
    assert abs(independent) < 0.05
    assert dependent > independent + 0.45


# --------------------------------------------------------------------------- attribute skew

def test_attribute_partition_is_deterministic_and_its_domains_differ(digits):
    spec = "attribute:color:3"
    a = [client_split(digits, spec, i, 6, seed=4) for i in range(6)]
    b = [client_split(digits, spec, i, 6, seed=4) for i in range(6)]
    for (xa, ya), (xb, yb) in zip(a, b):
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
    assert all(x.shape[1] == 3 and x.dtype == np.float32 for x, _ in a)
    assert all(len(np.unique(y)) == 10 for _, y in a)   # labels stay balanced: iid by default

    def background(x: np.ndarray) -> np.ndarray:   # the colour of the corner pixel, blank in digits
        return x[:, :, 0, 0].mean(0)

    # client i is in domain i % 3: same domain, same palette; other domains, other colours
    assert np.allclose(background(a[0][0]), background(a[3][0]))
    for i, j in ((0, 1), (0, 2), (1, 2)):
        assert np.abs(background(a[i][0]) - background(a[j][0])).max() > 0.3
    expected = 2 * np.array(domain_palette(1, 3)[1]) - 1       # stored centred: 2 * rgb - 1
    assert np.allclose(background(a[1][0]), expected, atol=1e-5)
    # the coordinator's test split shows every domain, with the clients' channels
    x_eval, y_eval = evaluation_split(digits, spec)
    assert x_eval.shape[1:] == (3, 8, 8) and len(y_eval) == len(digits.y_test)
    corners = {tuple(np.round(c, 3)) for c in x_eval[:, :, 0, 0]}
    assert len(corners) == 3


def test_attribute_skew_combines_with_label_skew_and_rotates(digits):
    plain = partition_indices(digits.y_train, "dirichlet:0.5", 4, 1)
    skewed = partition_indices(digits.y_train, "attribute:rotate:4+dirichlet:0.5", 4, 1)
    assert all(np.array_equal(p, q) for p, q in zip(plain, skewed))   # same owners, only the images change
    for index in range(4):
        x, _ = client_split(digits, "attribute:rotate:4", index, 4, 0)
        original = digits.x_train[partition_indices(digits.y_train, "iid", 4, 0)[index]]
        assert np.allclose(x, np.rot90(original, k=index, axes=(2, 3)), atol=1e-5)   # 0, 90, 180, 270 degrees
    assert parse_attribute_skew("iid") is None
    for bad in ("attribute:color", "attribute:blur:3", "attribute:color:0", "attribute:color:3+",
                "attribute:color:2+attribute:rotate:2"):
        with pytest.raises(ValueError, match="attribute:KIND:DOMAINS"):
            parse_attribute_skew(bad)


def test_attribute_invert_flips_the_contrast_of_odd_domains(digits):
    lo, hi = float(digits.x_train.min()), float(digits.x_train.max())
    for index in range(4):
        x, _ = client_split(digits, "attribute:invert:4", index, 4, 0)
        original = digits.x_train[partition_indices(digits.y_train, "iid", 4, 0)[index]]
        expected = (lo + hi) - original if index % 2 else original   # domains 1 and 3: light background
        assert x.shape == original.shape and np.allclose(x, expected, atol=1e-6)
    x_eval, _ = evaluation_split(digits, "attribute:invert:2")
    assert np.allclose(x_eval[0::2], digits.x_test[0::2]) and np.allclose(x_eval[1::2], lo + hi - digits.x_test[1::2])


# --------------------------------------------------------------------------- model and local stages

def test_two_branch_model_names_its_branches():
    model = build_model({**COLOR_SPEC, "specific_width": 0.5, "peers": 2})
    roots = {name.split(".")[0] for name in federated_names(model)}
    assert roots == {"invariant", "specific", "predictor", "mi", "peers"}
    assert model(torch.zeros(4, 3, 8, 8)).shape == (4, 10)
    inv, spe = (next(m for m in reversed(branch) if isinstance(m, torch.nn.Linear))   # each one's last layer
                for branch in (model.invariant, model.specific))
    assert (inv.out_features, spe.out_features) == (128, 64)
    assert model.predictor.in_features == 128 + 64


def test_frozen_parts_do_not_change_during_their_stage(colored):
    torch.manual_seed(0)
    model = build_model({**COLOR_SPEC, "norm": "bn"})   # BatchNorm: buffers must stay put too
    model.train()
    h, d, gen = TrainHyper(batch_size=32, lr=0.05), DflHyper(), torch.Generator().manual_seed(0)

    frozen = snapshot(model, "invariant")
    trained = snapshot(model, "specific", "predictor", "mi")
    local_stage(model, colored, h, d, gen, Profiler())
    assert changed(frozen, model) == set()
    assert changed(trained, model) >= set(part_names(trained, "specific", "predictor"))
    assert part_names(changed(trained, model), "mi.spe") and not part_names(changed(trained, model), "mi.glob")

    frozen = snapshot(model, "specific", "predictor")
    trained = snapshot(model, "invariant", "mi")
    global_stage(model, colored, h, d, gen, Profiler())
    assert changed(frozen, model) == set()
    assert changed(trained, model) >= set(part_names(trained, "invariant", "mi.glob"))
    assert all(p.requires_grad for p in model.parameters())   # frozen only for the stage



def test_a_fresh_device_is_the_same_while_other_tasks_seed_and_build(tmp_path):
    """Simulated clients share torch's global generator: other tasks seeding it and building networks
    meanwhile must not change the branches a device initializes from its own seed."""
    model, store = build_model(COLOR_SPEC), DeviceState(tmp_path / "dev")
    store.load_into(model, 7)
    reference = {k: v.clone() for k, v in DeviceState.tensors(model).items()}
    stop = threading.Event()

    def other_tasks(seed: int = 0) -> None:
        while not stop.is_set():   # what a training task does as it starts, and a worker's first build
            seed_global_rng(seed)
            build_model(COLOR_SPEC)
            seed += 1

    threads = [threading.Thread(target=other_tasks) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(30):
            store.load_into(model, 7)
            assert all(torch.equal(v, reference[k]) for k, v in DeviceState.tensors(model).items())
    finally:
        stop.set()
        for t in threads:
            t.join()

# --------------------------------------------------------------------------- state on the device

def test_device_state_survives_a_restart_byte_for_byte(tmp_path, colored, caplog):
    torch.manual_seed(0)
    model = build_model(COLOR_SPEC)
    hyper = {"train": {"batch_size": 32, "lr": 0.05}, "dfl": {"init_seed": 3}}
    out = dfl_train(model, colored, hyper, context(tmp_path))
    assert out.metrics["state_initialized"] == 1.0 and out.num_samples == len(colored)
    path = tmp_path / "dev1" / STATE_FILE
    saved_bytes = path.read_bytes()
    assert set(load_file(path)) == set(part_names(model.state_dict(), "specific", "predictor", "mi"))

    rebooted = build_model(COLOR_SPEC)   # a new process: a fresh model, the same state directory
    digest = DeviceState(tmp_path / "dev1").load_into(rebooted, device_seed(3, "dev1"))
    assert digest == hashlib.sha256(saved_bytes).hexdigest()
    assert path.read_bytes() == saved_bytes
    before, after = model.state_dict(), rebooted.state_dict()
    for name in part_names(before, "specific", "predictor", "mi"):
        assert torch.equal(before[name], after[name]), name

    out = dfl_train(rebooted, colored, hyper, context(tmp_path, round=2))
    assert out.metrics["state_initialized"] == 0.0
    lines = [r for r in read_jsonl(tmp_path / "dev1" / "profile.jsonl") if r["kind"] == "dfl_state"]
    assert [r["loaded"] for r in lines] == [None, hashlib.sha256(saved_bytes).hexdigest()]
    assert lines[1]["saved"] == hashlib.sha256(path.read_bytes()).hexdigest()

    # A device with no state starts from (run seed, client id): reproducible, different per device.
    fresh = [build_model(COLOR_SPEC) for _ in range(3)]
    for m, (seed, cid) in zip(fresh, ((3, "a"), (3, "a"), (3, "b"))):
        DeviceState(tmp_path / "empty").load_into(m, device_seed(seed, cid))
    w = [m.specific[0].weight for m in fresh]
    assert torch.equal(w[0], w[1]) and not torch.equal(w[0], w[2])
    # State for another architecture is not forced in; no state directory is an error that says what to do.
    with caplog.at_level(logging.WARNING, logger="fedge.dfl"):
        assert DeviceState(tmp_path / "dev1").load_into(build_model({**COLOR_SPEC, "specific_width": 0.5}), 1) is None
    assert "another architecture" in caplog.text
    with pytest.raises(ObjectiveError, match="--state-dir"):
        dfl_train(model, colored, hyper, TaskContext(seed=1, round=1, client_id="x", state_dir=None,
                                                     profiler=Profiler()))



def test_a_task_sent_again_after_a_resume_trains_from_the_state_before_it(tmp_path, colored):
    """A coordinator resumed from its last checkpoint sends the round in flight again: a device that had
    trained it starts again from the state before it, so its branches are the same as if it ran once."""
    hyper = {"train": {"batch_size": 32, "lr": 0.05}, "dfl": {"init_seed": 3}}
    path = tmp_path / "dev1" / STATE_FILE

    def train(round: int, seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)   # the received invariant branch: the same in every call
        dfl_train(build_model(COLOR_SPEC), colored, hyper, TaskContext(seed=seed, round=round, client_id="dev1",
                                                                   state_dir=tmp_path / "dev1", profiler=Profiler()))
        return load_file(path)

    after_1 = train(1, 11)
    after_2 = train(2, 12)
    again = train(2, 12)       # round 2 once more, as a resumed run sends it
    assert all(torch.equal(again[k], after_2[k]) for k in after_2)
    assert all(torch.equal(v, after_1[k]) for k, v in load_file(tmp_path / "dev1" / PREVIOUS_FILE).items())
    after_3 = train(3, 13)     # the next round goes on from round 2's state, once
    assert not all(torch.equal(after_3[k], after_2[k]) for k in after_2)
    assert all(torch.equal(v, after_2[k]) for k, v in load_file(tmp_path / "dev1" / PREVIOUS_FILE).items())
    # Round 1 sent again to a device that had no state before it: it initializes as it did the first time.
    first = tmp_path / "fresh"
    for _ in range(2):
        torch.manual_seed(0)
        dfl_train(build_model(COLOR_SPEC), colored, hyper, TaskContext(seed=11, round=1, client_id="dev1",
                                                                   state_dir=first, profiler=Profiler()))
    once = load_file(first / STATE_FILE)
    assert all(torch.equal(once[k], after_1[k]) for k in after_1)


def test_evaluate_can_refresh_the_device_branches_first_and_keeps_nothing(tmp_path, digits):
    x, y = client_split(digits, "attribute:color:3", 0, 3, 0)
    n = len(y) * 3 // 4
    data = LocalData(*(torch.from_numpy(a) for a in (x[:n], y[:n], x[n:], y[n:])))
    model = build_model(COLOR_SPEC)
    hyper = {"train": {"batch_size": 32, "lr": 0.05}, "dfl": {"init_seed": 3}}
    dfl_train(model, data, hyper, context(tmp_path))
    state_file = tmp_path / "dev1" / STATE_FILE
    saved = state_file.read_bytes()
    invariant = snapshot(model, "invariant")

    served = dfl_evaluate(model, data, {"dfl": {"init_seed": 3}}, context(tmp_path, round=2)).metrics
    refreshed = dfl_evaluate(model, data, {**hyper, "dfl": {"init_seed": 3, "refresh_epochs": 2}},
                             context(tmp_path, round=2)).metrics
    assert refreshed["local_loss"] != served["local_loss"]          # the device's branches learned first
    assert changed(invariant, model) == set()                        # against the received invariant, frozen
    assert state_file.read_bytes() == saved                          # an evaluation keeps nothing
    again = dfl_evaluate(model, data, {"dfl": {"init_seed": 3}}, context(tmp_path, round=2)).metrics
    assert again == served
    with pytest.raises(ObjectiveError, match="must not be negative"):
        dfl_evaluate(model, data, {"dfl": {"refresh_epochs": -1}}, context(tmp_path))

# --------------------------------------------------------------------------- strategy and uploads

def dfl_config(out: Path, **sets):
    base = {"run__strategy": "dfl", "run__rounds": 2, "run__out": str(out), "model__name": "cnn",
            "data__eval": "digits", "data__partition": "attribute:color:3", "data__local_test_fraction": 0.25,
            "clients__expected": 3, "clients__spawn": 3, "clients__round_timeout": 60.0,
            "clients__presence_timeout": 60.0, "transport__kind": "inproc"}
    base.update(sets)
    return load_config(None, [(*key.split("__", 1), value) for key, value in base.items()])


def test_uploads_carry_only_the_invariant_branch(tmp_path, digits, announce_running, client_thread):
    strategy = make_strategy(dfl_config(tmp_path / "run"))
    spec = strategy.model_spec({"name": "cnn", "num_classes": 10, "in_channels": 3, "image_size": 8})
    assert spec["name"] == "dfl" and spec["backbone"] == "cnn"
    model = build_model(spec)
    state = strategy.initialize(spec, {k: v for k, v in model.state_dict().items() if k in federated_names(model)})
    invariant = part_names(state.params, "invariant")
    assert sorted(state.params) == invariant and invariant
    [plan] = strategy.configure("train", 1, state, ["dev1"])
    assert plan.up == invariant and sorted(plan.down) == invariant

    hub, topics = InprocHub(), Topics()
    x, y = client_split(digits, "attribute:color:3", 0, 3, 0)
    client = EdgeClient(ClientSettings(client_id="dev1", state_dir=tmp_path / "dev1"), hub.connect("dev1"),
                        LocalData(torch.from_numpy(x), torch.from_numpy(y)))
    running = client_thread(client)
    me = hub.connect("coord")
    me.subscribe(topics.client("dev1", "result"))
    announce_running(me)
    body = {"objective": plan.objective, "hyper": plan.hyper, "model": spec, "up": plan.up, "seed": 0,
            "timeout": 30, "resend_every": 30}
    me.publish(topics.client("dev1", "task"), encode("task", run_id="r", round=1, task_id="t1",
                                                     sender="coordinator", body=body, tensors=plan.down))
    incoming = me.get(60)
    running.stop()
    assert incoming is not None
    result = decode(incoming.payload)
    assert "error" not in result.body, result.body
    assert sorted(result.tensors) == invariant
    assert (tmp_path / "dev1" / STATE_FILE).is_file()


def test_the_invariant_extractors_mean_update_takes_the_configured_server_step(tmp_path):
    """DFL with ``[server] optimizer``: the weighted mean of the invariant updates is the pseudo-gradient, stepped
    exactly as the optimizer steps any strategy's update; with none, the plain step is DFL's own average."""
    from coordinator.strategies.base import ClientResult, WeightedSum
    from methods.fedyogi.strategy import FedYogiSection, FedYogiStep

    yogi = make_strategy(dfl_config(tmp_path / "y", server__optimizer="fedyogi", fedyogi__lr=0.1))
    plain = make_strategy(dfl_config(tmp_path / "p"))
    spec = yogi.model_spec({"name": "cnn", "num_classes": 10, "in_channels": 3, "image_size": 8})
    model = build_model(spec)
    state = yogi.initialize(spec, {k: v for k, v in model.state_dict().items() if k in federated_names(model)})
    g = torch.Generator().manual_seed(0)
    results = [ClientResult(f"dev{i}", 10 * (i + 1), {}, deltas={k: torch.randn(v.shape, generator=g) * 0.01
                                                                 for k, v in state.params.items()})
               for i in range(3)]
    mean = WeightedSum.reduce(WeightedSum.of(r.deltas, r.num_samples) for r in results).mean(torch.float64)
    stepped = yogi.aggregate_train(1, state, results)
    expected = FedYogiStep(FedYogiSection(lr=0.1)).step(1, state, mean)
    assert stepped.params.keys() == state.params.keys() and stepped.buffers.keys() == expected.buffers.keys()
    assert all(torch.equal(stepped.params[k], expected.params[k]) for k in state.params)
    averaged = plain.aggregate_train(1, state, results)
    assert not averaged.buffers
    assert all(torch.equal(averaged.params[k], (state.params[k].double() + mean[k]).float()) for k in state.params)


def test_dfl_config_errors_say_what_to_set(tmp_path):
    with pytest.raises(ConfigError, match="local_test_fraction"):
        make_strategy(dfl_config(tmp_path / "a", data__local_test_fraction=0.0))
    strategy = make_strategy(dfl_config(tmp_path / "b"))
    with pytest.raises(ConfigError, match="backbone"):
        strategy.model_spec({"name": "dfl", "num_classes": 10, "in_channels": 3, "image_size": 8})


def test_finetune_epochs_refresh_each_device_before_it_is_tested(tmp_path):
    """eval.finetune_epochs is DFL's refresh: the evaluate tasks carry it and the training settings."""
    strategy = make_strategy(dfl_config(tmp_path / "plain", eval__finetune_epochs=2))
    empty = ServerState(round=1, params={}, spec={})
    [plan] = strategy.configure_evaluate(1, empty, ["dev1"])
    assert plan.hyper["dfl"]["refresh_epochs"] == 2 and plan.hyper["train"] == strategy.train
    [plan] = make_strategy(dfl_config(tmp_path / "plain")).configure_evaluate(1, empty, ["dev1"])
    assert "refresh_epochs" not in plan.hyper["dfl"]   # the task as before: older devices take it

    rows = {}
    for name, epochs in (("plain", 0), ("refreshed", 1)):
        result = run_federated(dfl_config(tmp_path / name, eval__finetune_epochs=epochs), say=lambda s: None)
        rows[name] = [json.loads(line) for line in (result.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["personalized_clients"] == 3 for r in rows["refreshed"][1:])
    assert rows["refreshed"][-1]["personalized_accuracy_mean"] != rows["plain"][-1]["personalized_accuracy_mean"]
    assert [r["train_loss"] for r in rows["refreshed"][1:]] == [r["train_loss"] for r in rows["plain"][1:]]


def test_diversity_relays_other_clients_specific_branches(tmp_path):
    result = run_federated(dfl_config(tmp_path / "run", dfl__diversity=2, dfl__specific_width=0.5),
                           say=lambda s: None)
    rows = [json.loads(line) for line in (result.out_dir / "metrics.jsonl").read_text().splitlines()]
    spec = result.summary["model"]
    model = build_model(spec)
    specific_bytes = 4 * sum(p.numel() for p in model.specific.parameters())
    # round 1: nothing banked yet; round 2: two peers' specific extractors go down to each client
    assert rows[2]["bytes_down_per_client"] - rows[1]["bytes_down_per_client"] > 1.9 * specific_bytes
    assert rows[1]["bytes_up_per_client"] > specific_bytes          # each client's own specific branch went up
    checkpoint = load_file(result.out_dir / "checkpoints" / "round_0002.safetensors")
    assert {k.split("/")[1] for k in checkpoint if k.startswith("bank/")} == {"sim-000", "sim-001", "sim-002"}
    assert all(r["personalized_clients"] == 3 for r in rows[1:])


# --------------------------------------------------------------------------- over MQTT, with a restart

def _client_cmd(broker: str, prefix: str, index: int, state_dir: Path) -> list[str]:
    return [sys.executable, "-m", "edge_client.cli", "run", "--broker", broker, "--client-id", f"dev-{index}",
            "--data", "digits", "--partition", "attribute:color:2", "--partition-index", str(index),
            "--num-partitions", "2", "--seed", "0", "--local-test-fraction", "0.25", "--state-dir", str(state_dir),
            "--prefix", prefix, "--torch-threads", "1", "--exit-after-run"]


def test_dfl_over_mqtt_survives_a_client_restart(tmp_path, mosquitto, prefix):
    config = dfl_config(tmp_path / "run", run__rounds=3, clients__expected=2, clients__spawn=0,
                        clients__round_timeout=20.0, transport__kind="mqtt", transport__broker=mosquitto,
                        transport__prefix=prefix, data__partition="attribute:color:2")
    states = [tmp_path / f"dev-{i}" for i in range(2)]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    procs = [subprocess.Popen(_client_cmd(mosquitto, prefix, i, states[i]), env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for i in range(2)]
    outcome: dict = {}
    coordinator = threading.Thread(target=lambda: outcome.update(result=run_federated(config, say=lambda s: None)),
                                   daemon=True)
    coordinator.start()
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and any(json.loads(line)["round"] >= 1
                                            for line in metrics.read_text().splitlines())):
            assert time.monotonic() < deadline and coordinator.is_alive(), "round 1 never finished"
            time.sleep(0.05)
        procs[0].send_signal(signal.SIGKILL)   # a Raspberry Pi losing power
        procs[0].wait()
        at_kill = hashlib.sha256((states[0] / STATE_FILE).read_bytes()).hexdigest()
        killed_at = time.time()
        procs[0] = subprocess.Popen(_client_cmd(mosquitto, prefix, 0, states[0]), env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        coordinator.join(180)
        assert "result" in outcome, "the run did not finish"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
            proc.wait(30)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    assert all(r["personalized_clients"] >= 1 for r in rows[1:]) and rows[-1]["personalized_clients"] == 2
    assert rows[1]["dfl_fresh_clients"] == 2 and all(r["dfl_fresh_clients"] == 0 for r in rows[2:])
    history = [r for r in read_jsonl(states[0] / "profile.jsonl") if r["kind"] == "dfl_state"]
    after = [r for r in history if r["time"] > killed_at]
    assert after, "the restarted client never trained"
    assert after[0]["loaded"] == at_kill          # it went on from exactly the bytes it had saved
    assert all(r["loaded"] is not None for r in history[1:])
