"""Every settings error of ``fedge-coordinator run`` is found before torch is imported.

Importing torch and the methods takes seconds (5 to 8 on a Raspberry Pi); the configuration's loading and
every check of it import none of it, so a mistake is answered at once. The bad invocations all run in one
fresh interpreter through ``coordinator.ui.cli.main``; each must exit 2 with one line naming the key, and torch
must still be unimported at the end. The declarations the checks read (edge_client.registry.Capabilities) are
held to the strategy classes here too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from edge_client.registry import strategies

ROOT = Path(__file__).resolve().parents[1]

# (command line after "run", what the one line must say)
BAD = [
    (["--strategy", "nope"], "unknown strategy 'nope'"),
    (["--strategy", "pans"], "'pans' is a model option, not a strategy"),
    (["--rounds", "x"], "--rounds"),
    (["--set", "run.mode=asinc"], "run.mode must be one of sync, async"),
    (["--set", "privacy.mode=centrall"], "privacy.mode must be one of"),
    (["--set", "run.roundz=3"], "unknown key run.roundz"),
    (["--set", "nosection.x=1"], "unknown config section [nosection]"),
    (["--set", 'run.rounds="five"'], "run.rounds must be int"),
    (["--set", "train.lr=0"], "train.lr must be > 0"),
    (["--set", "aggregate.trim=0.7"], "aggregate.trim must be in [0, 0.5)"),
    (["--set", "fedprox.mu=-1"], "fedprox.mu must be >= 0"),
    (["--set", "fedyogi.beta2=1.5"], "fedyogi.beta2 must be in (0, 1)"),
    (["--set", "clients.min_results=9"], "clients.min_results=9 exceeds"),
    (["--set", "secagg.enabled=true", "--strategy", "fedma", "--rounds", "8"],
     "secagg.enabled = true cannot run run.strategy = 'fedma'"),
    (["--set", "privacy.mode=central", "--set", "run.mode=async"], "privacy.mode = 'central' needs run.mode = 'sync'"),
    (["--set", "privacy.mode=local", "--strategy", "fed2"], "privacy.mode = 'local' cannot run run.strategy = 'fed2'"),
    (["--set", "run.mode=async", "--strategy", "dfl"], "run.mode = 'async' cannot run run.strategy = 'dfl'"),
    (["--set", "server.optimizer=fedadam", "--strategy", "fedma", "--rounds", "8"],
     "server.optimizer = 'fedadam' cannot step run.strategy = 'fedma'"),
    (["--set", "server.optimizer=nope"], "server.optimizer must be one of"),
    (["--set", "aggregate.rule=median", "--strategy", "fedma", "--rounds", "8"], "aggregate.rule = 'median'"),
    # a capability a setting takes away: Fed2's holders pairing weighs rows its own way
    (["--strategy", "fed2", "--set", "fed2.pairing=holders", "--set", "aggregate.rule=median"],
     "aggregate.rule = 'median' and aggregate.norm_bound apply to strategies that average updates"),
    (["--strategy", "spherefed", "--set", "privacy.mode=central", "--set", "clients.max_attempts=1",
      "--set", "ffc.personalize=true", "--set", "data.local_test_fraction=0.2"], "ffc.personalize = false"),
    (["--strategy", "spherefed", "--set", "model.head=linear"], "needs model.head = 'sphere'"),
    (["--strategy", "fed2", "--set", "model.head=sphere"], "model.head = 'sphere'"),
    (["--strategy", "fedma", "--set", "codec.up=topk:0.1"], "top-k codec.up"),
    (["--set", "workers.count=2", "--strategy", "dfl", "--broker", "mqtt://127.0.0.1:1883"],
     "aggregation workers (workers.count > 0) need a strategy whose every result folds"),
    (["--set", "codec.up=int9"], "codec.up: unknown codec part 'int9'"),
    (["--set", "codec.down=topk:0.1"], "codec.down cannot use topk"),
    (["--set", "eval.device=tpu"], "eval.device: unknown device 'tpu'"),
    (["--set", "transport.broker=http://127.0.0.1:1883"], "transport.broker"),
    (["--data", "mnist"], "data.eval: unknown dataset spec 'mnist'"),
    (["--partition", "dirichlet:0"], "data.partition: bad partition spec 'dirichlet:0'"),
    (["--config", "nope.toml"], "config file nope.toml does not exist"),
]

PROBE = """
import contextlib, io, json, sys
from coordinator.ui.cli import main

answers = []
for args in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(["run", *args])
        except SystemExit as exit:
            code = exit.code
    answers.append([code, out.getvalue()])
print(json.dumps({"answers": answers, "torch": "torch" in sys.modules}))
"""


def _probe(tmp_path: Path, script: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", script, *args], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "COLUMNS": "400"}, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_bad_setting_is_refused_naming_its_key_before_torch_is_imported(tmp_path):
    found = _probe(tmp_path, PROBE, json.dumps([args for args, _ in BAD]))
    for (args, said), (code, output) in zip(BAD, found["answers"], strict=True):
        lines = output.strip().splitlines()
        assert code == 2 and len(lines) == 1 and said in lines[0], (args, code, output)
    assert not found["torch"], "a configuration check imported torch"
    assert not any(tmp_path.iterdir())   # no run directory


def test_reading_and_checking_every_strategy_s_configuration_imports_no_torch(tmp_path):
    script = """
import json, sys
from coordinator.config import load_config
from edge_client.registry import strategies

before = "torch" in sys.modules
for name in strategies():
    load_config(None, [("run", "strategy", name), ("run", "rounds", 8)])
print(json.dumps({"torch": before or "torch" in sys.modules}))
"""
    assert not _probe(tmp_path, script)["torch"]


@pytest.mark.parametrize("name", strategies())
def test_a_strategy_class_holds_its_entry_s_capabilities_and_behaves_as_declared(name):
    """The registry is the one source; what the engine does with a strategy must agree with it: one combined
    update (``FedAvg``'s ``server_step``) where deltas are aggregated, and a streamed training phase where
    every result is one update of a single sum (DP and SecAgg fold them as they come)."""
    from coordinator.config import load_config
    from coordinator.strategies.fedavg import FedAvg
    from coordinator.strategy_setup import make_strategy
    from edge_client.registry import METHODS, resolve

    declared = METHODS[name].capabilities
    cls = resolve(METHODS[name].strategy)
    assert cls.capabilities is declared
    # FedAvg's round ends in server_step, so every subclass declares it; another strategy that declares it steps its
    # own combined update through server_step, which its own tests check (DFL: tests/test_dfl.py)
    assert declared.aggregates_deltas or not issubclass(cls, FedAvg)
    strategy = make_strategy(load_config(None, [("run", "strategy", name), ("run", "rounds", 8)]))
    if strategy.capabilities.one_update_per_device:
        assert strategy.streams("train")


def test_a_condition_of_a_declaration_follows_the_settings():
    from coordinator.config import load_config

    def can(strategy: str, *sets: tuple[str, str, object]):
        return load_config(None, [("run", "strategy", strategy), *sets]).capabilities

    assert can("fed2").robust
    assert not can("fed2", ("fed2", "pairing", "holders")).robust
    assert can("spherefed").one_update_per_device
    assert "ffc.personalize" in can("spherefed", ("ffc", "personalize", True)).central_dp


def test_the_ffc_precisions_the_configuration_takes_are_the_ones_devices_send():
    from methods.spherefed.device import WIRE_DTYPES
    from methods.spherefed.settings import STAT_DTYPES

    assert set(STAT_DTYPES) == set(WIRE_DTYPES)
