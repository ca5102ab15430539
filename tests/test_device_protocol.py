"""The device protocol on its own: events in, actions out, the clock passed in (no broker, no training)."""

from __future__ import annotations

import hashlib
import logging
import random

import pytest
import torch

from edge_client.device_protocol import ONLINE_LINE, Actions, DeviceProtocol, Task
from edge_client.wire.protocol import PresenceBody, Topics, decode, encode

T = Topics()
ME = "dev1"
SESSION_A, SESSION_B = "aaaa", "bbbb"


def status(run: str, state: str, round: int = 1, session: str = "") -> bytes:
    body = {"state": state, **({"session": session} if session else {})}
    return encode("status", run_id=run, round=round, task_id="", sender="coordinator", body=body)


def ack(task_id: str, state: str = "ack", reason: str = "") -> bytes:
    body = {"state": state, "task_id": task_id, **({"reason": reason} if reason else {})}
    return encode("status", run_id="live", round=1, task_id=task_id, sender="coordinator", body=body)


def task(task_id: str, run: str = "live", round: int = 1, **extra: object) -> bytes:
    body = {"objective": "train", "model": {"name": "mlp"}, "up": ["w"], "timeout": 20, "resend_every": 2, **extra}
    return encode("task", run_id=run, round=round, task_id=task_id, sender="coordinator", body=body)


def model(round: int = 1) -> bytes:
    return encode("model", run_id="live", round=round, task_id="", sender="coordinator", body={"codec": "fp32"},
                  tensors={"w": torch.full((3,), float(round))})


def digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


class Device:
    """A protocol and its clock; every event's actions are returned and kept."""

    def __init__(self, **options: object) -> None:
        self.p = DeviceProtocol(ME, T, **options)
        self.now = 100.0

    def on(self, topic: str, payload: bytes) -> Actions:
        return self.p.handle(topic, payload, self.now)

    def task(self, payload: bytes) -> Actions:
        return self.on(T.client(ME, "task"), payload)

    def status(self, payload: bytes) -> Actions:
        return self.on(T.coordinator_status, payload)

    def later(self, seconds: float) -> Actions:
        self.now += seconds
        return self.p.tick(self.now)

    def answer(self, t: Task, payload: bytes = b"result") -> Actions:
        return self.p.answered(t, payload, self.now)


def results(actions: Actions) -> list[bytes]:
    return [p.payload for p in actions.publish if p.topic == T.client(ME, "result")]


def kinds(actions: Actions) -> list[str]:
    return [n.kind for n in actions.notes]


def ran(actions: Actions) -> list[str]:
    return [t.msg.task_id for t in actions.run]


def test_start_subscribes_then_announce_says_online_and_its_echo_is_expected():
    d = Device(presence_echo_timeout=10.0)
    assert (T.client(ME, "task"), False) in d.p.start().subscribe
    announce = d.p.announce(PresenceBody("online", num_samples=5), d.now)
    (presence,) = announce.publish
    assert presence.announce and presence.retain and presence.topic == T.client(ME, "presence")
    assert d.p.due() == pytest.approx(110.0)
    assert kinds(d.later(11)) == ["unseen"] and kinds(d.later(30)) == []   # said once
    echoed = Device()
    (own,) = echoed.p.announce(PresenceBody("online"), echoed.now).publish
    echoed.on(T.client(ME, "presence"), presence.payload)   # another presence than ours: no echo
    assert echoed.p.due() is not None
    said = echoed.on(T.client(ME, "presence"), own.payload)
    assert [(n.kind, n.text) for n in said.notes] == [("activity", f"{ONLINE_LINE} {T.client(ME, 'presence')}")]
    assert echoed.on(T.client(ME, "presence"), own.payload).notes == []   # said once per announcement
    assert kinds(echoed.later(60)) == [] and echoed.p.due() is None
    (offline,) = d.p.leave().publish
    assert offline.retain and decode(offline.payload).body["state"] == "offline"


def test_a_task_of_the_running_run_runs_once_and_its_result_goes_until_acknowledged():
    d = Device()
    d.status(status("live", "running"))
    first = d.task(task("t1"))
    assert ran(first) == ["t1"] and [t.msg.task_id for t in first.accepted] == ["t1"]
    assert len(first.arrived) == 1
    sent = d.answer(first.run[0], b"r1")
    assert results(sent) == [b"r1"] and sent.publish[0].result_of == "t1"
    assert results(d.later(1.0)) == []                 # resend_every is 2 s
    assert results(d.later(1.5)) == [b"r1"]
    assert results(d.later(3.9)) == [] and results(d.later(0.2)) == [b"r1"]   # then waits twice as long: 4 s
    again = d.task(task("t1"))                         # delivered again before the ack: the same result, now
    assert ran(again) == [] and results(again) == [b"r1"]
    acked = d.on(T.client(ME, "status"), ack("t1"))
    assert [s.task_id for s in acked.acks] == ["t1"] and d.p.done == {"t1": None}
    assert results(d.later(5)) == [] and d.p.due() is None
    assert ran(d.task(task("t1"))) == [] and results(d.task(task("t1"))) == []   # acknowledged: nothing kept


