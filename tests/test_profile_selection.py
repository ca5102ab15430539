"""``clients.selection = "profile"``: the device book, eligibility, the Oort-style utility and exploration,
and the device's own memory check before a task."""

from __future__ import annotations

import math
import time

import pytest

from coordinator.config import ConfigError, load_config
from coordinator.runtime.device_book import DeviceBook, ModelSize
from coordinator.runtime.round_times import RoundTimes
from coordinator.runtime.selection import Absences, Sampler
from edge_client.memory_guard import SLACK, MemoryGuard, MemoryRefusal, estimate_task_bytes, parameter_count
from edge_client.registry import build_model
from edge_client.wire.protocol import encode
from profiling.memory import cgroup_memory
from profiling.schema import clean_device_facts, clean_profile
from test_engine import ScriptedClient, make_coordinator
from edge_client.wire.transport import InprocHub

MLP = {"name": "mlp", "hidden": [16], "num_classes": 10, "in_channels": 1, "image_size": 8}


def sampler(n_per_round: int, expected: int, *, model: ModelSize | None = None, min_results: int = 0,
            **selection) -> Sampler:
    overrides = [("clients", "expected", expected), ("clients", "per_round", n_per_round),
                 ("clients", "min_results", min_results),
                 ("clients", "selection", "profile"), *[("selection", k, v) for k, v in selection.items()]]
    return Sampler(load_config(None, overrides), Absences(0), RoundTimes(), DeviceBook(lambda: model))


def answer(book: DeviceBook, client: str, *, loss_sq: float = 1.0, samples: int = 10, speed: float = 100.0,
           round_seconds: float = 0.2, error: str | None = None, **profile) -> None:
    """A first answer as the intake hands it over: the checked profile, the metrics, the error."""
    book.answered(client, round_seconds, clean_profile({"samples": samples, "samples_per_second": speed, **profile}),
                  {"train_loss_sq": loss_sq}, samples, error)


def test_the_utility_ranks_by_loss_staleness_and_the_slowness_penalty_by_hand():
    s = sampler(1, 3, explore=0.0, alpha=2.0, staleness=0.1, preferred_seconds=1.0)
    book = s.book
    answer(book, "a", loss_sq=4.0, samples=10, speed=100.0, round_seconds=0.5)    # utility 10 * 2 = 20
    answer(book, "b", loss_sq=1.0, samples=10, speed=100.0, round_seconds=0.5)    # utility 10
    answer(book, "c", loss_sq=4.0, samples=10, speed=5.0, round_seconds=3.0)      # 20, but takes 3 s
    book.record("a").last_selected, book.record("b").last_selected, book.record("c").last_selected = 2, 1, 1
    assert book.completion_seconds("c") == pytest.approx(10 / 5.0 + (3.0 - 10 / 5.0))   # steps + the rest: 3 s
    bonus = {1: math.sqrt(0.1 * math.log(3) / 1), 2: math.sqrt(0.1 * math.log(3) / 2)}
    utility = s.profile.utilities(["a", "b", "c"], round=3)
    assert utility == pytest.approx({"a": 1.0 + bonus[2], "b": 0.5 + bonus[1], "c": (1.0 + bonus[1]) * (1 / 3) ** 2})
    assert s.draw(["a", "b", "c"], 3, 0).clients == ["a"]


def test_exploration_covers_every_device_within_a_bounded_number_of_draws():
    s = sampler(3, 10, explore=0.2)   # one place of three explores
    devices = [f"d{i}" for i in range(10)]
    seen: set[str] = set()
    bound = 1 + math.ceil((10 - 3) / 1)
    for r in range(1, bound + 1):
        drawn = s.draw(devices, r, 0).clients
        assert len(drawn) == 3
        for c in drawn:   # the chosen ones answer; d0 and d1 promise the most
            answer(s.book, c, loss_sq=100.0 if c in ("d0", "d1") else 1.0)
        seen |= set(drawn)
    assert seen == set(devices)
    first = [sampler(3, 10, explore=0.2).draw(devices, 1, 0).clients for _ in range(2)]
    assert first[0] == first[1]   # seeded: a run draws the same clients again


