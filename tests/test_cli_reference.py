"""docs/cli.md is every command's --help, written by tools/cli_reference.py from the parsers themselves:
a flag added, renamed or reworded without regenerating the page fails here."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "tools" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["cli_reference"] = module
    spec.loader.exec_module(module)
    return module


ref = _load()


def test_the_cli_page_is_generated_from_the_parsers():
    assert (ROOT / "docs" / "cli.md").read_text() == ref.markdown(), \
        "docs/cli.md is stale: python tools/cli_reference.py"


def test_every_console_script_is_on_the_page():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {name: target.split(":")[0] for name, target in scripts.items()} == ref.COMMANDS


def test_the_page_does_not_depend_on_the_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    narrow = ref.markdown()
    assert os.environ["COLUMNS"] == "40"   # put back as it was
    monkeypatch.delenv("COLUMNS")
    assert ref.markdown() == narrow


def test_subcommands_of_subcommands_are_documented():
    page = ref.markdown()
    for command in ("fedge-coordinator config keys", "fedge-coordinator config schema", "fedge-coordinator config show",
                    "fedge-client run", "fedge-profile infer", "fedge-export"):
        assert f"`{command}`\n\n```text\nusage: {command} " in page, command