def test_a_result_is_given_up_after_the_task_timeout_or_when_a_later_round_is_announced():
    d = Device()
    d.status(status("live", "running"))
    d.answer(d.task(task("t1")).run[0])
    assert results(d.later(21)) == []                  # timeout 20 s
    d.answer(d.task(task("t2", round=2)).run[0])
    d.status(status("live", "running", round=3))
    assert results(d.later(3)) == []


def test_a_closed_task_is_not_run_and_a_closed_result_goes_until_acknowledged_past_a_later_round():
    d = Device()
    d.status(status("live", "running"))
    closed = d.on(T.client(ME, "status"), ack("t0", "closed", "round 1 closed with the 3 results it counts"))
    assert kinds(closed) == ["closed"] and "3 results" in closed.notes[0].text
    skipped = d.task(task("t0"))                       # came after its round closed (a queue behind a long task)
    assert ran(skipped) == [] and kinds(skipped) == ["stale"]
    d.answer(d.task(task("t1")).run[0], b"r1")         # closed while training: its result goes, late
    d.on(T.client(ME, "status"), ack("t1", "closed"))
    d.status(status("live", "running", round=2))       # a later round no longer stops a closed result
    assert results(d.later(2.5)) == [b"r1"]
    assert [s.task_id for s in d.on(T.client(ME, "status"), ack("t1")).acks] == ["t1"]
    assert results(d.later(10)) == [] and d.p.due() is None


def test_a_rejected_result_is_logged_with_its_reason_and_not_sent_again():
    d = Device()
    d.status(status("live", "running"))
    d.answer(d.task(task("t1")).run[0])
    out = d.on(T.client(ME, "status"), ack("t1", "rejected", "bad shapes"))
    assert kinds(out) == ["rejected"] and "bad shapes" in out.notes[0].text
    assert out.notes[0].level == logging.WARNING and results(d.later(3)) == []


def test_stale_and_other_runs_tasks_are_skipped_with_a_reason():
    d = Device()
    d.status(status("live", "running", round=3))
    stale = d.task(task("old", round=2))
    assert ran(stale) == [] and kinds(stale) == ["stale"]
    other = d.task(task("x", run="dead", round=3))
    assert ran(other) == [] and kinds(other) == ["dropped"] and "not the coordinator's current run" in other.notes[0].text


def test_tasks_before_any_run_status_wait_for_it_and_the_device_says_so_once():
    d = Device()
    for i in range(10):   # what a persistent session replays: one of them queued by a dead run
        assert ran(d.task(task(f"t{i}", run="dead" if i == 5 else "live"))) == []
    assert kinds(d.later(16)) == ["parked"] and kinds(d.later(16)) == []
    out = d.status(status("live", "running"))
    # the newest 8 were kept (the coordinator re-sends the others); the dead run's is dropped
    assert ran(out) == ["t2", "t3", "t4", "t6", "t7", "t8", "t9"] and kinds(out) == ["dropped"]
    assert out.run_status == ("live", 1, "running")


def test_a_resumed_run_under_a_new_session_runs_its_rounds_again_and_drops_the_old_result():
    d = Device()
    d.status(status("live", "running", round=4, session=SESSION_A))
    d.answer(d.task(task("r4", round=4, session=SESSION_A)).run[0])
    out = d.status(status("live", "running", round=3, session=SESSION_B))
    assert kinds(out) == ["activity"] and "resumed by its coordinator at round 3" in out.notes[0].text
    assert results(d.later(3)) == []                   # the old result is late for the new session at best
    assert ran(d.task(task("r3", round=3, session=SESSION_B))) == ["r3"]
    old = d.task(task("r4b", round=4, session=SESSION_A))
    assert ran(old) == [] and "since stopped" in old.notes[0].text


def test_stopped_and_finished_runs():
    d = Device(exit_after_run=True)
    d.status(status("live", "running"))
    d.answer(d.task(task("t1")).run[0])
    stopped = d.status(status("live", "stopped"))
    assert kinds(stopped) == ["activity"] and "stopped by its coordinator" in stopped.notes[0].text
    assert results(d.later(3)) == []                   # its queued work is waste now
    assert kinds(d.task(task("t2"))) == ["dropped"]
    d.status(status("other", "finished"))
    assert not d.p.finished                            # a run this device never saw
    out = d.status(status("live", "finished"))
    assert kinds(out) == ["activity"] and d.p.finished and out.run_status == ("live", 1, "finished")
    stays = Device()
    stays.status(status("live", "running"))
    stays.status(status("live", "finished"))
    assert not stays.p.finished                        # without exit_after_run the device stays