def test_a_device_the_model_does_not_fit_never_gets_a_task():
    model = ModelSize(parameters=50_000, estimate_bytes=100 * 2**20)
    s = sampler(3, 3, model=model)
    s.book.hello("small", {"memory_total_bytes": 2**30, "memory_available_bytes": 64 * 2**20})   # estimate too big
    s.book.hello("ok", {"memory_total_bytes": 2**30, "memory_available_bytes": 512 * 2**20})
    answer(s.book, "refused", error="memory: this task needs about 300 MiB ...")
    answer(s.book, "peaked", peak_rss_bytes=2**30)   # measured on this model: more than its memory with margin
    s.book.hello("peaked", {"memory_total_bytes": 2**30})
    for r in range(1, 6):   # even when that leaves fewer than the round needs
        assert s.draw(["small", "ok", "refused", "peaked"], r, 0).clients == ["ok"]
    assert s.draw(["refused"], 6, 0).skipped == ["refused"]
    bigger = ModelSize(parameters=10_000, estimate_bytes=1)
    s.book.model = lambda: bigger   # a smaller model than the one it refused fits again
    assert s.draw(["refused"], 7, 0).clients == ["refused"]


def test_a_hot_device_rests_and_is_put_back_when_the_round_needs_it():
    s = sampler(2, 3, min_results=1, rest_rounds=2, max_temperature_c=80.0)
    for c in ("a", "b", "c"):
        answer(s.book, c, temperature_c=85.0 if c == "hot" else 50.0)
    answer(s.book, "hot", temperature_c=85.0)
    assert s.draw(["a", "b", "hot"], 1, 0).clients == ["a", "b"]        # resting in rounds 1 and 2
    assert s.draw(["a", "b", "hot"], 2, 0).skipped == ["hot"]
    assert s.draw(["hot"], 2, 0).clients == ["hot"]                     # needed: put back
    assert "hot" in s.draw(["hot"], 3, 0).clients                       # rested; no new hot reading since
    throttled = {"raw": "0x4", "now": ["throttled"], "since_boot": []}
    answer(s.book, "b", throttled=throttled)
    answer(s.book, "a", battery_percent=10.0, power_plugged=False)      # discharging, below 20 %
    answer(s.book, "c", battery_percent=10.0, power_plugged=True)       # charging: fine
    assert s.draw(["a", "b", "c"], 4, 0).clients == ["c"]
    assert s.draw(["a", "b", "c"], 4, 1).clients == ["c"]               # a retry does not forget the rest
    assert s.draw(["a", "b"], 4, 2).clients == ["a"]                    # the soonest due back, when needed


def test_selection_keys_are_checked_by_name():
    assert load_config(None, [("clients", "selection", "profile")]).selection.explore == 0.9   # Oort's epsilon
    for key, value in (("explore", 1.5), ("alpha", -1.0), ("memory_margin", 0.5), ("min_battery_percent", 120.0),
                       ("rest_rounds", -1), ("explore_decay", 0.0), ("explore_min", 2.0), ("cutoff", 0.0),
                       ("max_share", 0.5), ("min_sessions", 0)):
        with pytest.raises(ConfigError, match=f"selection.{key}"):
            load_config(None, [("selection", key, value)])


def test_device_facts_from_the_network_are_checked():
    facts = clean_device_facts({"memory_total_bytes": -5, "memory_available_bytes": 2**30, "battery_percent": "full",
                                "power_plugged": 1, "cores": 4})
    assert facts == {"cores": 4, "ram_bytes": None, "memory_total_bytes": None, "memory_available_bytes": 2**30,
                     "battery_percent": None, "power_plugged": None}
    assert clean_device_facts(["not", "a", "dict"])["memory_total_bytes"] is None
    book = DeviceBook()
    book.hello("x", "garbage")
    book.answered("x", 1.0, clean_profile({"samples_per_second": "fast", "samples": -1}), {"train_loss_sq": -1.0}, 0,
                  None)
    assert book.completion_seconds("x") is None and book.record("x").utility is None


