"""``fedge-coordinator kit``: first-boot kits for a provisioned fleet (coordinator.ops.flash_kit)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_command"]


def add_command(sub, name: str = "kit") -> None:  # sub: the parser's subparsers
    kit = sub.add_parser(
        name, help="write one first-boot kit per provisioned device (install script, unit, wheel, bundle)",
        description="Write DEPLOY/kits/ID/ for each device of a provisioning directory: install.sh, which "
                    "creates the venv, installs torch and fedge's client extra, places the device's bundle, data "
                    "and systemd unit and starts it; kit.env and client.env (no secrets); the fedge wheel; and "
                    "the device's bundle (0600, deleted by install.sh once installed). Copy a kit onto its "
                    "device and run sudo bash KIT/install.sh; it is safe to run again, and a kit with a newer "
                    "wheel upgrades fedge. docs/deploy.md#flash-kits walks through it.")
    kit.add_argument("--deploy", type=Path, required=True, metavar="DIR",
                     help="the --out directory of fedge-coordinator provision")
    kit.add_argument("--target", choices=("pi", "jetson"), required=True,
                     help="pi: Raspberry Pi OS 64-bit, torch from the package index; jetson: JetPack 6 with "
                          "NVIDIA's torch wheel (--torch-wheel)")
    kit.add_argument("--wheel", type=Path, required=True,
                     help="fedge's wheel, built from the checkout: pip wheel --no-deps -w dist .")
    kit.add_argument("--device", action="append", default=[], metavar="ID",
                     help="only this device (repeatable; default: every bundle in DEPLOY/devices)")
    kit.add_argument("--torch", default="torch==2.13.0", metavar="SPEC",
                     help="a Pi's torch pin (default torch==2.13.0)")
    kit.add_argument("--torch-pip-args", default="", metavar="ARGS",
                     help="extra pip arguments for torch on a Pi, e.g. '--index-url URL' for a CPU-only index")
    kit.add_argument("--torch-wheel", type=Path, default=None,
                     help="a Jetson: NVIDIA's PyTorch wheel for the devices' JetPack, copied into each kit")
    kit.add_argument("--torch-threads", type=int, default=0, metavar="N",
                     help="the service's torch CPU threads (0, the default: one per core)")
    kit.add_argument("--low-memory", action="store_true",
                     help="for 512 MB boards (Pi Zero 2 W): one torch thread and glibc settings that give freed "
                          "memory back: a smaller peak, slower training (docs/profiling.md#device-footprint)")
    kit.add_argument("--data-file", type=Path, default=None, metavar="NPZ",
                     help="an npz (arrays x, y) copied into every kit as the device's data; for data of its own, "
                          "put DEPLOY/kits/ID/data.npz there yourself")
    kit.add_argument("--data-spec", default="npz:/var/lib/fedge/data.npz",
                     help="the service's --data (default npz:/var/lib/fedge/data.npz, where the kit puts data.npz)")
    kit.add_argument("--privacy-budget", type=float, default=0.0, metavar="EPSILON",
                     help="every device keeps its own local-DP budget and refuses tasks that would take its epsilon "
                          "past this (the kit installs the accountant; docs/privacy.md#the-devices-own-budget)")
    kit.add_argument("--min-noise-multiplier", type=float, default=0.0, metavar="Z",
                     help="with --privacy-budget: the devices refuse tasks asking for less noise than this")
    kit.set_defaults(handler=_kit)


def _kit(args: argparse.Namespace) -> int:
    from coordinator.ops.flash_kit import KitError, KitOptions, write_kits

    options = KitOptions(target=args.target, wheel=args.wheel, torch_spec=args.torch,
                         torch_pip_args=args.torch_pip_args, torch_wheel=args.torch_wheel,
                         torch_threads=args.torch_threads, low_memory=args.low_memory, data=args.data_file,
                         data_spec=args.data_spec, privacy_budget=args.privacy_budget,
                         min_noise_multiplier=args.min_noise_multiplier)
    try:
        kits = write_kits(args.deploy, options, args.device or None)
    except KitError as exc:
        print(f"fedge-coordinator kit: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(kits)} {args.target} kits in {args.deploy / 'kits'}/ (each holds its device's password: "
          "keep them private until installed)")
    print("next: copy kits/ID onto device ID and run: sudo bash KIT/install.sh (docs/deploy.md#flash-kits)")
    return 0
