"""Command-line checks that need neither torch nor the data, run before the heavy imports.

Importing torch takes 1.5 s on a laptop and 5 to 8 s on a Raspberry Pi, and a mistyped flag
should not wait for it: the command-line tools (``fedge-coordinator``, ``fedge-client``,
``fedge-export``) check here what the text alone shows (spec syntax, ranges, whether a named
file exists) and say what is wrong in one line. What needs the data or torch is still checked
where it is used; this module only answers sooner for what it can see. It imports numpy (for the
data module's spec grammar) only when a spec is checked, so a device missing an extra still gets
the command's own "install it" line.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

__all__ = ["OneLineParser", "at_least", "positive", "fraction", "check_data_spec", "check_partition_spec"]


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line naming the remedy, not the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (--help lists the options)\n")


def at_least(minimum: float, kind: type = int) -> Callable[[str], int | float]:
    """An argparse ``type``: a number of ``kind`` that is at least ``minimum``."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not (math.isfinite(value) and value >= minimum):
            raise argparse.ArgumentTypeError(f"{text} is out of range: it must be at least {minimum}")
        return value

    parse.__name__ = kind.__name__   # argparse names the type in its messages
    return parse


def positive(text: str) -> float:
    """An argparse ``type``: a number above 0 (a timeout, a rate)."""
    value = at_least(0.0, float)(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text} is out of range: it must be above 0")
    return value


def fraction(text: str) -> float:
    """An argparse ``type``: a share in [0, 1)."""
    value = at_least(0.0, float)(text)
    if value >= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is out of range: it must be in [0, 1)")
    return value


def check_data_spec(spec: str) -> None:
    """Raise DataError when ``spec`` is not a data spec :func:`edge_client.data.load_dataset` takes, or
    names a file or directory that is not there; reads no data."""
    from edge_client.data import DATASET_SPECS, FASHION_MNIST_DIR, DataError

    kind, sep, arg = spec.partition(":")
    if spec == "digits" or (kind == "fashion-mnist" and not arg):
        return
    if kind == "fashion-mnist":
        if not Path(arg).is_dir():
            raise DataError(f"{arg}: no such directory; fashion-mnist:DIR needs the directory holding the "
                            f"Fashion-MNIST IDX files (or plain fashion-mnist for {FASHION_MNIST_DIR})")
        return
    if kind == "npz" and arg:
        if not Path(arg).is_file():
            raise DataError(f"{arg}: npz file not found; check the path in npz:PATH")
        return
    raise DataError(f"unknown dataset spec {spec!r}; valid: {DATASET_SPECS}")


def check_partition_spec(spec: str) -> None:
    """Raise DataError when ``spec`` is not a partition spec (iid, dirichlet:ALPHA, shards:K, attribute:...)."""
    from edge_client.data import parse_attribute_skew, parse_label_spec

    if parse_attribute_skew(spec) is None:
        parse_label_spec(spec)