def test_the_device_estimate_and_its_memory_check():
    model = build_model(MLP)
    parameters = 64 * 16 + 16 + 16 * 10 + 10
    assert parameter_count(MLP) == sum(p.numel() for p in model.parameters()) == parameters
    # leaf outputs for one 8x8 sample: flatten 64, linear 16, activation 16, classifier 10
    activations = sum(m.numel() for m in _leaf_sizes(model))
    assert estimate_task_bytes(model, MLP, 32) == 5 * 4 * parameters + 3 * 4 * activations * 32 + SLACK
    needed = estimate_task_bytes(model, MLP, 32)
    MemoryGuard(available=lambda: int(needed * 1.2) + 1).before_training(model, MLP, {"batch_size": 32})
    guard = MemoryGuard(available=lambda: needed)
    with pytest.raises(MemoryRefusal, match=r"^memory: this task needs about .* only .* are available"):
        guard.before_training(model, MLP, {"batch_size": 32})
    guard.measured(MLP, {"batch_size": 32}, 10 * 2**30)   # it measured 10 GiB with this model before
    guard.rss, guard.available = (lambda: 2**30), (lambda: 2**30)
    with pytest.raises(MemoryRefusal, match="measured peak 10.0 GiB"):
        guard.before_build(MLP, {"batch_size": 32})
    guard.before_build(MLP, {"batch_size": 64})   # another batch size: the parameters alone fit
    huge = {**MLP, "hidden": [8192, 8192]}
    with pytest.raises(MemoryRefusal, match="67,731,466 parameters, before their activations"):
        MemoryGuard(available=lambda: 2**30).before_build(huge, {})


def _leaf_sizes(model):
    import torch
    out = []
    hooks = [m.register_forward_hook(lambda _m, _i, o: out.append(o)) for m in model.modules()
             if not list(m.children())]
    with torch.no_grad():
        model(torch.zeros(1, 1, 8, 8))
    for h in hooks:
        h.remove()
    return out


def test_the_cgroup_limit_is_read_from_the_process_own_cgroup(tmp_path):
    root = tmp_path / "cgroup"
    own = root / "memory" / "fleet" / "pi-01"
    own.mkdir(parents=True)
    (tmp_path / "self").write_text("12:pids:/\n4:memory:/fleet/pi-01\n0::/\n")
    (own / "memory.limit_in_bytes").write_text("536870912\n")
    (own / "memory.usage_in_bytes").write_text("300000000\n")
    (own / "memory.stat").write_text("cache 1\ntotal_inactive_file 50000000\n")
    (root / "memory" / "fleet" / "memory.limit_in_bytes").write_text("9223372036854771712\n")   # no limit
    (root / "memory" / "fleet" / "memory.usage_in_bytes").write_text("1\n")
    found = cgroup_memory(tmp_path / "self", root)
    assert (found.limit, found.used, found.available) == (536870912, 250000000, 536870912 - 250000000)
    v2 = root / "work.slice"
    v2.mkdir()
    (root / "cgroup.controllers").write_text("memory\n")
    (v2 / "memory.max").write_text("max\n")          # its parent is the root, which has no limit file
    (v2 / "memory.current").write_text("5\n")
    (tmp_path / "v2").write_text("0::/work.slice\n")
    assert cgroup_memory(tmp_path / "v2", root) is None
    (v2 / "memory.max").write_text("1000\n")
    assert cgroup_memory(tmp_path / "v2", root).available == 995
    assert cgroup_memory(tmp_path / "missing", root) is None


