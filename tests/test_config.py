"""Tests for coordinator.config: defaults, TOML files, --set overrides and validation."""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    validate,
    dump_config,
    load_config,
    parse_override,
)

SECTIONS = ["run", "model", "data", "clients", "train", "fedprox", "transport", "checkpoint"]


def _write(tmp_path, text: str):
    path = tmp_path / "run.toml"
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- defaults


def test_defaults_validate():
    config = RunConfig()
    assert validate(config) is config
    assert load_config() == config
    assert config.run.strategy == "fedavg" and config.run.rounds == 5
    assert config.model == {"name": "cnn"}
    assert config.clients.expected == 4 and config.transport.kind == "mqtt"
    assert config.selected_per_round == 4 and config.required_results == 4


def test_selected_and_required_follow_per_round_and_min_results():
    config = load_config(None, [("clients", "expected", 10), ("clients", "per_round", 5),
                                ("clients", "min_results", 3)])
    assert config.selected_per_round == 5 and config.required_results == 3


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RunConfig().run.rounds = 3  # type: ignore[misc]


# --------------------------------------------------------------------------- TOML files


def test_load_toml_file(tmp_path):
    path = _write(tmp_path, """
[run]
strategy = "fedprox"
rounds = 12
seed = 3

[model]
name = "mlp"
hidden = [64, 32]

[clients]
expected = 6
per_round = 3
round_timeout = 60      # an int where a float is expected is fine

[train]
lr = 0.1
epochs = 2

[fedprox]
mu = 0.5

[transport]
prefix = "lab/fl"
protocol = "3.1.1"
""")
    config = load_config(path)
    assert config.run.strategy == "fedprox" and config.run.rounds == 12 and config.run.seed == 3
    assert config.model == {"name": "mlp", "hidden": [64, 32]}
    assert config.clients.expected == 6 and config.clients.per_round == 3
    assert config.clients.round_timeout == 60.0 and isinstance(config.clients.round_timeout, float)
    assert config.train.lr == 0.1 and config.train.epochs == 2 and config.train.batch_size == 32
    assert config.fedprox.mu == 0.5
    assert config.transport.prefix == "lab/fl" and config.transport.protocol == "3.1.1"
    assert config.data == RunConfig().data   # untouched sections keep their defaults


def test_overrides_win_over_the_file(tmp_path):
    path = _write(tmp_path, "[run]\nrounds = 12\n[train]\nlr = 0.1\n")
    config = load_config(path, [parse_override("run.rounds=2"), ("train", "momentum", 0.5)])
    assert config.run.rounds == 2 and config.train.lr == 0.1 and config.train.momentum == 0.5


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_invalid_toml(tmp_path):
    path = _write(tmp_path, "[run\nrounds = ")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(path)


def test_section_must_be_a_table(tmp_path):
    with pytest.raises(ConfigError, match=r"\[run\] must be a table"):
        load_config(_write(tmp_path, "run = 3\n"))


def test_model_section_keeps_extra_keys_and_defaults_the_name(tmp_path):
    config = load_config(_write(tmp_path, "[model]\nhidden = [16]\ndropout = 0.25\n"))
    assert config.model == {"name": "cnn", "hidden": [16], "dropout": 0.25}
    config = load_config(None, [parse_override("model.name=mlp"), parse_override("model.hidden=[16, 8]")])
    assert config.model == {"name": "mlp", "hidden": [16, 8]}


# --------------------------------------------------------------------------- --set parsing


