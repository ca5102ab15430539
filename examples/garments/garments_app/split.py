"""Write one npz file of target-task pictures per device, from Fashion-MNIST's training split.

    python -m garments_app.split OUT N [--per-device K] [--eval E] [--seed S]

Each file (``OUT/device-001.npz`` ...) holds ``x``, uint8 pictures (K, 3, 48, 48), and ``y``, labels 0-4
(sandal, shirt, sneaker, bag, ankle boot); the devices' pictures are disjoint, drawn at random with ``seed``.
``OUT/eval.npz`` holds E pictures of the test split's same classes (0: all 5,000) for the coordinator.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from garments_app.data import DEFAULT_DIR, TARGET_CLASSES, garments

__all__ = ["split", "main"]


def split(out: Path, devices: int, per_device: int = 0, seed: int = 0, directory: Path = DEFAULT_DIR,
          evaluation: int | None = None) -> list[Path]:
    """Write ``devices`` files of ``per_device`` pictures each (0: the whole split shared out) and, unless
    ``evaluation`` is None, ``eval.npz`` of that many test pictures (0: all); the device files' paths."""
    if devices < 1:
        raise ValueError(f"devices must be at least 1, got {devices}")
    pictures, labels = garments("train", TARGET_CLASSES, directory, limit=devices * per_device, seed=seed)
    order = np.random.default_rng(seed).permutation(len(labels))
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, part in enumerate(np.array_split(order, devices), start=1):
        path = out / f"device-{i:03d}.npz"
        np.savez_compressed(path, x=pictures[part], y=labels[part])
        paths.append(path)
    if evaluation is not None:
        x, y = garments("test", TARGET_CLASSES, directory, limit=evaluation, seed=seed)
        np.savez_compressed(out / "eval.npz", x=x, y=y)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("devices", type=int)
    parser.add_argument("--per-device", type=int, default=0, help="pictures per device (0: all 30,000 shared out)")
    parser.add_argument("--eval", type=int, default=0, help="test pictures in eval.npz (0: all 5,000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", type=Path, default=DEFAULT_DIR, help="directory of the four IDX files")
    args = parser.parse_args(argv)
    for path in split(args.out, args.devices, args.per_device, args.seed, args.data, args.eval):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