def test_a_memory_refusal_is_counted_and_the_device_left_out_afterwards(tmp_path):
    hub = InprocHub()
    coord = make_coordinator(tmp_path, hub, expected=2, clients__selection="profile", clients__min_results=1)
    tasks: dict[str, list] = {"ok": [], "small": []}

    def script(peer, task):
        tasks[peer.client_id].append(task.round)
        if peer.client_id == "small":
            return [encode("result", run_id=task.run_id, round=task.round, task_id=task.task_id,
                           sender=peer.client_id, body={"error": "memory: this task needs about 90 MiB ..."})]
        return [peer.result(task, metrics={"train_loss": 1.0, "train_loss_sq": 1.0})]

    peers = [ScriptedClient(hub, c, script) for c in tasks]
    for peer in peers:
        peer.start()
    coord.wait_for_clients(2, 5)
    rows = [coord.run_round(r) for r in (1, 2, 3)]
    for peer in peers:
        peer.stop.set()
    assert (rows[0]["failed"], rows[0]["failed_memory"], rows[0]["returned"]) == (1, 1, 1)
    assert tasks == {"ok": [1, 2, 3], "small": [1]}
    assert [r["skipped"] for r in rows[1:]] == [["small"], ["small"]]


def test_a_profile_run_prefers_fast_devices_and_tries_every_one(tmp_path):
    hub = InprocHub()
    coord = make_coordinator(tmp_path, hub, expected=4, clients__selection="profile", clients__per_round=2,
                             clients__round_timeout=3.0, selection__preferred_seconds=0.2, selection__explore=0.25)
    delays = {"fast-1": 0.0, "fast-2": 0.0, "slow-1": 0.6, "slow-2": 0.6}
    picked = {c: 0 for c in delays}

    def script(peer, task):
        picked[peer.client_id] += 1
        time.sleep(delays[peer.client_id])
        return [peer.result(task, metrics={"train_loss": 1.0, "train_loss_sq": 1.0})]

    peers = [ScriptedClient(hub, c, script) for c in delays]
    for peer in peers:
        peer.start()
    coord.wait_for_clients(4, 5)
    rows = [coord.run_round(r) for r in range(1, 11)]
    for peer in peers:
        peer.stop.set()
    assert all(r["returned"] == 2 for r in rows)
    assert min(picked.values()) >= 1, picked
    assert picked["fast-1"] + picked["fast-2"] > picked["slow-1"] + picked["slow-2"] + 4, picked


def test_oort_scoring_prefers_a_fast_low_loss_device_over_a_slow_high_loss_one_past_the_preferred_duration():
    s = sampler(1, 2, explore=0.0, alpha=2.0, staleness=0.0, preferred_seconds=1.0, cutoff=1.0)
    answer(s.book, "fast", loss_sq=1.0, samples=10, speed=100.0, round_seconds=0.5)   # utility 10, 0.5 s
    answer(s.book, "slow", loss_sq=4.0, samples=10, speed=2.0, round_seconds=5.0)     # utility 20, 5 s
    for c in ("fast", "slow"):
        s.book.record(c).last_selected = 1
    utility = s.profile.utilities(["fast", "slow"], round=2)
    assert utility == pytest.approx({"fast": 0.5, "slow": 1.0 * (1.0 / 5.0) ** 2})
    assert s.draw(["fast", "slow"], 2, 0).clients == ["fast"]
    no_penalty = sampler(1, 2, explore=0.0, alpha=0.0, staleness=0.0, cutoff=1.0)   # without it, the loss wins
    answer(no_penalty.book, "fast", loss_sq=1.0)
    answer(no_penalty.book, "slow", loss_sq=4.0, speed=2.0, round_seconds=5.0)
    for c in ("fast", "slow"):
        no_penalty.book.record(c).last_selected = 1
    assert no_penalty.draw(["fast", "slow"], 2, 0).clients == ["slow"]


