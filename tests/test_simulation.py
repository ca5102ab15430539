"""Simulated clients in one process: data views of one shared array, tasks on a few workers."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from coordinator.config import load_config
from coordinator.runtime.run import run_federated
from coordinator.runtime.simulation import ClientPool, available_cores
from coordinator.ops.spawn import sim_client_id, spawn_threads
from edge_client.client import ClientSettings, EdgeClient
from edge_client.data import arrange_clients, client_split, load_dataset, partition_indices
from edge_client.objectives import LocalData, holdout_seed, local_data, local_data_view
from edge_client.registry import build_model
from edge_client.wire.protocol import Topics, decode, encode
from edge_client.wire.transport import InprocHub
from storage.checkpoint import latest_checkpoint, load_checkpoint


def config_for(out: Path, **sets):
    base = {"run__rounds": 2, "run__out": str(out), "model__name": "cnn", "data__eval": "digits",
            "clients__expected": 6, "clients__per_round": 3, "clients__spawn": 6, "transport__kind": "inproc",
            "clients__round_timeout": 60.0, "clients__presence_timeout": 60.0, "export__enabled": False}
    base.update(sets)
    return load_config(None, [(*key.split("__", 1), value) for key, value in base.items()])


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.mark.parametrize("spec, fraction", [("dirichlet:0.5", 0.2), ("iid", 0.0), ("attribute:rotate:3", 0.25),
                                            ("attribute:colorlabel:3:0.8", 0.25)])
def test_a_simulated_client_holds_the_rows_a_device_holds(digits, spec, fraction):
    ids = [sim_client_id(i) for i in range(6)]
    rows = arrange_clients(digits, spec, 6, 7, fraction, [holdout_seed(7, cid) for cid in ids])
    for i, cid in enumerate(ids):
        device = local_data(*client_split(digits, spec, i, 6, 7), fraction, seed=7, client_id=cid)
        view = local_data_view(rows, i, fraction)
        assert torch.equal(view.x, device.x) and torch.equal(view.y, device.y)
        if fraction:
            assert torch.equal(view.x_test, device.x_test) and torch.equal(view.y_test, device.y_test)
        else:
            assert view.x_test is None and device.x_test is None


def test_an_idle_simulated_client_holds_views_of_shared_arrays(digits, tmp_path):
    config = config_for(tmp_path, data__partition="dirichlet:0.5", data__local_test_fraction=0.2)
    hub = InprocHub()
    spawned = spawn_threads(config, 6, hub=hub, dataset=digits)
    try:
        parts = partition_indices(digits.y_train, "dirichlet:0.5", 6, config.run.seed)
        # Each client's train rows, then its test rows, then the next client's: slices of one array
        # of the train split's size, so clients add no copy of the data whatever their number.
        pieces = sorted((t.data_ptr(), t.nbytes) for c in spawned.clients for t in (c.data.x, c.data.x_test))
        start = pieces[0][0]
        for (ptr, size), (following, _) in zip(pieces, pieces[1:]):
            assert ptr + size == following
        assert pieces[-1][0] + pieces[-1][1] - start == digits.x_train.nbytes
        for client, part in zip(spawned.clients, parts):
            data = client.data
            assert len(data) + data.num_test == len(part)
        # no network per client: all share the pool's caches, one network per worker
        assert len({id(c._models) for c in spawned.clients}) == 1
        assert len({id(c._broadcasts) for c in spawned.clients}) == 1
    finally:
        spawned.stop()


def test_the_pool_and_a_thread_per_client_give_the_same_model(tmp_path):
    finals = {}
    for workers in (2, -1):
        config = config_for(tmp_path / f"w{workers}", data__partition="dirichlet:0.5", sim__workers=workers)
        result = run_federated(config, say=lambda s: None)
        state, _ = load_checkpoint(latest_checkpoint(result.out_dir / "checkpoints"))
        assert state.round == 2
        finals[workers] = state.params
    pooled, threaded = finals[2], finals[-1]
    assert sorted(pooled) == sorted(threaded)
    for name in pooled:
        torch.testing.assert_close(pooled[name], threaded[name], rtol=1e-5, atol=1e-6)


class _Recorder:
    """A stand-in client that records which thread steps it and with how many torch threads."""

    def __init__(self, client_id: str) -> None:
        self.settings = SimpleNamespace(client_id=client_id)
        self.finished = False
        self.steps: list[tuple[str, int]] = []
        self.left = 0

    def start(self) -> None:
        pass

    def step(self, timeout: float) -> bool:
        self.steps.append((threading.current_thread().name, torch.get_num_threads()))
        return False

    def leave(self) -> None:
        self.left += 1


def test_workers_take_their_share_of_the_cores_and_mail_wakes_its_client(wait_until):
    hub, topics = InprocHub(), Topics("sim")
    pool = ClientPool(hub, topics, workers=2)
    clients = [_Recorder("a"), _Recorder("b")]
    for client in clients:
        pool.add(client)   # type: ignore[arg-type]
    own = torch.get_num_threads()
    stop = threading.Event()
    threads = pool.start(stop)
    try:
        wait_until(lambda: all(c.steps for c in clients), "the pool never stepped its clients at start")
        before = len(clients[1].steps)
        hub.connect("coordinator").publish(topics.client("b", "task"), b"x")
        deadline = time.monotonic() + 2.0
        while len(clients[1].steps) == before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(clients[1].steps) > before
        assert torch.get_num_threads() == own   # the coordinator's thread keeps its count
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=5)
    steps = clients[0].steps + clients[1].steps
    assert {name for name, _ in steps} <= {"sim-worker-0", "sim-worker-1"}
    assert {n for _, n in steps} == {max(1, available_cores() // 2)}
    assert [c.left for c in clients] == [1, 1]


def test_a_client_stepped_by_hand_resends_until_acknowledged_then_keeps_no_copy(digits):
    spec = {"name": "mlp", "hidden": [8], "num_classes": 10, "in_channels": 1, "image_size": 8}
    hub, topics = InprocHub(), Topics()
    data = LocalData(torch.from_numpy(digits.x_train[:64]), torch.from_numpy(digits.y_train[:64]))
    client = EdgeClient(ClientSettings(client_id="dev1"), hub.connect("dev1"), data)
    coordinator = hub.connect("coordinator")
    coordinator.subscribe(topics.client("dev1", "result"))
    params = build_model(spec).state_dict()
    task = encode("task", run_id="live", round=1, task_id="t1", sender="coordinator", tensors=params,
                  body={"objective": "train", "hyper": {"epochs": 1}, "model": spec, "up": sorted(params), "seed": 1,
                        "timeout": 30, "resend_every": 30})
    coordinator.publish(topics.coordinator_status, encode("status", run_id="live", round=1, task_id="",
                                                          sender="coordinator", body={"state": "running"}),
                        retain=True)
    client.start()

    def results() -> list[str]:
        while client.step(0.0):
            pass
        out = []
        while (incoming := coordinator.get(0.0)) is not None:
            out.append(decode(incoming.payload).task_id)
        return out

    coordinator.publish(topics.client("dev1", "task"), task)
    assert results() == ["t1"] and client.tasks_run == 1
    coordinator.publish(topics.client("dev1", "task"), task)   # delivered again before the ack: the same result
    assert results() == ["t1"] and client.tasks_run == 1
    coordinator.publish(topics.client("dev1", "status"), encode("status", run_id="live", round=1, task_id="t1",
                                                                sender="coordinator",
                                                                body={"state": "ack", "task_id": "t1"}))
    coordinator.publish(topics.client("dev1", "task"), task)   # after it: nothing to send, nothing kept
    assert results() == [] and client.tasks_run == 1
    assert client._done == {"t1": None}
    client.leave()
