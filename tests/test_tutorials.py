"""The tutorials' commands run as the pages show them, and print what the pages show (tests/tutorial_pages.py).

Each page runs in a fresh directory beside links to the repository's files, with the project's commands on the
PATH, as a reader who cloned the repository and ran ``make demo`` would. What a command leaves running in the
background (a broker, devices: ``&``) lives until the page's last command, then its process group is ended. Blocks marked ``long`` run only with
``FEDGE_TUTORIALS=long`` (``make tutorials``): they need root or many minutes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tutorial_pages import read_blocks, mismatch

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs" / "tutorials").glob("*.md"))
LONG = os.environ.get("FEDGE_TUTORIALS") == "long"
COMMAND_TIMEOUT = 900 if LONG else 300


def _workdir(tmp_path: Path) -> Path:
    """A reader's checkout: the repository's files, by link, and room for what the commands write."""
    for entry in ROOT.iterdir():
        if entry.name not in {".git", ".venv", "runs", "site"} and not entry.name.startswith("."):
            (tmp_path / entry.name).symlink_to(entry)
    return tmp_path


def _environment() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(ROOT), "COLUMNS": "120", "NO_COLOR": "1", "TERM": "dumb"}
    return env


@pytest.mark.integration
@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_a_tutorials_commands_print_what_it_shows(page: Path, tmp_path: Path) -> None:
    blocks = read_blocks(page)
    assert any(block.commands for block in blocks), f"{page.name} shows no console session"
    cwd, env = _workdir(tmp_path), _environment()
    groups: list[int] = []
    ran = 0
    try:
        for block in blocks:
            if block.kind == "skip" or (block.kind == "long" and not LONG):
                continue
            for command in block.commands:
                printed = _run(command.text, cwd, env, groups)
                where = f"{page.relative_to(ROOT)}:{command.line}: $ {command.text}"
                assert printed.returncode == 0, f"{where}\nexited {printed.returncode}:\n{printed.text[-3000:]}"
                problem = mismatch(command.shown, printed.text, block.numbers_vary)
                assert not problem, f"{where}\n{problem}; it printed:\n{printed.text[-3000:]}"
                ran += 1
    finally:
        for group in groups:
            try:
                os.killpg(group, signal.SIGTERM)
            except ProcessLookupError:
                pass
    assert ran or LONG or all(b.kind != "run" for b in blocks)


class _Printed:
    def __init__(self, returncode: int, text: str) -> None:
        self.returncode, self.text = returncode, text


def _run(command: str, cwd: Path, env: dict[str, str], groups: list[int]) -> _Printed:
    """One command in a process group of its own, its output to a file: a background job keeps neither a pipe
    open nor the group from being ended with the page."""
    log = cwd / f".tutorial-{len(groups)}.out"
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", "-o", "pipefail", "-c", command], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        groups.append(proc.pid)
        try:
            code = proc.wait(timeout=COMMAND_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = -9
    return _Printed(code, log.read_text(errors="replace"))
