"""``fedge-coordinator config``: the settings a run accepts (``keys``, ``schema``) and the ones a run used (``show``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["add_command"]


def add_command(sub, name: str = "config") -> None:  # sub: the parser's subparsers
    config = sub.add_parser(name, help="the settings a run accepts (keys, schema) and those a run used (show)",
                            description="Every key of a run's configuration ([section] key = value in a TOML file, "
                                        "or --set section.key=value), read from the sections' declarations.")
    what = config.add_subparsers(dest="config_command", required=True, metavar="keys|schema|show")
    keys = what.add_parser("keys", help="every key, its default and what it does",
                           description="Every key, its default and what it does: the runtime's sections, then "
                                       "each method's. A key set nowhere takes the default shown.")
    keys.add_argument("sections", nargs="*", metavar="SECTION", help="only these sections (e.g. clients codec)")
    form = keys.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="one JSON object per key instead of a table")
    form.add_argument("--markdown", action="store_true", help="all of them as docs/settings.md holds them")
    keys.set_defaults(handler=_keys)
    schema = what.add_parser("schema", help="a JSON Schema of a configuration file",
                             description="A JSON Schema (draft 2020-12) of a run's TOML configuration: for editors "
                                         "and for checking files before a run.")
    schema.set_defaults(handler=_schema)
    show = what.add_parser("show", help="the settings a run or a file resolves to, and where each came from",
                           description="The effective value of every key for a configuration file or a run "
                                       "directory (its config.toml), with --set overrides as fedge-coordinator run "
                                       "takes them, and where each value came from: default, file, flag or method "
                                       "(a method's own default).")
    show.add_argument("source", type=Path, metavar="RUN_OR_TOML", help="a TOML file or a run directory")
    show.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="as on fedge-coordinator run")
    show.add_argument("--changed", action="store_true", help="only the keys that are not at their default")
    show.set_defaults(handler=_show)


def _keys(args: argparse.Namespace) -> int:
    from coordinator.settings_schema import markdown, settings

    if args.markdown:
        sys.stdout.write(markdown())
        return 0
    found = settings()
    known = sorted({s.section for s in found})
    unknown = [name for name in args.sections if name not in known]
    if unknown:
        print(f"fedge-coordinator config keys: no section {', '.join(unknown)}; sections: {', '.join(known)}",
              file=sys.stderr)
        return 2
    chosen = [s for s in found if not args.sections or s.section in args.sections]
    if args.json:
        for s in chosen:
            print(json.dumps({"key": s.name, "type": s.type, "default": s.default, "help": s.help, "owner": s.owner}))
        return 0
    width = max(len(s.name) for s in chosen)
    section = None
    for s in chosen:
        if s.section != section:
            section = s.section
            owner = "" if s.owner == "core" else f"  (method {s.owner})"
            print(f"\n[{section}]{owner}")
        print(f"  {s.name:<{width}}  {json.dumps(s.default):<12} {s.help}")
    return 0


def _schema(args: argparse.Namespace) -> int:
    from coordinator.settings_schema import json_schema

    print(json.dumps(json_schema(), indent=2))
    return 0


def _show(args: argparse.Namespace) -> int:
    from coordinator.config import ConfigError, parse_override
    from coordinator.settings_schema import effective

    path = args.source / "config.toml" if args.source.is_dir() else args.source
    try:
        rows = effective(path, [parse_override(item) for item in args.set])
    except ConfigError as exc:
        print(f"fedge-coordinator config show: {exc}", file=sys.stderr)
        return 2
    rows = [r for r in rows if not args.changed or r[2] != "default"]
    width = max((len(name) for name, _, _ in rows), default=0)
    for name, value, source in rows:
        print(f"{name:<{width}}  {json.dumps(value):<24} {source}")
    return 0