@pytest.mark.parametrize("item,expected", [
    ("run.rounds=7", ("run", "rounds", 7)),
    ("run.seed=-3", ("run", "seed", -3)),
    ("train.lr=0.01", ("train", "lr", 0.01)),
    ("train.lr=1e-3", ("train", "lr", 0.001)),
    ("run.strategy=fedprox", ("run", "strategy", "fedprox")),
    ('run.strategy="fedprox"', ("run", "strategy", "fedprox")),
    ("run.strategy='fedprox'", ("run", "strategy", "fedprox")),
    ("model.hidden=[16, 8]", ("model", "hidden", [16, 8])),
    ("model.hidden=[]", ("model", "hidden", [])),
    ('x.names=["a", "b"]', ("x", "names", ["a", "b"])),
    ("x.flag=true", ("x", "flag", True)),
    ("x.flag=false", ("x", "flag", False)),
    ("transport.broker=mqtt://10.0.0.2:1883", ("transport", "broker", "mqtt://10.0.0.2:1883")),
    ("data.partition=dirichlet:0.5", ("data", "partition", "dirichlet:0.5")),
    ("data.eval=npz:/tmp/my data.npz", ("data", "eval", "npz:/tmp/my data.npz")),
    ("transport.protocol=3.1.1", ("transport", "protocol", "3.1.1")),
    ("run.out=a=b", ("run", "out", "a=b")),             # only the first '=' splits
    ("run.out=", ("run", "out", "")),
    (" run.rounds =3", ("run", "rounds", 3)),            # spaces around the key are ignored
])
def test_parse_override(item, expected):
    section, key, text = parse_override(item)
    assert (section, key) == expected[:2]
    assert text.parsed() == expected[2]
    assert type(text.parsed()) is type(expected[2])


def test_parse_override_strips_bare_word_values():
    assert parse_override("run.strategy = fedprox") == ("run", "strategy", "fedprox")


@pytest.mark.parametrize("item", ["run.rounds", "rounds=3", "run=3", "run.=3", "", "=", ".="])
def test_parse_override_errors(item):
    with pytest.raises(ConfigError, match="--set expects SECTION.KEY=VALUE"):
        parse_override(item)


def test_parse_override_result_applies():
    config = load_config(None, [parse_override(s) for s in (
        "run.strategy=fedprox", "run.rounds=3", "train.lr=0.2", "clients.round_timeout=5",
        "fedprox.mu=1", "model.name=mlp", "model.hidden=[16]")])
    assert config.run.strategy == "fedprox" and config.run.rounds == 3
    assert config.train.lr == 0.2 and config.clients.round_timeout == 5.0 and config.fedprox.mu == 1.0
    assert config.model == {"name": "mlp", "hidden": [16]}


def test_set_protocol_5_is_a_string():
    assert load_config(None, [parse_override("transport.protocol=5")]).transport.protocol == "5"


def test_apply_overrides_keeps_the_rest():
    base = load_config(None, [("run", "rounds", 9), ("model", "hidden", [16])])
    config = apply_overrides(base, [("run", "seed", 4)])
    assert config.run.rounds == 9 and config.run.seed == 4 and config.model == {"name": "cnn", "hidden": [16]}
    assert base.run.seed == 0   # the original is unchanged


# --------------------------------------------------------------------------- unknown names and types


def test_unknown_section_names_the_valid_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config section \[trian\]") as info:
        load_config(None, [("trian", "lr", 0.1)])
    assert all(name in str(info.value) for name in SECTIONS)
    with pytest.raises(ConfigError, match=r"unknown config section \[extra\]"):
        load_config(_write(tmp_path, "[extra]\na = 1\n"))


def test_unknown_key_names_the_valid_ones(tmp_path):
    with pytest.raises(ConfigError, match="unknown key run.roundz") as info:
        load_config(None, [parse_override("run.roundz=3")])
    for key in ("strategy", "rounds", "seed", "out"):
        assert key in str(info.value)
    with pytest.raises(ConfigError, match="unknown key train.learning_rate; valid: epochs, batch_size, lr"):
        load_config(_write(tmp_path, "[train]\nlearning_rate = 0.1\n"))


@pytest.mark.parametrize("override,message", [
    (("run", "rounds", "x"), "run.rounds must be int, got 'x'"),
    (("run", "rounds", 2.5), "run.rounds must be int, got 2.5"),
    (("run", "rounds", True), "run.rounds must be int, got True"),
    (("train", "lr", "fast"), "train.lr must be float, got 'fast'"),
    (("train", "lr", True), "train.lr must be float, got True"),
    (("run", "strategy", 3), "run.strategy must be str, got 3"),
    (("transport", "prefix", ["a"]), r"transport.prefix must be str, got \['a'\]"),
])
def test_type_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_type_error_from_set_string():
    with pytest.raises(ConfigError, match="run.rounds must be int, got 'x'"):
        load_config(None, [parse_override("run.rounds=x")])


def test_type_error_from_file(tmp_path):
    with pytest.raises(ConfigError, match="clients.expected must be int"):
        load_config(_write(tmp_path, '[clients]\nexpected = "four"\n'))


