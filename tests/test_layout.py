"""The package layout holds: no import cycles, imports only run down the floors, and the
device package stands on its own.

The packages stand on floors, ground first: ``storage`` (files, checkpoints, pixels),
``profiling``, ``edge_client``, ``export``, ``coordinator``. A module imports from its own
floor and the floors below, never from one above.

Imports are read from the source (every ``import`` statement, including those inside
functions, since a deferred import is still a dependency; only those under
``if TYPE_CHECKING:``, which never run, are left out), so the test needs no torch and
fails on the first cycle anyone adds.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = ("storage", "profiling", "edge_client", "export", "coordinator")   # the packages, ground floor first
# ``methods/`` holds one folder per method; each file stands on the floor of its role (methods/__init__.py).
ROLE_FLOORS = {"device": "edge_client", "model": "edge_client", "common": "edge_client", "export": "export"}


def _modules() -> dict[str, Path]:
    found = {}
    for package in (*FLOORS, "methods"):
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _imports(path: Path, name: str, modules: dict[str, Path], packages: bool = False) -> set[str]:
    """The project modules ``path`` imports (``from pkg import mod`` counts as ``pkg.mod``); a package's
    ``__init__`` only with ``packages`` (a cycle through one is not a loop of the modules)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for block in [n for n in ast.walk(tree) if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]:
        block.body = []   # imports for annotations only: they never run
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and (packages or modules[target].name != "__init__.py"):
                out.add(target)
    return out


def _graph(packages: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules, packages) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _floor(module: str) -> int:
    parts = module.split(".")
    if parts[0] != "methods":
        return FLOORS.index(parts[0])
    if len(parts) == 1 or (len(parts) == 2 and parts[1] not in ROLE_FLOORS):   # the package and its folders
        return 0                                                                 # contain, and import, nothing
    return FLOORS.index(ROLE_FLOORS.get(parts[-1], "coordinator"))


def _upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every import that runs from a lower floor to a higher one, as (importer, imported)."""
    return sorted((m, d) for m, deps in graph.items() for d in deps if _floor(d) > _floor(m))


def test_the_project_has_no_import_cycle():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_only_run_down_the_floors():
    assert _upward(_graph(packages=True)) == []


def test_the_floor_check_sees_an_import_that_runs_up():
    graph = {"storage.files": {"edge_client.models"}, "export.card": {"storage.files", "edge_client.models"},
             "coordinator.runtime.run": {"export.pipeline"}, "profiling.infer": {"storage.pixels"}}
    assert _upward(graph) == [("storage.files", "edge_client.models")]


def test_the_device_package_never_imports_the_coordinator_or_export():
    graph = _graph(packages=True)
    bad = {m: sorted(d for d in deps if d.startswith(("coordinator", "export")))
           for m, deps in graph.items() if m.startswith("edge_client")}
    assert {m: d for m, d in bad.items() if d} == {}


def test_storage_stands_on_its_own():
    graph = _graph(packages=True)
    assert "storage.files" in graph
    bad = {m: sorted(d for d in deps if not d.startswith("storage"))
           for m, deps in graph.items() if m.startswith("storage")}
    assert {m: d for m, d in bad.items() if d} == {}


def test_storage_and_serving_load_without_torch():
    """``fedge-profile infer`` runs where torch is not installed: it and storage's torch-free modules import none."""
    code = ("import sys, storage, storage.files, storage.pixels, storage.state, profiling.infer; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_registry_and_the_command_lines_load_without_torch():
    """The registry names every part by import path, so listing the methods (``--help``) imports none."""
    code = ("import sys, edge_client.registry, coordinator.ui.cli, coordinator.methods; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_wire_and_methods_are_where_the_layout_says():
    graph = _graph()
    for name in ("protocol", "transport", "chunking", "compression", "codec", "updates"):
        assert f"edge_client.wire.{name}" in graph
    for name in ("files", "checkpoint", "pixels", "state"):
        assert f"storage.{name}" in graph
    for name in ("pans", "spherefed", "fed2", "dfl"):
        assert f"methods.{name}.model" in graph
    assert not any(name.startswith("edge_client.methods") for name in graph)   # methods live under methods/
    assert "coordinator.diagnostics" in graph and "edge_client.diagnostics" not in graph


@pytest.mark.parametrize("module", ["edge_client.models", "edge_client.wire.protocol"])
def test_building_a_model_or_reading_a_message_imports_no_training_code(module):
    training = ("edge_client.objectives", "methods.spherefed.device", "methods.dfl.device")
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m in {training!r}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_method_file_stands_on_the_floor_of_its_role():
    graph = {"methods.x.device": {"coordinator.runtime.engine"}, "methods.x.model": {"edge_client.models"},
             "methods.x.strategy": {"coordinator.strategies.fedavg", "methods.x.device"},
             "methods.x.export": {"export.hooks"}, "edge_client.registry": {"methods.x.device"},
             "methods.common": {"export.hooks"}, "methods.x.cli": {"methods.common"}}
    assert _upward(graph) == [("methods.common", "export.hooks"), ("methods.x.device", "coordinator.runtime.engine")]


def test_every_import_path_the_registry_names_resolves():
    from edge_client.models import ModelHook
    from edge_client.registry import METHODS, resolve
    from export.hooks import ExportHook

    for entry in METHODS.values():
        if entry.strategy:
            assert callable(getattr(resolve(entry.strategy), "from_config", None)), entry.name
        if entry.objectives:
            assert all(callable(f) for f in resolve(entry.objectives).values()), entry.name
        if entry.model:
            assert isinstance(resolve(entry.model), ModelHook), entry.name
        if entry.export:
            assert isinstance(resolve(entry.export), ExportHook), entry.name
        assert all(callable(resolve(path)) for path in entry.commands.values()), entry.name
        for section, path in entry.sections.items():
            assert callable(getattr(resolve(path)(), "checks", None)), (entry.name, section)
