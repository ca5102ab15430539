"""First-boot kits: one directory per device that turns a freshly flashed board into a fleet member.

``fedge-coordinator kit`` reads a provisioning directory (``fedge-coordinator provision``) and
writes ``kits/ID/`` for each device: ``install.sh`` (the same for every device), ``kit.env``
(what to install: the target, the torch pin, the fedge wheel's name), ``client.env`` (the
service's data path and torch threads), the systemd unit, the fedge wheel, optionally the
device's data, and its bundle. Copy one kit onto its device's boot partition (or anywhere on it)
and run ``sudo bash KIT/install.sh``; docs/deploy.md#flash-kits walks through it.

The kit holds the device's password in ``bundle.toml`` only (mode 0600); ``install.sh`` moves it
to ``/etc/fedge`` and deletes the kit's copy, because a FAT boot partition cannot protect it.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from coordinator.ops.provision import ProvisionError, write_file
from edge_client.bundle import BundleError, read_bundle

__all__ = ["KitError", "KitOptions", "TARGETS", "write_kits"]

TARGETS = ("pi", "jetson")
# Every file of a kit but the bundle, the wheels and the data is text the kit writer makes or
# copies from this package, so a kit made by one fedge version installs that version.
_KIT_FILES = ("install.sh", "fedge-client.service")
_WHEEL_NAME = re.compile(r"^fedge-[^-]+-py3-none-any\.whl$")
_TORCH_WHEEL = re.compile(r"^torch-[^-]+-.*aarch64.*\.whl$")   # NVIDIA names its Jetson wheels freely


class KitError(ProvisionError):
    """A kit cannot be written; the message says what to fix."""


@dataclass(frozen=True)
class KitOptions:
    """What goes into every kit of one call."""

    target: str                         # "pi" or "jetson"
    wheel: Path                         # fedge's wheel, built from the checkout (pip wheel --no-deps -w dist .)
    torch_spec: str = "torch==2.13.0"   # a Pi's torch pin, installed from the package index
    torch_pip_args: str = ""            # e.g. "--index-url URL" for PyTorch's CPU-only index
    torch_wheel: Path | None = None     # a Jetson: NVIDIA's torch wheel for its JetPack
    torch_threads: int = 0              # the service's --torch-threads (0: one per core)
    low_memory: bool = False            # a 512 MB board: glibc gives freed memory back, one torch thread
    data: Path | None = None            # an npz for every kit (own data per device: copy it into kits/ID/data.npz)
    data_spec: str = "npz:/var/lib/fedge/data.npz"
    privacy_budget: float = 0.0         # > 0: every device keeps its own local-DP budget (fedge-client --privacy-budget)
    min_noise_multiplier: float = 0.0   # with it: the devices' floor on the tasks' noise multiplier


def _check(options: KitOptions) -> None:
    if options.target not in TARGETS:
        raise KitError(f"--target {options.target!r}: choose one of {', '.join(TARGETS)}")
    if not options.wheel.is_file():
        raise KitError(f"--wheel {options.wheel} does not exist: build it from the checkout with "
                       "pip wheel --no-deps -w dist .")
    if not _WHEEL_NAME.match(options.wheel.name):
        raise KitError(f"--wheel {options.wheel.name} is not a fedge wheel (fedge-VERSION-py3-none-any.whl)")
    if not re.fullmatch(r"torch==[0-9][0-9A-Za-z.+]*", options.torch_spec):
        raise KitError(f"--torch {options.torch_spec!r}: give an exact pin such as torch==2.13.0; an unpinned "
                       "torch pulls whatever is newest onto every device")
    if options.target == "jetson":
        if options.torch_wheel is None:
            raise KitError("--target jetson needs --torch-wheel: NVIDIA's PyTorch wheel for the devices' JetPack "
                           "(the package index has no Jetson build)")
        if not options.torch_wheel.is_file() or not _TORCH_WHEEL.match(options.torch_wheel.name):
            raise KitError(f"--torch-wheel {options.torch_wheel}: not an aarch64 torch wheel file")
    elif options.torch_wheel is not None:
        raise KitError("--torch-wheel is for --target jetson; a Pi installs --torch from the package index")
    if options.torch_threads < 0:
        raise KitError("--torch-threads must be 0 (one per core) or more")
    if options.data is not None and not options.data.is_file():
        raise KitError(f"--data-file {options.data} does not exist")
    if not (options.privacy_budget >= 0 and options.min_noise_multiplier >= 0) or (
            options.min_noise_multiplier and not options.privacy_budget):
        raise KitError("--privacy-budget must be a positive epsilon (0: none) and --min-noise-multiplier >= 0, "
                       "given only with --privacy-budget")
    if any(c in options.data_spec + options.torch_pip_args for c in "\"'`$\\\n"):
        raise KitError("--data-spec and --torch-pip-args may not contain quotes, $, backslashes or newlines")


def kit_env(options: KitOptions) -> str:
    """``kit.env``: what install.sh installs, read by bash (so values are plain words, quoted)."""
    lines = ["# What install.sh installs; written by fedge-coordinator kit. No secrets here.",
             f'FEDGE_KIT_TARGET="{options.target}"',
             f'FEDGE_WHEEL="{options.wheel.name}"',
             # a device keeping its own privacy budget needs the accountant too
             f'FEDGE_EXTRA="{"private-client" if options.privacy_budget else "client"}"']
    if options.target == "jetson":
        lines.append(f'TORCH_WHEEL="{options.torch_wheel.name}"')
    else:
        lines += [f'TORCH_SPEC="{options.torch_spec}"', f'TORCH_PIP_ARGS="{options.torch_pip_args}"']
    return "\n".join(lines) + "\n"


# glibc returns freed memory at once instead of keeping it for reuse: measured on the cnn, the
# client's peak fell by 56 MiB and training took about 2.7 times as long (docs/profiling.md).
LOW_MEMORY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def client_env(options: KitOptions) -> str:
    """``/etc/fedge/client.env``: the service's settings the bundle does not hold."""
    threads = 1 if options.low_memory and options.torch_threads == 0 else options.torch_threads
    lines = ["# fedge-client service settings, installed as /etc/fedge/client.env by the flash kit.",
             "# This device's data, passed as --data (npz:PATH, fashion-mnist:DIR or digits).",
             f"FEDGE_DATA={options.data_spec}",
             "# torch CPU threads (0: one per core); 1 on a board short of memory.",
             f"FEDGE_TORCH_THREADS={threads}"]
    if options.low_memory:
        lines += ["# a board short of memory: glibc gives freed memory back (smaller peak, slower training)",
                  *(f"{k}={v}" for k, v in LOW_MEMORY_MALLOC.items())]
    if options.privacy_budget:
        lines += ["# this device's own local-DP budget: it refuses tasks that would take its epsilon past this",
                  f"FEDGE_PRIVACY_BUDGET={options.privacy_budget:g}",
                  f"FEDGE_MIN_NOISE_MULTIPLIER={options.min_noise_multiplier:g}"]
    return "\n".join(lines) + "\n"