def test_int_is_accepted_for_float():
    config = load_config(None, [("train", "lr", 1), ("fedprox", "mu", 0)])
    assert config.train.lr == 1.0 and type(config.train.lr) is float
    assert config.fedprox.mu == 0.0 and type(config.fedprox.mu) is float


# --------------------------------------------------------------------------- validate()


@pytest.mark.parametrize("overrides,message", [
    ([("clients", "expected", 2), ("clients", "per_round", 3)], "clients.per_round must be between 0"),
    ([("clients", "per_round", -1)], "clients.per_round must be between 0"),
    ([("clients", "expected", 4), ("clients", "per_round", 2), ("clients", "min_results", 3)],
     "clients.min_results=3 exceeds the 2 clients selected per round"),
    ([("clients", "expected", 3), ("clients", "min_results", 4)],
     "clients.min_results=4 exceeds the 3 clients selected per round"),
    ([("clients", "min_results", -1)], "clients.min_results must be >= 0"),
    ([("transport", "kind", "inproc")], "the inproc transport needs spawned clients"),
    ([("transport", "kind", "tcp")], "transport.kind must be mqtt or inproc, got 'tcp'"),
    ([("transport", "protocol", "4")], "transport.protocol must be auto, 5 or 3.1.1"),
    ([("run", "rounds", 0)], "run.rounds must be at least 1"),
    ([("clients", "expected", 0)], "clients.expected must be at least 1"),
    ([("clients", "round_timeout", 0.0)], r"clients.round_timeout must be a positive number .*, got 0.0"),
    ([("clients", "presence_timeout", -1.0)], r"clients.presence_timeout must be a positive number .*, got -1.0"),
    ([("train", "batch_size", 0)], "train.batch_size must be >= 1, got 0"),
    ([("train", "momentum", -0.5)], "train.momentum must be >= 0, got -0.5"),
    ([("aggregate", "trim", 0.7)], r"aggregate.trim must be in \[0, 0.5\), got 0.7"),
    ([("eval", "every", 0)], "eval.every must be >= 1, got 0"),
    ([("selection", "explore", 2.0)], r"selection.explore must be in \[0, 1\] .*, got 2.0"),
    ([("workers", "flush_timeout", 0.0)], "workers.flush_timeout must be > 0, got 0.0"),
    ([("clients", "spawn", -2)], "clients.spawn must be >= 0"),
    ([("checkpoint", "keep", "some")], "checkpoint.keep must be all or last"),
])
def test_validate_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_validate_accepts_edge_values():
    config = load_config(None, [("clients", "expected", 3), ("clients", "per_round", 3),
                                ("clients", "min_results", 3), ("transport", "kind", "inproc"),
                                ("clients", "spawn", 3), ("checkpoint", "keep", "last")])
    assert config.required_results == 3 and config.transport.kind == "inproc"


def test_validate_requires_model_name():
    with pytest.raises(ConfigError, match="model.name is required"):
        validate(dataclasses.replace(RunConfig(), model={"hidden": [16]}))


# --------------------------------------------------------------------------- dump / load


def test_dump_then_load_round_trips(tmp_path):
    config = load_config(None, [parse_override(s) for s in (
        "run.strategy=fedprox", "run.rounds=3", "run.seed=11", "run.out=runs/x", "train.lr=0.125",
        "clients.expected=5", "clients.per_round=2", "clients.min_results=1", "clients.spawn=5",
        "clients.round_timeout=12.5", "transport.kind=inproc", "transport.protocol=3.1.1",
        "model.name=mlp", "model.hidden=[16, 8]", "fedprox.mu=0.3", "checkpoint.keep=last")])
    path = tmp_path / "config.toml"
    dump_config(config, path)
    again = load_config(path)
    assert again == config
    assert again.model == {"name": "mlp", "hidden": [16, 8]}
    dump_config(again, tmp_path / "second.toml")
    assert (tmp_path / "second.toml").read_text(encoding="utf-8") == path.read_text(encoding="utf-8")


def test_dump_then_load_defaults(tmp_path):
    dump_config(RunConfig(), tmp_path / "c.toml")
    assert load_config(tmp_path / "c.toml") == RunConfig()
