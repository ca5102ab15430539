"""Write generated gesture windows as one npz file per device, and an evaluation file:
``python -m gestures_app.make_data OUT_DIR DEVICES``."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from gestures_app.data import GESTURES, device_windows, eval_set


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path, help="directory to write device-001.npz, ... and eval.npz into")
    parser.add_argument("devices", type=int, help="how many devices (files)")
    parser.add_argument("--windows", type=int, default=150, help="windows per device (default 150)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the data's seed (default 0; with 0, eval.npz is the app's 'synthetic' evaluation set)")
    args = parser.parse_args(argv)
    if args.devices < 1 or args.windows < 1:
        parser.error("devices and --windows must be at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    for i in range(1, args.devices + 1):
        _write(args.out / f"device-{i:03d}.npz", *device_windows(args.seed, i, args.windows))
    _write(args.out / "eval.npz", *eval_set(args.seed))
    return 0


def _write(path: Path, x: np.ndarray, y: np.ndarray) -> None:
    np.savez(path, x=x, y=y)
    counts = ", ".join(f"{name} {int((y == k).sum())}" for k, name in enumerate(GESTURES))
    print(f"{path}: {len(y)} windows ({counts})")


if __name__ == "__main__":
    raise SystemExit(main())
