"""Each device's presence history, its prediction of the remaining online session, and the selection book kept
in the run's checkpoint."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from coordinator.runtime.availability import KEEP, PresenceHistory, likely_gone
from coordinator.runtime.engine import Coordinator, EvalData
from coordinator.runtime.device_book import BOOK_EXTRA, DeviceBook
from coordinator.runtime.presence import Roster
from coordinator.runtime.selection import Absences
from edge_client.device_protocol import presence_payload
from edge_client.wire.protocol import PresenceBody
from edge_client.wire.throttle import ThrottledLog
from edge_client.wire.transport import InprocHub
from profiling.schema import clean_profile
from storage.checkpoint import latest_checkpoint, load_checkpoint
from test_engine import make_coordinator


def history(sessions: dict[str, list[float]], online_at: float) -> PresenceHistory:
    h, t = PresenceHistory(), 0.0
    for c, lengths in sessions.items():
        for length in lengths:
            h.changed(c, True, t)
            h.changed(c, False, t + length)
            t += length + 100.0
        h.changed(c, True, online_at)
    return h


def test_the_remaining_session_is_the_mean_residual_of_the_device_own_sessions():
    h = history({"d": [100.0, 300.0, 600.0]}, online_at=10_000.0)
    assert h.remaining("d", 10_000.0, 2) == pytest.approx((100 + 300 + 600) / 3)
    assert h.remaining("d", 10_200.0, 2) == pytest.approx(((300 - 200) + (600 - 200)) / 2)   # only longer ones
    assert h.remaining("d", 10_700.0, 2) is None     # online longer than any session it had: unknown
    assert h.remaining("d", 10_000.0, 4) is None     # too few sessions
    assert h.remaining("unknown", 0.0, 1) is None
    h.changed("d", False, 10_050.0)
    assert h.remaining("d", 10_060.0, 2) is None     # offline now
    assert h.offline_for("d", 10_060.0) == pytest.approx(10.0)
    assert h.devices["d"].sessions[-1] == pytest.approx(50.0)


def test_sessions_are_bounded_and_repeated_presences_do_not_restart_a_session():
    h = PresenceHistory()
    for i in range(KEEP + 5):
        h.changed("d", True, 10.0 * i)
        h.changed("d", True, 10.0 * i + 1)   # announced again while online: the same session
        h.changed("d", False, 10.0 * i + 5)
    assert h.devices["d"].sessions == [5.0] * KEEP


def test_likely_gone_leaves_out_short_sessions_for_long_tasks_and_puts_back_when_needed():
    h = history({"flaky": [20.0, 20.0], "steady": [5000.0, 5000.0]}, online_at=1000.0)
    h.changed("steady", True, 1000.0)
    tasks = {"flaky": 60.0, "steady": 60.0, "quick": 60.0}
    keep, why = likely_gone(["flaky", "quick", "steady"], 0, h, tasks.get, 1000.0, 2)
    assert keep == ["quick", "steady"] and list(why) == ["flaky"] and "before its task's 60 s" in why["flaky"]
    assert likely_gone(["flaky", "steady"], 2, h, tasks.get, 1000.0, 2) == (["flaky", "steady"], {})
    assert likely_gone(["flaky"], 0, h, {"flaky": 5.0}.get, 1000.0, 2)[0] == ["flaky"]   # a short task fits


def test_the_roster_feeds_the_history_from_presences():
    h = PresenceHistory()
    roster = Roster(Absences(0), ThrottledLog(logging.getLogger("test")), history=h)
    roster.on_presence("d", presence_payload("d", PresenceBody(state="online", num_samples=5)))
    roster.on_presence("d", presence_payload("d", PresenceBody(state="online", num_samples=5)))
    assert h.devices["d"].online_since is not None and h.devices["d"].sessions == []
    roster.on_presence("d", presence_payload("d", PresenceBody(state="offline")))
    assert len(h.devices["d"].sessions) == 1 and h.devices["d"].online_since is None


def test_the_book_round_trips_through_json():
    book = DeviceBook()
    book.answered("d", 2.0, clean_profile({"samples": 10, "samples_per_second": 5.0, "peak_rss_bytes": 1000}),
                  {"train_loss_sq": 4.0}, 10, None)
    book.record("d").peaks[123] = 4567
    book.record("d").last_selected, book.record("d").picks = 3, 2
    book.presence.changed("d", True, 0.0)
    book.presence.changed("d", False, 50.0)
    book.presence.changed("d", True, 100.0)
    again = DeviceBook()
    again.restore(json.loads(json.dumps(book.saved())))
    rec = again.record("d")
    assert (rec.utility, rec.last_selected, rec.picks, rec.peaks) == (20.0, 3, 2, {123: 4567})
    assert again.completion_seconds("d") == pytest.approx(book.completion_seconds("d"))
    assert again.presence.devices["d"].sessions == [50.0]
    assert again.presence.devices["d"].online_since is None   # whether it stayed online meanwhile is unknown
    empty = DeviceBook()
    empty.restore(None)
    empty.restore({"devices": "garbage", "presence": 3})
    assert empty.devices == {}


def test_the_book_is_checkpointed_with_the_run_and_taken_back_on_resume(tmp_path):
    coord = make_coordinator(tmp_path, InprocHub(), expected=2, clients__selection="profile")
    coord.device_book.record("d").picks = 4
    coord.device_book.presence.changed("d", True, 0.0)
    coord.device_book.presence.changed("d", False, 30.0)
    coord.checkpoint()
    state, _ = load_checkpoint(latest_checkpoint(tmp_path / "checkpoints"))
    assert state.extra[BOOK_EXTRA]["devices"]["d"]["picks"] == 4
    resumed = Coordinator(coord.config, InprocHub().connect("coordinator"), run_id="run1", out_dir=tmp_path / "again",
                          strategy=coord.strategy, state=state, eval_data=EvalData(torch.zeros(1, 64), torch.zeros(1)))
    assert resumed.device_book.record("d").picks == 4 and resumed.device_book.presence.devices["d"].sessions == [30.0]
    plain = make_coordinator(tmp_path / "random", InprocHub(), expected=2)
    plain.checkpoint()
    state, _ = load_checkpoint(latest_checkpoint(tmp_path / "random" / "checkpoints"))
    assert BOOK_EXTRA not in state.extra   # random selection reads no book: its checkpoints are as before
