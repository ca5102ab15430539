"""bench/dashboard_render.py reads the Grafana dashboard as Grafana would: layout, variables, legends, units."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from dashboard_render import (axis_labels, axis_ticks, format_value, legend_name, page_height, panel_boxes,  # noqa: E402
                              rate_interval, substitute, unit_scale, variable_values)

DASHBOARD = json.loads((ROOT / "deploy" / "grafana-fedge.json").read_text())


def test_panels_sit_on_grafanas_grid():
    """24 columns and 23 gaps of 8 px fill the width; a row is 30 px plus its gap."""
    width = 24 * 50 + 23 * 8
    full, left, right = panel_boxes([{"gridPos": {"x": 0, "y": 0, "w": 24, "h": 4}},
                                     {"gridPos": {"x": 0, "y": 4, "w": 12, "h": 8}},
                                     {"gridPos": {"x": 12, "y": 4, "w": 12, "h": 8}}], width)
    assert (full.left, full.top, full.width, full.height) == (0, 0, width, 4 * 30 + 3 * 8)
    assert (left.top, left.height) == (4 * 38, 8 * 30 + 7 * 8)
    assert left.left + left.width + 8 == right.left and right.left + right.width == width
    with pytest.raises(ValueError, match="24-column grid"):
        panel_boxes([{"title": "wide", "gridPos": {"x": 20, "y": 0, "w": 6, "h": 4}}], width)


def test_the_dashboards_panels_do_not_overlap_and_fill_the_page():
    boxes = panel_boxes(DASHBOARD["panels"], 1384)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            apart = (a.left + a.width <= b.left or b.left + b.width <= a.left or
                     a.top + a.height <= b.top or b.top + b.height <= a.top)
            assert apart, (a, b)
    assert max(b.top + b.height for b in boxes) + 8 <= page_height(DASHBOARD["panels"]) - 56 + 8


def test_variables_take_their_all_value_and_every_query_expands():
    values = {**variable_values(DASHBOARD), "__rate_interval": "4s"}
    assert values["instance"] == ".*"
    assert substitute('max(fedge_round{instance=~"$instance"})', values) == 'max(fedge_round{instance=~".*"})'
    assert substitute("rate(x[$__rate_interval]) + y{i=~\"${instance}\"} + [[instance]]", values) == \
        'rate(x[4s]) + y{i=~".*"} + .*'
    for panel in DASHBOARD["panels"]:
        for target in panel["targets"]:
            assert "$" not in substitute(target["expr"], values)
    with pytest.raises(ValueError, match=r"\$site"):
        substitute('x{site="$site"}', values)
    with pytest.raises(ValueError, match="allValue"):
        variable_values({"templating": {"list": [{"name": "site", "type": "query", "includeAll": False}]}})


def test_rate_interval_follows_grafanas_rule():
    assert rate_interval(60, 1, 300) == "4s"       # four scrapes
    assert rate_interval(3600, 1, 300) == "13s"    # $__interval (12 s) + a scrape
    assert rate_interval(60, 15, 300) == "60s"


def test_legends_and_units_read_as_in_grafana():
    assert legend_name("{{device_class}} {{site}}", {"device_class": "pi4"}) == "pi4"
    assert legend_name("task p{{quantile}}", {"quantile": "0.9"}) == "task p0.9"
    assert legend_name("", {"__name__": "up", "job": "fedge"}) == 'up{job="fedge"}'
    assert format_value(0.9554, "percentunit") == "95.5%"
    assert format_value(0.604, "s") == "604 ms" and format_value(2.5, "s") == "2.50 s"
    assert format_value(1_230_000, "Bps") == "1.23 MB/s" and format_value(335 * 2**20, "bytes") == "335 MiB"
    assert format_value(10, None) == "10" and format_value(float("nan"), "s") == "—"
    assert axis_labels([333.5 * 2**20, 334 * 2**20, 334.5 * 2**20], "bytes") == ["333.5 MiB", "334 MiB", "334.5 MiB"]
    assert axis_labels([0, 0.8, 1.6], None) == ["0", "0.8", "1.6"]
    assert axis_labels([0, 400e3, 1.2e6], "Bps") == ["0 B/s", "400 kB/s", "1.2 MB/s"]


def test_axis_ticks_are_round_in_the_prefix_shown():
    mib = 2**20
    assert unit_scale(334 * mib, "bytes") == mib and unit_scale(1.2e6, "Bps") == 1e6 and unit_scale(5, "s") == 1
    ticks = axis_ticks(333.7 * mib, 334.6 * mib, "bytes")
    assert axis_labels(ticks, "bytes") == ["333.8 MiB", "334 MiB", "334.2 MiB", "334.4 MiB", "334.6 MiB"]
    assert axis_ticks(0, 4, None, count=4) == [0, 1, 2, 3, 4]
