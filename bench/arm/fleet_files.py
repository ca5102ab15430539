"""The emulated fleet's files, kept in the cache beside the root: a TLS deployment and the devices' data.

One provisioning (``fedge-coordinator provision``) for the broker on 127.0.0.1 serves every bench
run, so the bundle the flash kit installed on the aarch64 device stays valid. The data is
scikit-learn's digits, split once: the coordinator's evaluation set and one npz per device, in the
format a real device keeps (``npz:`` with ``x``/``y``, pixels in [0, 1]).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from coordinator.ops.provision import provision

__all__ = ["DEVICES", "ARM_DEVICE", "ensure_deployment", "ensure_data"]

DEVICES = ("device-001", "device-002", "device-003")
ARM_DEVICE = "device-003"


def ensure_deployment(folder: Path, port: int) -> Path:
    """A provisioned TLS deployment for 127.0.0.1:``port`` in ``folder`` (made once)."""
    if not (folder / "devices").is_dir():
        provision(folder, hosts=["127.0.0.1"], devices=list(DEVICES), port=port, listen="127.0.0.1",
                  broker_dir=str(folder.resolve() / "broker"))
    return folder


def ensure_data(folder: Path, seed: int = 0) -> dict[str, Path]:
    """``eval.npz`` (a held-out fifth of digits) and one iid share of the rest per device."""
    paths = {name: folder / f"{name}.npz" for name in ("eval", *DEVICES)}
    if all(p.exists() for p in paths.values()):
        return paths
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    test, train = order[: len(y) // 5], order[len(y) // 5:]
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(paths["eval"], x=x[train], y=y[train], x_test=x[test], y_test=y[test])
    for name, share in zip(DEVICES, np.array_split(train, len(DEVICES))):
        # a small held-out slice of the device's own rows, so the whole of x trains
        np.savez(paths[name], x=x[share], y=y[share], x_test=x[share[:20]], y_test=y[share[:20]])
    return paths
