"""``fedge-coordinator settings``: every key a run's configuration accepts, its default and what it does."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["add_command"]


def add_command(sub, name: str = "settings") -> None:  # sub: the parser's subparsers
    settings = sub.add_parser(
        name, help="list every setting a run accepts (section.key, default, what it does)",
        description="Every key of a run's configuration file ([section] key = value, or --set section.key=value), "
                    "read from the sections' declarations: the runtime's, then each method's. A key set nowhere "
                    "takes the default shown.")
    settings.add_argument("sections", nargs="*", metavar="SECTION", help="only these sections (e.g. clients codec)")
    settings.add_argument("--json", action="store_true", help="one JSON object per key instead of a table")
    settings.add_argument("--markdown", action="store_true", help="all of them as docs/settings.md holds them")
    settings.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from coordinator.settings_schema import markdown, settings

    if args.markdown:
        sys.stdout.write(markdown())
        return 0
    found = settings()
    known = sorted({s.section for s in found})
    unknown = [name for name in args.sections if name not in known]
    if unknown:
        print(f"fedge-coordinator settings: no section {', '.join(unknown)}; sections: {', '.join(known)}",
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