def test_exploration_starts_high_and_decays_to_its_floor():
    s = sampler(10, 30)   # Oort's 0.9, 0.98 a round, floor 0.2
    assert s.profile.epsilon(1) == pytest.approx(0.9)
    assert s.profile.epsilon(11) == pytest.approx(0.9 * 0.98 ** 10)
    assert s.profile.epsilon(500) == pytest.approx(0.2)
    assert sampler(10, 30, explore=0.1).profile.epsilon(1) == pytest.approx(0.1)   # below the floor: kept as is
    devices = [f"d{i:02d}" for i in range(30)]
    first = s.draw(devices, 1, 0).clients
    for c in first:
        answer(s.book, c, loss_sq=100.0)   # all of them promise a lot
    second = s.draw(devices, 2, 0).clients
    assert len(set(second) - set(first)) == math.ceil(s.profile.epsilon(2) * 10)   # still 9 new ones
    third = s.draw(devices, 3, 0).clients
    assert not (set(first) | set(second)).issuperset(third)


def test_the_staleness_bonus_brings_back_a_device_not_selected_for_a_while():
    s = sampler(1, 2, explore=0.0, alpha=0.0, staleness=0.1, cutoff=1.0)
    answer(s.book, "recent", loss_sq=1.0)
    answer(s.book, "old", loss_sq=0.64)   # utility 8 of 10
    s.book.record("recent").last_selected, s.book.record("old").last_selected = 20, 1
    utility = s.profile.utilities(["recent", "old"], round=21)
    assert utility["old"] == pytest.approx(0.8 + math.sqrt(0.1 * math.log(21) / 1))
    assert utility["recent"] == pytest.approx(1.0 + math.sqrt(0.1 * math.log(21) / 20))
    assert s.draw(["recent", "old"], 21, 0).clients == ["old"]
    assert sampler(1, 2, explore=0.0, staleness=0.0).profile.utilities(["recent"], 21) == {}   # never selected


def test_the_fairness_bound_stops_one_device_taking_every_place():
    s = sampler(1, 4, explore=0.0, alpha=0.0, staleness=0.0, cutoff=1.0, max_share=2.0)
    for c in ("star", "b", "c", "d"):
        answer(s.book, c, loss_sq=100.0 if c == "star" else 1.0)
        s.book.record(c).last_selected = 1
    picks = {c: 0 for c in ("star", "b", "c", "d")}
    for r in range(2, 22):
        for c in s.draw(list(picks), r, 0).clients:
            picks[c] += 1
    mean = sum(rec.picks for rec in s.book.devices.values()) / len(s.book.devices)
    assert picks["star"] <= 2.0 * mean + 1 and picks["star"] >= max(picks.values()) - 1, picks
    assert min(picks.values()) >= 1, picks
    unbounded = sampler(1, 4, explore=0.0, alpha=0.0, staleness=0.0, cutoff=1.0, max_share=0.0)
    for c in picks:
        answer(unbounded.book, c, loss_sq=100.0 if c == "star" else 1.0)
        unbounded.book.record(c).last_selected = 1
    assert all(unbounded.draw(list(picks), r, 0).clients == ["star"] for r in range(2, 12))


def test_a_device_likely_to_go_offline_before_it_finishes_is_not_picked_for_a_long_task():
    s = sampler(2, 3, explore=0.0, alpha=0.0, staleness=0.0, cutoff=1.0)
    now = [10_000.0]
    s.clock = lambda: now[0]
    presence = s.book.presence
    for c, session in (("flaky", 30.0), ("steady", 3000.0), ("new", None)):
        if session is not None:   # two past sessions of this length each, then online again 10 s ago
            for start in (0.0, 5000.0):
                presence.changed(c, True, start)
                presence.changed(c, False, start + session)
        presence.changed(c, True, now[0] - 10.0)
        answer(s.book, c, speed=1.0, samples=100, round_seconds=100.0)   # a 100 s task
        s.book.record(c).last_selected = 1
    assert presence.remaining("flaky", now[0], 2) == pytest.approx(20.0)
    assert presence.remaining("new", now[0], 2) is None   # no history: not left out on a guess
    assert s.draw(["flaky", "steady", "new"], 2, 0).clients == ["new", "steady"]
    assert s.draw(["flaky", "steady", "new"], 2, 0).skipped == ["flaky"]
    short = sampler(2, 3, explore=0.0, alpha=0.0, staleness=0.0)
    short.book.presence, short.clock = presence, s.clock
    answer(short.book, "flaky", speed=1000.0, samples=10, round_seconds=1.0)   # a short task fits its session
    short.book.record("flaky").last_selected = 1
    assert "flaky" in short.draw(["flaky"], 2, 0).clients
    assert "flaky" in s.draw(["flaky"], 3, 0).clients   # put back when the round needs it
    off = sampler(2, 3, availability=False, explore=0.0)
    off.book.presence, off.clock = presence, s.clock
    answer(off.book, "flaky", speed=1.0, samples=100, round_seconds=100.0)
    off.book.record("flaky").last_selected = 1
    assert off.draw(["flaky", "steady"], 2, 0).skipped == []


