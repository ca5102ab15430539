"""torch's global random generator, shared by every thread of a process.

Simulated clients are threads of one process (``coordinator/runtime/simulation.py``), beside the
coordinator, which builds networks while they train. torch keeps one global generator per
process, so a thread that seeds it, draws from it (building a network, ``reset_parameters``)
or forks it (``torch.random.fork_rng`` restores it on exit) changes what another thread draws
in between: the fresh branches a device builds for itself then depended on which other task
happened to start at that moment, and two runs of the same seed drifted apart. Every such use goes through this
module's lock; code that must be reproducible under concurrency draws from its own
``torch.Generator`` as well (data order, MI shuffles).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["global_rng", "private_rng", "seed_global_rng", "task_generator"]

_LOCK = threading.RLock()


@contextmanager
def global_rng() -> Iterator[None]:
    """Draw from the global generator without another thread seeding, forking or drawing meanwhile."""
    with _LOCK:
        yield


@contextmanager
def private_rng(seed: int | None = None) -> Iterator[None]:
    """The global generator for this thread alone, seeded with ``seed`` if given, and left as it was:
    a seeded initialization that does not move anyone's random stream."""
    with _LOCK, torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        yield


def seed_global_rng(seed: int) -> None:
    """Seed the global generator between, never inside, other threads' sections."""
    with _LOCK:
        torch.manual_seed(seed)


def task_generator(seed: int) -> torch.Generator:
    """A training task's own generator, with the global one seeded the same for any layer that draws
    from it: what the task does at random follows from its seed."""
    seed_global_rng(seed)
    return torch.Generator().manual_seed(seed)