def write_kits(deploy_dir: Path, options: KitOptions, devices: list[str] | None = None) -> dict[str, Path]:
    """Write ``deploy_dir/kits/ID/`` for ``devices`` (default: every bundle in ``deploy_dir/devices``)."""
    _check(options)
    bundles = _bundles(Path(deploy_dir), devices)
    kits = Path(deploy_dir) / "kits"
    kits.mkdir(mode=0o700, exist_ok=True)
    written = {}
    for device, bundle in bundles.items():
        kit = kits / device
        kit.mkdir(mode=0o700, exist_ok=True)
        os.chmod(kit, 0o700)
        for name in _KIT_FILES:
            text = resources.files("coordinator.ops").joinpath("kit").joinpath(name).read_text(encoding="utf-8")
            write_file(kit / name, text, 0o755 if name.endswith(".sh") else 0o644)
        write_file(kit / "kit.env", kit_env(options), 0o644)
        write_file(kit / "client.env", client_env(options), 0o644)
        write_file(kit / "bundle.toml", bundle.read_text(encoding="utf-8"), 0o600)
        for old in kit.glob("fedge-*.whl"):
            old.unlink()
        shutil.copy2(options.wheel, kit / options.wheel.name)
        if options.torch_wheel is not None:
            shutil.copy2(options.torch_wheel, kit / options.torch_wheel.name)
        if options.data is not None:
            shutil.copy2(options.data, kit / "data.npz")
        written[device] = kit
    return written


def _bundles(deploy_dir: Path, devices: list[str] | None) -> dict[str, Path]:
    """Device id -> its bundle in the provisioning directory, each checked to be a readable bundle."""
    folder = deploy_dir / "devices"
    if not folder.is_dir():
        raise KitError(f"{deploy_dir} has no devices/ folder: give the --out directory of fedge-coordinator "
                       "provision")
    available = {p.stem: p for p in sorted(folder.glob("*.toml"))}
    wanted = devices or sorted(available)
    missing = [d for d in wanted if d not in available]
    if missing:
        raise KitError(f"no bundle for {', '.join(missing)} in {folder}; provisioned: "
                       f"{', '.join(sorted(available)) or 'none'}")
    for device in wanted:
        try:
            read_bundle(available[device])
        except BundleError as exc:
            raise KitError(str(exc)) from None
    return {d: available[d] for d in wanted}