def test_a_task_waits_for_its_broadcast_and_runs_when_it_comes():
    d = Device()
    d.status(status("live", "running"))
    wanted, other = model(2), model(1)
    out = d.task(task("t1", broadcast=digest(wanted)))
    assert ran(out) == [] and out.subscribe == [(T.model, True)]
    assert d.on(T.model, other).run == []              # not the one it waits for
    d.now += 1.5
    got = d.on(T.model, wanted)
    assert ran(got) == ["t1"] and got.unsubscribe == [(T.model, True)]
    assert got.run[0].fetch_seconds == pytest.approx(1.5)
    assert ran(d.task(task("t2", round=2, broadcast=digest(wanted)))) == ["t2"]   # held now: no wait


def test_a_broadcast_that_never_comes_is_given_up_at_half_the_timeout_with_what_came_instead():
    d = Device()
    d.status(status("live", "running"))
    d.task(task("t1", broadcast="ab" * 32))
    d.on(T.model, model(1))
    d.on(T.model, b"not a broadcast")
    assert ran(d.later(9)) == []
    out = d.later(2)                                   # past 10 s, half of the 20 s timeout
    assert ran(out) == ["t1"] and out.unsubscribe == [(T.model, True)]
    why = out.run[0].no_broadcast
    assert "did not arrive within 10 s" in why and "broadcast of round 1" in why and "refused" in why
    dropped = Device()
    dropped.status(status("live", "running"))
    dropped.task(task("t1", broadcast="ab" * 32))
    dropped.p.note_disconnects(2)
    assert "dropped 2 time(s)" in dropped.later(11).run[0].no_broadcast


def test_a_task_whose_body_does_not_parse_is_answered_at_once_with_the_reason():
    d = Device()
    d.status(status("live", "running"))
    out = d.task(task("t1", up="w", broadcast="ab" * 32))
    (bad,) = out.run
    assert bad.body is None and "up" in bad.problem and out.subscribe == []   # no broadcast fetched for it
    assert bad.timeout == 600.0


def test_a_result_over_the_brokers_limit_becomes_an_error_and_other_send_failures_stop_sending():
    d = Device()
    d.status(status("live", "running"))
    d.answer(d.task(task("t1")).run[0])
    out = d.p.send_failed("t1", "over the packet limit", too_large=True)
    assert kinds(out) == ["unsent"] and out.notes[0].level == logging.ERROR
    (error,) = results(d.later(0.1))
    assert decode(error).body["error"] == "over the packet limit"
    d.p.send_failed("t1", "connection refused", too_large=False)
    assert results(d.later(3)) == []


@pytest.mark.parametrize("topic", [T.client(ME, "task"), T.client(ME, "status"), T.coordinator_status, T.model,
                                   T.client(ME, "presence"), "fedge/elsewhere"])
def test_bad_messages_are_refused_with_a_reason_and_never_raise(topic):
    d = Device()
    d.status(status("live", "running"))
    rng = random.Random(topic)
    good = [task("t1"), status("live", "running"), ack("t1"), model()]
    payloads = [b"", b"x", b"\x00" * 8, b"\xff" * 64] + [g[:rng.randrange(len(g))] for g in good for _ in range(5)]
    payloads += [bytes(rng.randrange(256) for _ in range(rng.randrange(200))) for _ in range(50)]
    for payload in payloads:
        out = d.on(topic, payload)
        assert out.run == [] and out.publish == []
        assert all(n.text for n in out.notes if n.kind == "ignored")
    bad_bodies = [encode("status", run_id="live", round=1, task_id="", sender="coordinator", body={"state": "nope"}),
                  encode("model", run_id="live", round=1, task_id="", sender="coordinator", body={"codec": "??"})]
    for payload in bad_bodies:
        out = d.on(topic, payload)
        assert out.run == [] and out.publish == []
    refused = d.on(T.coordinator_status, bad_bodies[0])
    assert kinds(refused) == ["ignored"] and "state" in refused.notes[0].text
    assert kinds(d.on(T.model, bad_bodies[1])) == ["ignored"]
    assert kinds(d.p.lost(topic, "a chunk is missing")) == ["lost"]


def test_due_is_the_next_resend_or_give_up():
    d = Device()
    assert d.p.due() is None
    d.status(status("live", "running"))
    d.task(task("t1", broadcast="ab" * 32))
    assert d.p.due() == pytest.approx(110.0)
    t = d.later(11).run[0]
    d.answer(t)
    assert d.p.due() == pytest.approx(d.now + 2.0)