def test_deadline_selection_also_skips_a_device_likely_to_go_offline():
    config = load_config(None, [("clients", "expected", 3), ("clients", "per_round", 1),
                                ("clients", "selection", "deadline"), ("clients", "round_timeout", 1000.0)])
    times = RoundTimes()
    s = Sampler(config, Absences(0), times, DeviceBook())
    s.clock = lambda: 10_000.0
    for c, session in (("flaky", 30.0), ("steady", 3000.0)):
        for start in (0.0, 5000.0):
            s.book.presence.changed(c, True, start)
            s.book.presence.changed(c, False, start + session)
        s.book.presence.changed(c, True, 9990.0)
        times.sent(f"t-{c}", c, "fedavg", 0.0)
        times.answered(f"t-{c}", c, 100.0)   # it took 100 s
    draw = s.draw(["flaky", "steady"], 1, 0)
    assert draw.clients == ["steady"] and draw.skipped == ["flaky"]


def _profile_run(tmp_path, seed: int) -> tuple[dict[str, int], list[list[str]]]:
    """Eight scripted devices of four speeds, ten rounds of three: picks per device and each round's picks."""
    hub = InprocHub()
    coord = make_coordinator(tmp_path, hub, expected=8, run__seed=seed, clients__selection="profile",
                             clients__per_round=3, clients__round_timeout=5.0, selection__preferred_seconds=0.1,
                             selection__alpha=0.0)   # no penalty from measured times: the draw is the seed's alone
    delays = {"orin-1": 0.0, "orin-2": 0.0, "pi5-1": 0.02, "pi5-2": 0.02, "pi4-1": 0.1, "pi4-2": 0.1,
              "zero-1": 0.3, "zero-2": 0.3}
    loss_sq = {"orin": 0.5, "pi5": 1.0, "pi4": 2.0, "zero": 4.0}
    rounds: list[set[str]] = [set() for _ in range(11)]

    def script(peer, task):
        rounds[task.round].add(peer.client_id)
        time.sleep(delays[peer.client_id])
        return [peer.result(task, metrics={"train_loss": 1.0, "train_loss_sq": loss_sq[peer.client_id[:-2]]})]

    peers = [ScriptedClient(hub, c, script) for c in delays]
    for peer in peers:
        peer.start()
    coord.wait_for_clients(8, 5)
    rows = [coord.run_round(r) for r in range(1, 11)]
    for peer in peers:
        peer.stop.set()
    assert all(r["returned"] == 3 for r in rows)
    picks = {c: sum(c in r for r in rounds) for c in delays}
    return picks, [sorted(r) for r in rounds[1:]]


def test_a_profile_run_draws_every_device_class_and_the_same_devices_under_the_same_seed(tmp_path):
    picks, draws = _profile_run(tmp_path / "a", seed=7)
    for kind in ("orin", "pi5", "pi4", "zero"):
        assert sum(n for c, n in picks.items() if c.startswith(kind)) >= 2, picks
    assert max(picks.values()) <= 2.0 * sum(picks.values()) / len(picks) + 1, picks   # the fairness bound
    assert _profile_run(tmp_path / "b", seed=7)[1] == draws
    assert _profile_run(tmp_path / "c", seed=8)[1] != draws
