"""``fedge-coordinator new``: start an app from a template (coordinator.ops.scaffold)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_command"]


def add_command(sub, name: str = "new") -> None:  # sub: the parser's subparsers
    from coordinator.ops.scaffold import TEMPLATES

    new = sub.add_parser(
        name, help="write a new app package (your model, data, loss, metrics) from a template",
        description="Write DIR/NAME/: a working app package (NAME_app/, pyproject.toml registering it as "
                    "NAME, a test, a README) from a template whose data needs no download, and print the one "
                    "command that trains it in a simulation. Templates: "
                    + "; ".join(f"{t}: {entry[0]}" for t, entry in TEMPLATES.items()) + ". docs/apps.md")
    new.add_argument("name", help="the app's name: a lower-case letter, then letters, digits or '_'")
    new.add_argument("--template", choices=sorted(TEMPLATES), default="tabular", help="what to start from")
    new.add_argument("--dir", type=Path, default=Path("."), help="where to write NAME/ (default: here)")
    new.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from coordinator.ops.scaffold import ScaffoldError, train_command, write_app

    try:
        root = write_app(args.name, args.template, args.dir)
    except ScaffoldError as exc:
        print(f"fedge-coordinator new: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {root}/ ({args.name}_app/__init__.py: the app; pyproject.toml; tests/; README.md)")
    print(f"train it (from {args.dir}):")
    print(f"  {train_command(args.name, args.template)}")
    return 0
