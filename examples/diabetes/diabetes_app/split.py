"""Write the bundled diabetes set as one CSV per device: ``python -m diabetes_app.split OUT_DIR DEVICES``."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path, help="directory to write device-001.csv, device-002.csv, ... into")
    parser.add_argument("devices", type=int, help="how many devices (files)")
    parser.add_argument("--seed", type=int, default=0, help="shuffling seed (default 0)")
    args = parser.parse_args(argv)
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    order = np.random.default_rng(args.seed).permutation(len(y))
    args.out.mkdir(parents=True, exist_ok=True)
    for i, rows in enumerate(np.array_split(order, args.devices), start=1):
        path = args.out / f"device-{i:03d}.csv"
        np.savetxt(path, np.column_stack([x[rows], y[rows]]), delimiter=",")
        print(f"{path}: {len(rows)} patients")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
