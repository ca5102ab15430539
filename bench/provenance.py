"""What a benchmark's numbers depend on besides its configuration: the code and the libraries.

A run file that says which commit it ran at (and whether the tree had changes not committed) can
be re-run from that commit (``bench/reproduce.py``), and one that predates a change to the code
that produced it can be found. torch and numpy are recorded because their kernels decide the last
bits of every sum; Python, the machine's architecture and its cores because torch's CPU kernels
split work by thread count; the CPU, its vector extensions and the instruction set torch's kernels use
(``bench/isa.py``) because a wider vector adds in another order: the same code and libraries give other
bits on an AVX2 CPU than on an AVX-512 one.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from isa import cpu_facts, in_force

ROOT = Path(__file__).resolve().parents[1]
UNRECORDED = "unrecorded"   # what a run file written before commits were recorded reads as
# Written while a matrix runs: changes there do not change the code that runs.
_NOT_CODE = ("bench/results",)

# The code whose change can change a cell's numbers: the packages a run executes, and the harness.
CODE = ("coordinator", "edge_client", "storage", "methods", "profiling", "bench/run_matrix.py")

__all__ = ["ROOT", "UNRECORDED", "CODE", "source_state", "library_versions", "machine", "changes_since"]


def _git(*args: str, root: Path) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def source_state(root: Path = ROOT) -> dict[str, Any]:
    """``{"commit": HASH, "dirty": bool}`` of the tree at ``root``; the commit is "unrecorded" outside a
    git checkout (a copied tree cannot say what it is). ``dirty``: tracked files changed since the commit,
    outside ``bench/results`` (which a running matrix writes into); untracked files are not counted."""
    commit = _git("rev-parse", "HEAD", root=root)
    if commit is None:
        return {"commit": UNRECORDED, "dirty": None}
    changed = _git("status", "--porcelain", "--untracked-files=no", "--", ".",
                   *(f":(exclude){p}" for p in _NOT_CODE), root=root)
    return {"commit": commit, "dirty": None if changed is None else bool(changed)}


def library_versions() -> dict[str, str]:
    """The versions whose kernels change the numbers: Python, torch, numpy."""
    import numpy
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__}


def machine() -> dict[str, Any]:
    """Architecture and cores (torch's CPU kernels split work by thread count, and so round differently), and
    the CPU and instruction set the kernels ran with (:func:`isa.cpu_facts`, :func:`isa.in_force`): the model,
    maker and generation, the vector extensions, the caches, torch's CPU capability and the variables capping
    it. ``bench/reproduce.py`` tells a re-run on another CPU from a regression by these."""
    import torch

    return {"arch": platform.machine(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            **cpu_facts(), **in_force()}


def changes_since(commit: str, root: Path = ROOT) -> list[str] | None:
    """The commits after ``commit`` (newest first, short hash and subject) that changed the code a cell runs
    (:data:`CODE`): a run file recorded at ``commit`` is stale when there are any. None when ``commit`` is
    unrecorded or unknown to this checkout (a shallow clone, a commit never pushed)."""
    if commit == UNRECORDED or _git("cat-file", "-e", f"{commit}^{{commit}}", root=root) is None:
        return None
    log = _git("log", "--format=%h %s", f"{commit}..HEAD", "--", *CODE, root=root)
    return None if log is None else [line for line in log.splitlines() if line]
