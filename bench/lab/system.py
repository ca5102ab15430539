"""The lab's only way to change the machine: run a command or write a kernel file, or, in a dry run,
print what would be done. One place, so ``--dry-run`` shows exactly what a real run does."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["CommandError", "System"]


class CommandError(RuntimeError):
    """A command or kernel write that failed; the message has the command and what it printed."""


class System:
    def __init__(self, *, dry_run: bool = False, echo=None) -> None:
        self.dry_run = dry_run
        self.echo = echo or print

    def run(self, *cmd: str, check: bool = True) -> str:
        """Run ``cmd``; its stdout. ``check=False``: failures are ignored (clean-up of what may be gone)."""
        if self.dry_run:
            self.echo("  $ " + " ".join(cmd))
            return ""
        done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if check and done.returncode != 0:
            raise CommandError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def write(self, path: Path, value: str | int) -> None:
        if self.dry_run:
            self.echo(f"  > {path} = {value}")
            return
        try:
            Path(path).write_text(f"{value}\n")
        except OSError as exc:
            raise CommandError(f"writing {value} to {path}: {exc.strerror}") from None

    def mkdir(self, path: Path) -> None:
        if self.dry_run:
            self.echo(f"  mkdir {path}")
            return
        Path(path).mkdir(exist_ok=True)
