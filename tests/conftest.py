"""Shared fixtures: a real Mosquitto on a free loopback port, started and stopped by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch

from coordinator.ops.mosquitto import LocalMosquitto, mosquitto_binary


@pytest.fixture(scope="session")
def mosquitto(tmp_path_factory: pytest.TempPathFactory) -> str:
    """URL of a Mosquitto broker that lives for the whole test session."""
    if mosquitto_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("mosquitto is not installed; `make test` installs it with apt when run as root")
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    broker = LocalMosquitto(workdir=tmp_path_factory.mktemp("mosquitto"))
    broker.start()
    yield broker.url
    broker.stop()


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    """A topic prefix of its own for each test, so retained messages never leak between tests."""
    return "t" + str(abs(hash(request.node.nodeid)) % 10**8) + "-" + str(time.monotonic_ns() % 10**6)


def _wait_until(condition: Callable[[], object], what: str, timeout: float = 10.0) -> object:
    """Poll ``condition`` until it returns something true, and return that; fail saying ``what`` did not happen
    within ``timeout`` s. Tests wait for the thing itself (a subscription, a retained message, a log line, a
    file), never a fixed time, which is too long on an idle machine and too short on a loaded one."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.02)
    return value


@pytest.fixture
def wait_until() -> Callable[..., object]:
    """``wait_until(condition, what, timeout=10.0)``: poll until ``condition()`` is true, with a deadline."""
    return _wait_until


def _kill_after_checkpoint(proc: subprocess.Popen, out: Path, round: int, timeout: float = 180.0) -> None:
    """SIGKILL a coordinator process once round ``round`` of its run in ``out`` is checkpointed, and
    wait for its spawned clients, which leave when their parent is gone."""
    deadline = time.monotonic() + timeout
    while not (out / "checkpoints" / f"round_{round:04d}.safetensors").exists():
        assert proc.poll() is None and time.monotonic() < deadline, f"coordinator ended before round {round}"
        time.sleep(0.05)
    children = psutil.Process(proc.pid).children()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    psutil.wait_procs(children, timeout=30)


@pytest.fixture
def kill_after_checkpoint() -> Callable[..., None]:
    """``kill(proc, out, round)``: a coordinator killed hard right after a checkpoint, for resume tests."""
    return _kill_after_checkpoint


def _announce_running(transport, run_id: str = "r", prefix: str = "fedge") -> None:
    """What a coordinator publishes before its tasks: the retained status naming its running run
    (devices run only that run's tasks)."""
    from edge_client.wire.protocol import Topics, encode

    payload = encode("status", run_id=run_id, round=1, task_id="", sender="coordinator", body={"state": "running"})
    transport.publish(Topics(prefix).coordinator_status, payload, retain=True)


@pytest.fixture
def announce_running() -> Callable[..., None]:
    """``announce(transport, run_id="r")`` for tests that play the coordinator by hand."""
    return _announce_running


