"""Every setting is declared once, with what it does: ``fedge-coordinator config keys`` and docs/settings.md are
read from the sections' declarations, and docs/configuration.md names no key or flag the code does not have."""

from __future__ import annotations

import json
import re
from pathlib import Path

from coordinator.settings_schema import markdown, settings
from coordinator.ui.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_every_setting_says_what_it_does():
    missing = [s.name for s in settings() if not s.help]
    assert not missing, f"add a comment on these keys' lines in their section dataclass: {missing}"


def test_the_settings_page_is_generated_from_the_declarations():
    assert (ROOT / "docs" / "settings.md").read_text() == markdown(), \
        "docs/settings.md is stale: fedge-coordinator config keys --markdown > docs/settings.md"


def test_the_configuration_page_names_only_keys_and_flags_the_code_has():
    from coordinator.ui.cli import _FLAGS

    page = (ROOT / "docs" / "configuration.md").read_text()
    named = set(re.findall(r"^\| `([a-z_0-9]+\.[a-z_0-9]+)`", page, flags=re.M))
    known = {s.name for s in settings()}
    assert not {k for k in named - known if not k.startswith("model.")}, "docs/configuration.md names keys no section has"
    flags = dict(re.findall(r"^\| `(--[a-z-]+)` \| `([a-z_0-9]+\.[a-z_0-9]+)` \|$", page, flags=re.M))
    assert flags == {flag: f"{section}.{key}" for flag, (section, key, _typ, _text) in _FLAGS.items()}, \
        "docs/configuration.md's flags table differs from coordinator/ui/cli.py's _FLAGS"


def test_the_command_lists_a_section_and_refuses_an_unknown_one(capsys):
    assert main(["config", "keys", "server", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows == [{"key": "server.optimizer", "type": "str", "default": "", "owner": "core",
                     "help": rows[0]["help"]}] and "server-optimizers.md" in rows[0]["help"]
    assert main(["config", "keys", "nope"]) == 2
    assert "no section nope; sections: aggregate" in capsys.readouterr().err


def test_the_compatibility_table_in_the_docs_is_the_declarations():
    from coordinator.methods import compatibility_table

    page = (ROOT / "docs" / "methods.md").read_text()
    start = page.index("<!-- compatibility table: generated -->\n")
    copy = page[start:page.index("<!-- end of the compatibility table -->")].split("\n", 1)[1]
    assert copy == compatibility_table(), "docs/methods.md's table is stale: paste compatibility_table()'s output"


def test_the_schema_takes_a_good_file_and_names_every_key(capsys):
    assert main(["config", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["properties"]["server"]["properties"]["optimizer"]["type"] == "string"
    assert schema["properties"]["clients"]["additionalProperties"] is False
    assert sum(len(s.get("properties", {})) for s in schema["properties"].values()) == len(settings())


def test_show_says_where_each_value_came_from(tmp_path, capsys):
    (tmp_path / "run.toml").write_text('[run]\nstrategy = "spherefed"\nrounds = 7\n')
    assert main(["config", "show", str(tmp_path / "run.toml"), "--set", "train.lr=0.01", "--changed"]) == 0
    shown = {line.split()[0]: line.split()[-1] for line in capsys.readouterr().out.splitlines()}
    assert shown["run.strategy"] == "file" and shown["run.rounds"] == "file" and shown["train.lr"] == "flag"
    assert "clients.expected" not in shown   # at its default
    assert main(["config", "show", str(tmp_path / "missing.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err
