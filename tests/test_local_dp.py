"""Local differential privacy: the device's noise, what leaves the device, the coordinator's side (no clip, no
noise), the per-device account, the refusals, and short runs (in-process with a resume, and over Mosquitto)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import dp_accounting
import pytest
import torch
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from coordinator.config import ConfigError, load_config
from coordinator.privacy import LocalPrivacy, local_epsilon, local_noise_for_epsilon
from coordinator.runtime.intake import accept_result
from coordinator.runtime.run import run_federated
from coordinator.strategies.base import ClientResult
from coordinator.strategy_setup import make_strategy
from edge_client.client import ClientSettings
from edge_client.data import load_dataset
from edge_client.objectives import LocalData
from edge_client.wire.bodies import ResultBody, TaskBody, UploadSettings
from edge_client.wire.codec import parse_codec
from edge_client.wire.errors import ProtocolError
from edge_client.wire.topics import Topics
from edge_client.wire.updates import ResidualStore, encode_clipped_upload
from storage.state import ServerState

LOCAL = [("privacy", "mode", "local")]
FP32 = parse_codec("fp32")


def _config(*sets):
    return load_config(None, [*LOCAL, *sets])


def _upload(clip=0.5, z=1.3, codec=FP32):
    return UploadSettings(codec, "delta", True, clip_norm=clip, noise_multiplier=z)


# -- the device ---------------------------------------------------------------------------------------------------
def test_the_device_adds_noise_of_std_z_times_c_to_its_clipped_update():
    zero = {"w": torch.zeros(200_000)}
    wire, delta, _ = encode_clipped_upload(zero, zero, _upload(), ResidualStore(None), "r")
    noise = wire["w"].to(torch.float64)
    assert delta == ["w"] and float(noise.std()) == pytest.approx(1.3 * 0.5, rel=0.01)
    assert abs(float(noise.mean())) < 5 * 0.65 / math.sqrt(200_000)
    big = {"w": torch.full((200_000,), 3.0)}   # clipped to 0.5 first: each coordinate 0.5 / sqrt(n), plus the noise
    sent, _, clipped = encode_clipped_upload(big, zero, _upload(), ResidualStore(None), "r")
    assert clipped and float(sent["w"].mean()) == pytest.approx(0.5 / math.sqrt(200_000), abs=5 * 0.65 / 447)


def test_the_noise_comes_from_the_os_not_from_the_seed():
    update, received = {"w": torch.ones(64)}, {"w": torch.zeros(64)}
    sends = []
    for _ in range(2):   # the same seed for everything seeded (the codec's rounding, torch's global generator)
        torch.manual_seed(0)
        wire, _, _ = encode_clipped_upload(update, received, _upload(codec=parse_codec("int8")), ResidualStore(None),
                                           "r", generator=torch.Generator().manual_seed(7))
        sends.append(wire)
    assert any(not torch.equal(a, b) for a, b in zip(sends[0].values(), sends[1].values()))


def test_nothing_leaves_the_device_without_noise():
    with pytest.raises(ProtocolError, match="differences of the tensors it sent only"):
        encode_clipped_upload({"stats": torch.ones(3)}, {}, _upload(), ResidualStore(None), "r", raw_only=True)


def test_task_body_carries_a_validated_noise_multiplier():
    body = TaskBody(objective="train", model={"name": "mlp"}, up=("w",), upload=_upload(0.7, 2.0)).to_body()
    parsed = TaskBody.from_body(body).upload
    assert (parsed.clip_norm, parsed.noise_multiplier) == (0.7, 2.0)
    for bad in (-1.0, "1", True, None):
        body["upload"]["noise_multiplier"] = bad
        with pytest.raises(ProtocolError, match="upload.noise_multiplier"):
            TaskBody.from_body(body)
    body["upload"]["noise_multiplier"] = 1.0
    del body["upload"]["clip_norm"]
    with pytest.raises(ProtocolError, match="upload.noise_multiplier needs upload.clip_norm"):
        TaskBody.from_body(body)


# -- the coordinator ----------------------------------------------------------------------------------------------
def test_the_coordinator_neither_clips_nor_adds_noise():
    strategy = make_strategy(_config(("clients", "expected", 2)))
    state = ServerState(round=0, params={"w": torch.zeros(4)})
    plans = strategy.configure_train(1, state, ["a", "b"])
    assert all((p.clip_norm, p.noise_multiplier) == (1.0, 1.0) for p in plans)
    update = {"w": torch.tensor([3.0, 4.0, 0.0, 0.0])}   # norm 5, past the clip norm of 1: a noisy update can be
    wire, delta, _ = encode_clipped_upload(update, state.params, UploadSettings(FP32, "delta", True),
                                           ResidualStore(None), "r")
    result = accept_result(plans[0], SimpleNamespace(tensors=wire), ResultBody(num_samples=10, delta=tuple(delta)),
                           {"w": (4,)}, FP32, strategy, {})
    assert torch.equal(result.deltas["w"], update["w"])   # not clipped again; and no clipped bit was needed
    results = [result, ClientResult("b", 1000, {}, {}, {"w": torch.tensor([1.0, 0.0, 0.0, 0.0])})]
    after, row = strategy.aggregate("train", 1, state, results)
    assert torch.equal(after.params["w"], torch.tensor([2.0, 2.0, 0.0, 0.0]))   # the plain mean, equal weights
    folded = strategy.fold("train", strategy.fold("train", None, results[0]), results[1])
    assert folded.weight == 2.0
    assert torch.equal(strategy.aggregate("train", 1, state, results, folded)[0].params["w"], after.params["w"])
    assert row["dp_mode"] == "local" and "dp_clipped_fraction" not in row


# -- the account --------------------------------------------------------------------------------------------------
def test_a_devices_epsilon_is_dp_accountings_for_its_participations():
    z, delta = 3.0, 1e-5
    direct = RdpAccountant()
    for _ in range(7):   # seven releases, each a Gaussian mechanism of sensitivity 2C: multiplier z / 2
        direct.compose(dp_accounting.GaussianDpEvent(z / 2))
    assert local_epsilon(7, noise_multiplier=z, delta=delta, accountant="rdp") == pytest.approx(direct.get_epsilon(delta))
    pld = PLDAccountant()   # the default accountant: the same event, a tighter figure
    pld.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z / 2), 7))
    assert local_epsilon(7, noise_multiplier=z, delta=delta) == pytest.approx(pld.get_epsilon(delta), abs=1e-3)
    assert local_epsilon(7, noise_multiplier=z, delta=delta) < direct.get_epsilon(delta)
    assert local_epsilon(0, noise_multiplier=z, delta=delta) == 0.0
    assert local_epsilon(3, noise_multiplier=0.0, delta=delta) == math.inf
    calibrated = local_noise_for_epsilon(3.0, participations=7, delta=delta)
    assert local_epsilon(7, noise_multiplier=calibrated, delta=delta) == pytest.approx(3.0, rel=1e-3)


def test_the_account_grows_only_for_devices_that_took_part_and_stops_before_the_target():
    privacy = LocalPrivacy.from_config(_config(("privacy", "noise_multiplier", 8.0),
                                               ("privacy", "target_epsilon", 3.0)))
    state = ServerState(round=0, params={"w": torch.zeros(2)})
    rounds = 0
    while not privacy.stop_before(state):
        state = privacy.took_part(state, frozenset({"a", "b"} if rounds == 0 else {"a"}))
        rounds += 1
        state = ServerState(round=rounds, params=state.params, extra=state.extra)
    counts = privacy.participations(state)
    assert counts == {"a": rounds, "b": 1} and "c" not in counts
    row = privacy.row(state)
    assert row["dp_epsilon"] == pytest.approx(privacy.epsilon(rounds))
    assert rounds > 1 and row["dp_epsilon"] <= 3.0 < privacy.epsilon(rounds + 1)
    assert (row["dp_max_participations"], row["dp_devices"]) == (rounds, 2)
    assert "a device with" in privacy.stop_before(state) and "past privacy.target_epsilon = 3" in \
        privacy.stop_before(state)


def test_skipping_spent_devices_draws_around_them_until_too_few_have_room():
    privacy = LocalPrivacy.from_config(_config(("privacy", "noise_multiplier", 8.0), ("privacy", "target_epsilon", 3.0),
                                               ("privacy", "spent_devices", "skip"), ("clients", "expected", 4),
                                               ("clients", "per_round", 2), ("clients", "min_results", 2)))
    room = next(k for k in range(1, 100) if privacy.epsilon(k + 1) > 3.0)   # participations one device can have
    state = ServerState(round=0, params={"w": torch.zeros(2)})
    for _ in range(room):
        state = privacy.took_part(state, frozenset({"a"}))
    assert privacy.spent(state) == {"a"} and privacy.stop_before(state) == ""   # three devices still have room
    assert privacy.row(state)["dp_spent_devices"] == 1
    for _ in range(room):
        state = privacy.took_part(state, frozenset({"b", "c"}))
    assert privacy.spent(state) == {"a", "b", "c"}
    assert "1 of 4 devices have room" in privacy.stop_before(state)
    assert privacy.row(state)["dp_epsilon"] <= 3.0


def test_a_local_run_skipping_spent_devices_goes_on_past_the_first_spent_one(tmp_path):
    """4 devices, 2 a round, a target that allows 2 participations each: "stop" ends once a device has 2 (it
    could pass the target if drawn again); "skip" draws around the spent ones until fewer than 2 have room."""
    def run(policy: str) -> list[dict]:
        out = tmp_path / policy
        sets = {"run.out": str(out), "run.rounds": 8, "clients.expected": 4, "clients.spawn": 4, "clients.per_round": 2,
                "transport.kind": "inproc", "privacy.noise_multiplier": 4.0, "privacy.spent_devices": policy,
                "privacy.target_epsilon": local_epsilon(2, noise_multiplier=4.0, delta=1e-5) * 1.0001}
        run_federated(_load(**sets), say=lambda s: None)
        return [r for r in _rows(out) if r["round"] > 0]

    stopped, skipped = run("stop"), run("skip")   # the same seeded draws until the first device is spent
    assert len(stopped) < len(skipped) <= 4        # 4 devices x 2 participations: at most 4 rounds of 2
    assert all(r["dp_max_participations"] <= 2 for r in skipped) and skipped[-1]["dp_spent_devices"] >= 3


# -- refusals -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting, message", [
    (("privacy", "adaptive_clip", True), "privacy.adaptive_clip = false"),
    (("aggregate", "rule", "clipped_mean"), "other than 'clipped_mean'"),
    (("aggregate", "norm_bound", 2.0), "aggregate.norm_bound = 0"),
    (("run", "mode", "async"), "run.mode = 'sync'"),
    (("eval", "personalized", True), "eval.personalized = false"),
    (("privacy", "noise_multiplier", -1.0), "privacy.noise_multiplier must be >= 0"),
    (("privacy", "clip_norm", math.inf), "privacy.clip_norm must be a positive number"),
    (("privacy", "spent_devices", "rest"), "privacy.spent_devices must be one of stop, skip"),
])
def test_what_local_dp_cannot_run_with_is_refused_naming_the_key(setting, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _config(setting)


def test_what_central_dp_refuses_for_its_sampling_local_dp_allows():
    config = _config(("clients", "max_attempts", 3), ("clients", "selection", "deadline"),
                     ("run", "diagnostics", True), ("aggregate", "rule", "median"))
    assert isinstance(make_strategy(config).privacy, LocalPrivacy)


def test_strategies_that_send_raw_layers_or_statistics_are_refused():
    with pytest.raises(ConfigError, match="privacy.mode = 'local' cannot run run.strategy = 'fedma'"):
        make_strategy(_config(("run", "strategy", "fedma"), ("run", "rounds", 4)))


def test_the_privacy_command_calibrates_local_dp(capsys):
    from coordinator.ui.cli import main as coordinator_main

    assert coordinator_main(["privacy", "--mode", "local", "--participations", "10", "--epsilon", "8",
                             "--accountant", "rdp"]) == 0
    assert "privacy.noise_multiplier = 4.033" in capsys.readouterr().out
    assert coordinator_main(["privacy", "--mode", "local", "--participations", "10", "--rounds", "5",
                             "--epsilon", "8"]) == 2
    assert "takes --participations" in capsys.readouterr().err


# -- runs ---------------------------------------------------------------------------------------------------------
TINY = {"model.name": "mlp", "model.hidden": [16], "data.eval": "digits", "export.enabled": False,
        "train.epochs": 1, "privacy.mode": "local", "privacy.clip_norm": 1.0, "privacy.noise_multiplier": 0.02}


def _load(**sets):
    return load_config(None, [(*k.split(".", 1), v) for k, v in {**TINY, **sets}.items()])


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_participations_survive_resume(tmp_path):
    sets = {"run.out": str(tmp_path), "clients.expected": 2, "clients.spawn": 2, "transport.kind": "inproc"}
    run_federated(_load(**sets, **{"run.rounds": 1}), say=lambda s: None)
    result = run_federated(_load(**sets, **{"run.rounds": 2}), resume=True, say=lambda s: None)
    last = _rows(tmp_path)[-1]
    assert last["round"] == 2 and last["dp_max_participations"] == 2 and last["dp_devices"] == 2
    assert last["dp_epsilon"] == pytest.approx(local_epsilon(2, noise_multiplier=0.02, delta=1e-5))
    assert result.summary["dp_epsilon"] == last["dp_epsilon"] and result.summary["dp_mode"] == "local"


def test_two_rounds_over_mosquitto_with_device_threads(tmp_path, mosquitto, prefix, mqtt_device):
    config = _load(**{"run.out": str(tmp_path), "run.rounds": 2, "clients.expected": 2,
                      "clients.round_timeout": 60.0, "clients.presence_timeout": 60.0,
                      "transport.broker": mosquitto, "transport.prefix": prefix})
    strategy = make_strategy(config)
    seen: list[dict] = []
    aggregate = strategy.aggregate

    def spy(phase, round, state, results, partial=None):   # what reached the coordinator from each device
        seen.extend(r.metrics for r in results)
        return aggregate(phase, round, state, results, partial)

    strategy.aggregate = spy
    digits = load_dataset("digits")
    x, y = torch.from_numpy(digits.x_train), torch.from_numpy(digits.y_train)
    for i in range(2):
        mqtt_device(ClientSettings(client_id=f"ldp-{i}", topics=Topics(prefix)), LocalData(x[i::2][:200], y[i::2][:200]))
    result = run_federated(config, say=lambda s: None, strategy=strategy)
    trained = [r for r in _rows(result.out_dir) if r["round"] > 0]
    assert [r["dp_mode"] for r in trained] == ["local", "local"]
    assert trained[0]["dp_epsilon"] < trained[1]["dp_epsilon"] == result.summary["dp_epsilon"]
    assert all("train_loss" not in r for r in trained)
    assert len(seen) == 4 and all("clipped" not in m and "train_loss" not in m for m in seen)


def test_tasks_of_a_round_cut_short_are_counted_on_resume(tmp_path):
    """The devices of every training exchange are on disk before their tasks go out; a run resumed after a stop
    mid-round counts that exchange's devices in its account, then runs the round again (a second release)."""
    from coordinator.runtime.task_journal import JOURNAL_FILE

    sets = {"run.out": str(tmp_path), "clients.expected": 2, "clients.spawn": 2, "transport.kind": "inproc"}
    run_federated(_load(**sets, **{"run.rounds": 1}), say=lambda s: None)
    journal = tmp_path / JOURNAL_FILE
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    assert lines == [{"round": 1, "attempt": 0, "clients": ["sim-000", "sim-001"]}]
    with open(journal, "a") as fh:   # round 2's tasks went out to sim-000, and the coordinator died
        fh.write(json.dumps({"round": 2, "attempt": 0, "clients": ["sim-000"]}) + "\n" + '{"round": 2, "att')
    run_federated(_load(**sets, **{"run.rounds": 2}), resume=True, say=lambda s: None)
    last = _rows(tmp_path)[-1]
    assert last["round"] == 2 and last["dp_max_participations"] == 3   # rounds 1 and 2, and the lost exchange
    assert last["dp_epsilon"] == pytest.approx(local_epsilon(3, noise_multiplier=0.02, delta=1e-5))
    rerun = json.loads(journal.read_text().splitlines()[-1])   # written after the torn line, on a line of its own
    assert rerun == {"round": 2, "attempt": 0, "clients": ["sim-000", "sim-001"]}
    run_federated(_load(**{**sets, "run.out": str(tmp_path / "plain")}, **{"privacy.mode": "off", "run.rounds": 1}),
                  say=lambda s: None)
    assert not (tmp_path / "plain" / JOURNAL_FILE).exists()   # only a strategy that counts tasks keeps one
