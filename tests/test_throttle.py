"""Bad-message warnings stay readable and cheap under a flood: a few lines per kind, then a count."""

from __future__ import annotations

import logging

from edge_client.wire.throttle import ThrottledLog


def test_a_flood_of_one_kind_gives_a_few_lines_and_one_count(caplog):
    now = [0.0]
    throttled = ThrottledLog(logging.getLogger("fedge.test.throttle"), interval=10.0, burst=3, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="fedge.test.throttle"):
        for i in range(10_000):
            throttled.warning("rejected result from %s: message of %d bytes exceeds the limit", "pi-07", 70_000 + i)
        throttled.warning("rejected result from %s: not a fedge envelope", "pi-07")
        assert len(caplog.records) == 4            # 3 of the flood, and the first of another kind
        now[0] = 10.5
        throttled.flush()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[-1].startswith("9997 more like this in the last 10 s: rejected result from pi-07: message of 70000 bytes")
    assert len(lines) == 5
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedge.test.throttle"):
        throttled.warning("rejected result from %s: message of %d bytes exceeds the limit", "pi-07", 1)
    assert len(caplog.records) == 1                # a new interval logs the kind again
