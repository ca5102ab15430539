"""Every error fedge raises on purpose derives from one root, so a command catches one class."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from storage.errors import FedgeError

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("storage", "profiling", "edge_client", "export", "coordinator")


def _error_classes() -> list[tuple[str, str]]:
    """(module, class name) of every class whose name ends in Error, read from the source."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                if isinstance(node, ast.ClassDef) and node.name.endswith("Error") and node.name != "FedgeError":
                    found.append((module, node.name))
    return found


def test_every_fedge_error_derives_from_the_root_and_keeps_its_builtin_base():
    classes = _error_classes()
    assert len(classes) > 20
    for module, name in classes:
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, FedgeError), f"{module}.{name} does not derive from storage.errors.FedgeError"
        assert issubclass(cls, (ValueError, RuntimeError)), f"{module}.{name} lost its built-in base"