class ClientThread:
    """A device client looping on a thread of its own, for tests that play the coordinator by hand."""

    def __init__(self, client) -> None:   # client: edge_client.client.EdgeClient
        self.client = client
        self._stop = threading.Event()
        self._thread = threading.Thread(target=client.run, args=(self._stop,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def client_thread() -> Callable[..., ClientThread]:
    """``client_thread(client)`` starts the client's loop; every one started is stopped after the test."""
    started: list[ClientThread] = []

    def start(client) -> ClientThread:
        started.append(ClientThread(client))
        return started[-1]

    yield start
    for running in started:
        running.stop()


@pytest.fixture
def mqtt_device(mosquitto: str) -> Callable[..., ClientThread]:
    """``mqtt_device(settings, data)``: an EdgeClient connected to the test's Mosquitto, looping on a thread;
    after the test every one is stopped, then its connection closed."""
    from edge_client.client import EdgeClient
    from edge_client.wire.transport import BrokerSettings, MqttTransport

    started: list[tuple[ClientThread, MqttTransport]] = []

    def start(settings, data) -> ClientThread:
        transport = MqttTransport(BrokerSettings(url=mosquitto), settings.client_id).connect()
        started.append((ClientThread(EdgeClient(settings, transport, data)), transport))
        return started[-1][0]

    yield start
    for running, _ in started:
        running.stop()
    for _, transport in started:
        transport.close()


def _run_beside_device(config, device_cmd: list[str], env: dict[str, str] | None = None) -> str:
    """Run ``config`` (a coordinator on a thread of this process) with one ``fedge-client`` process
    started by ``device_cmd`` (with ``--exit-after-run``); the device's stderr, once the run finished."""
    from coordinator.runtime.run import run_federated

    proc = subprocess.Popen(device_cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    outcome: dict = {}
    coordinator = threading.Thread(target=lambda: outcome.update(result=run_federated(config, say=lambda s: None)),
                                   daemon=True)
    coordinator.start()
    coordinator.join(240)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "result" in outcome, f"the run did not finish; the device said:\n{err}"
    return err


@pytest.fixture
def run_beside_device() -> Callable[..., str]:
    """``run_beside_device(config, device_cmd, env=None)``: a run against one real device process; its stderr."""
    return _run_beside_device


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread, as a device client runs: small models on a busy 2-core machine
    train faster on one thread than on two fighting over it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def diabetes_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/diabetes built into a wheel as its owner builds one (pip wheel, offline), from a copy: building
    writes build/ and an egg-info beside the sources."""
    import shutil
    import sys

    root = tmp_path_factory.mktemp("diabetes-wheel")
    example = Path(__file__).resolve().parents[1] / "examples" / "diabetes"
    shutil.copytree(example, root / "src", ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(root / "dist"), str(root / "src")], check=True, timeout=300, env=env)
    return next((root / "dist").glob("*.whl"))


# --- The integration tier ------------------------------------------------------------------------------------------
#
# `make test-fast` runs `pytest -m "not integration"`. A test is in the integration tier when it, a fixture it uses,
# or a helper they call that is defined under tests/, bench/ or tools/ (followed transitively):
#   - starts a broker: LocalMosquitto (the `mosquitto` fixture), EmbeddedBroker, or asks for mosquitto_binary;
#   - starts a process: subprocess.*, os.system/popen/fork/posix_spawn, multiprocessing, or names sys.executable;
#   - runs a federation: run_federated, spawned clients (spawn_processes, spawn_threads, SpawnedClients), a CLI's
#     main(["run" | "demo" | "worker", ...]) other than --help, or rounds of a Coordinator with EdgeClients.
# Names are resolved in the module that defines the function, so aliases (`main as coordinator_main`) count, and a
# bare name matching one of the above counts too (imports inside a function). A test the rule misses takes an
# explicit `@pytest.mark.integration`. `pytest --collect-only -q -m integration` lists the tier; each marked test
# says why in its `integration` user property (in --junitxml reports).

import ast
import builtins
import inspect
import multiprocessing
import sys
import textwrap
import types

_REPO = Path(__file__).resolve().parents[1]
_FOLLOWED = tuple(_REPO / d for d in ("tests", "bench", "tools"))
_HEAVY_NAMES = {"LocalMosquitto", "mosquitto_binary", "EmbeddedBroker", "run_federated", "spawn_processes",
                "spawn_threads", "SpawnedClients"}
_TOGETHER = {"Coordinator", "EdgeClient"}   # a round engine and real clients: a federation in one process
_PROCESS_CALLS = [subprocess.run, subprocess.Popen, subprocess.call, subprocess.check_call, subprocess.check_output,
                  subprocess.getoutput, subprocess.getstatusoutput, os.system, os.popen, os.posix_spawn,
                  multiprocessing.Process, multiprocessing.Pool, multiprocessing.get_context,
                  getattr(os, "fork", None)]
_CLI_RUNS = {"run", "demo", "worker"}
_MISSING = object()


def _followed(obj) -> bool:
    """A function or class of the tests' own code (tests/, bench/, tools/), whose calls are followed."""
    try:
        path = Path(inspect.getfile(obj)).resolve()
        return any(path.is_relative_to(root) for root in _FOLLOWED)
    except (TypeError, OSError):
        return False


def _resolve(node: ast.expr, scope: dict, cls: type | None):
    """The object a Name or dotted Attribute chain names in ``scope``; attributes only of modules and classes."""
    if isinstance(node, ast.Name):
        if node.id in ("self", "cls") and cls is not None:
            return cls
        return scope.get(node.id, getattr(builtins, node.id, _MISSING))
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, scope, cls)
        if isinstance(base, (types.ModuleType, type)):
            return inspect.getattr_static(base, node.attr, _MISSING)
    return _MISSING


def _argv(call: ast.Call) -> list:
    """The constant words of a call's first argument when it is a literal list, as in main(["run", ...])."""
    if not call.args or not isinstance(call.args[0], (ast.List, ast.Tuple)):
        return []
    return [e.value if isinstance(e, ast.Constant) else None for e in call.args[0].elts]


def _is_cli_run(call: ast.Call, func) -> bool:
    """main(["run", ...]) of a ``*.cli`` module, unless it only asks for --help."""
    if getattr(func, "__name__", None) != "main" or getattr(func, "__module__", "").split(".")[-1] != "cli":
        return False
    argv = _argv(call)
    return bool(argv) and argv[0] in _CLI_RUNS and "--help" not in argv


class _IntegrationRule:
    """What a function or class reaches: a reason it is integration work, and the names of _TOGETHER it uses."""

    def __init__(self) -> None:
        self._seen: dict[object, tuple[str | None, frozenset[str]]] = {}

    def judge(self, obj, cls: type | None = None) -> tuple[str | None, frozenset[str]]:
        obj = inspect.unwrap(getattr(obj, "__func__", obj))
        obj = getattr(getattr(obj, "hypothesis", None), "inner_test", None) or obj
        key = getattr(obj, "__code__", obj)
        if key in self._seen:
            return self._seen[key]
        self._seen[key] = (None, frozenset())   # a recursive helper is judged by its other calls
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
        except (TypeError, OSError, SyntaxError):
            return self._seen[key]
        if isinstance(obj, type):
            scope, cls = vars(sys.modules.get(obj.__module__, types.ModuleType("_"))), obj
        else:
            scope = dict(getattr(obj, "__globals__", {}))
            for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
                try:
                    scope[name] = cell.cell_contents
                except ValueError:   # an empty cell
                    pass
        for node in ast.walk(tree):   # imports inside the function; the rule itself imports nothing
            if isinstance(node, ast.Import):
                for alias in node.names:
                    loaded = sys.modules.get(alias.name)
                    if loaded is not None:
                        scope[alias.asname or alias.name.partition(".")[0]] = (
                            loaded if alias.asname else sys.modules.get(alias.name.partition(".")[0]))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in sys.modules:
                for alias in node.names:
                    scope[alias.asname or alias.name] = getattr(sys.modules[node.module], alias.name, _MISSING)
        self._seen[key] = self._scan(tree, scope, cls, getattr(obj, "__qualname__", "?"))
        return self._seen[key]

    def _scan(self, tree: ast.AST, scope: dict, cls: type | None, where: str) -> tuple[str | None, frozenset[str]]:
        together: set[str] = set()
        help_only: set[int] = set()   # callees asked only for --help, which are not followed
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                if _is_cli_run(node, _resolve(node.func, scope, cls)):
                    return f"{where}: a CLI run", frozenset()
                if "--help" in _argv(node):
                    help_only.add(id(node.func))
                continue
            if not isinstance(node, (ast.Name, ast.Attribute)) or id(node) in help_only:
                continue
            word = node.id if isinstance(node, ast.Name) else node.attr
            if word in _HEAVY_NAMES:
                return f"{where}: {word}", frozenset()
            if word in _TOGETHER:
                together.add(word)
            if word == "executable" and isinstance(node, ast.Attribute) and _resolve(node.value, scope, cls) is sys:
                return f"{where}: sys.executable", frozenset()
            obj = _resolve(node, scope, cls)
            if obj is _MISSING:
                continue
            if any(obj is call for call in _PROCESS_CALLS if call is not None):
                return f"{where}: {obj.__module__}.{obj.__qualname__}", frozenset()
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and _followed(obj):
                deeper, names = self.judge(obj)
                if deeper:
                    return f"{where} -> {deeper}", frozenset()
                together |= names
        if together >= _TOGETHER:
            return f"{where}: {' and '.join(sorted(_TOGETHER))}", frozenset()
        return None, frozenset(together)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rule = _IntegrationRule()
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        if item.get_closest_marker("integration"):
            item.user_properties.append(("integration", "marked"))
            continue
        why, together = rule.judge(item.obj, item.cls)
        fixtures = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        for name in item.fixturenames if why is None else ():
            func = getattr((fixtures.get(name) or [None])[-1], "func", None)   # the definition the test gets
            if func is not None and _followed(func):
                found, names = rule.judge(func)
                together |= names
                if found:
                    why = f"fixture {name}: {found}"
                    break
        if why is None and together >= _TOGETHER:
            why = f"{item.name} and its fixtures: {' and '.join(sorted(_TOGETHER))}"
        if why:
            item.add_marker(pytest.mark.integration)
            item.user_properties.append(("integration", why))
