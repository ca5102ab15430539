"""A device trains only for the coordinator's current running run.

A device's persistent MQTT session keeps tasks a run queued while the device was
away; if that run died, training them costs the device a round's compute and the
next run counts the result as late. The retained run status says which run is
current, and it may arrive after the queued tasks.
"""

from __future__ import annotations

import logging
import time

import torch

from edge_client.client import ClientSettings, EdgeClient
from edge_client.device_protocol import ONLINE_LINE
from edge_client.data import load_dataset
from edge_client.objectives import LocalData
from edge_client.registry import build_model
from edge_client.wire.protocol import Topics, decode, encode
from edge_client.wire.transport import InprocHub

SPEC = {"name": "mlp", "hidden": [8], "num_classes": 10, "in_channels": 1, "image_size": 8}


def _client(hub: InprocHub) -> EdgeClient:
    digits = load_dataset("digits")
    return EdgeClient(ClientSettings(client_id="dev1"), hub.connect("dev1"),
                      LocalData(torch.from_numpy(digits.x_train[:64]), torch.from_numpy(digits.y_train[:64])))


def _task(run_id: str, task_id: str) -> bytes:
    params = build_model(SPEC).state_dict()
    body = {"objective": "train", "hyper": {"epochs": 1}, "model": SPEC, "up": sorted(params), "seed": 1,
            "timeout": 30, "resend_every": 30}
    return encode("task", run_id=run_id, round=1, task_id=task_id, sender="coordinator", body=body, tensors=params)


def _status(run_id: str, state: str) -> bytes:
    return encode("status", run_id=run_id, round=1, task_id="", sender="coordinator", body={"state": state})


def _online(hub: InprocHub, client_id: str, wait_until) -> None:
    """Return once the client announced itself, which it does after subscribing to its topics (and warming
    up torch, slow on a busy machine)."""
    watcher = hub.connect()
    watcher.subscribe(Topics().client(client_id, "presence"))
    wait_until(lambda: watcher.get(0.1), f"{client_id} never came online", timeout=60)
    watcher.close()


def _results(me, until: str, seconds: float = 30.0) -> set[str]:
    seen: set[str] = set()
    deadline = time.monotonic() + seconds
    while until not in seen and time.monotonic() < deadline:
        incoming = me.get(0.2)
        if incoming is not None:
            seen.add(decode(incoming.payload).task_id)
    return seen


def test_a_task_queued_by_a_dead_run_is_dropped_and_the_current_run_trains(caplog, client_thread, wait_until):
    caplog.set_level(logging.INFO, logger="fedge.client.activity")
    hub = InprocHub()
    client = _client(hub)
    running = client_thread(client)
    me, topics = hub.connect("coord"), Topics()
    me.subscribe(topics.client("dev1", "result"))
    _online(hub, "dev1", wait_until)
    # What a persistent session replays first: a task of run "dead", before any run status (the client takes
    # its messages in the order they were published).
    me.publish(topics.client("dev1", "task"), _task("dead", "stale"))
    me.publish(topics.coordinator_status, _status("live", "running"), retain=True)
    me.publish(topics.client("dev1", "task"), _task("live", "fresh"))
    seen = _results(me, until="fresh")
    running.stop()   # the task's line is logged just after its result is sent
    assert seen == {"fresh"}
    assert client.tasks_run == 1
    # The one line a person at the device sees for the task.
    lines = [r.getMessage() for r in caplog.records if r.name == "fedge.client.activity"]
    assert any(line.startswith("round 1: train on 64 samples in ") and " up, train loss " in line
               for line in lines), lines
    assert any(line.startswith(ONLINE_LINE) for line in lines), lines   # what the flash kit waits for


def test_a_task_that_came_before_its_run_status_runs_once_the_status_arrives(caplog, client_thread, wait_until):
    caplog.set_level(logging.INFO, logger="fedge.client")
    hub = InprocHub()
    client = _client(hub)
    running = client_thread(client)
    me, topics = hub.connect("coord"), Topics()
    me.subscribe(topics.client("dev1", "result"))
    _online(hub, "dev1", wait_until)
    me.publish(topics.client("dev1", "task"), _task("live", "early"))
    wait_until(lambda: client.protocol._parked, "the task was never parked")
    assert client.tasks_run == 0   # parked: no status says which run is current
    me.publish(topics.coordinator_status, _status("live", "running"), retain=True)
    seen = _results(me, until="early")
    me.publish(topics.coordinator_status, _status("live", "finished"), retain=True)
    me.publish(topics.client("dev1", "task"), _task("live", "after-the-end"))
    wait_until(lambda: any(m.startswith("dropped task after-the-end of run live") for m in caplog.messages),
               "the task after the end was not dropped")
    running.stop()
    while (incoming := me.get(0.0)) is not None:
        seen.add(decode(incoming.payload).task_id)
    assert seen == {"early"} and client.tasks_run == 1
