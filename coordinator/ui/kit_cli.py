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
                    "checks the device's memory and disk, creates the venv, installs torch (a Pi: the CPU-only "
                    "build) and fedge's client extra, places the device's bundle, data and systemd unit, starts "
                    "it and waits until the device is online on the broker; kit.env and client.env (no secrets); "
                    "the fedge wheel; the app wheels (--app), which install.sh installs beside fedge; and the "
                    "device's bundle (0600, deleted by install.sh once installed). Copy a kit onto its device and "
                    "run sudo bash KIT/install.sh; it is safe to run again, and a kit with a newer wheel upgrades "
                    "fedge. docs/deploy.md#flash-kits walks through it.")
    kit.add_argument("--deploy", type=Path, required=True, metavar="DIR",
                     help="the --out directory of fedge-coordinator provision")
    kit.add_argument("--target", choices=("pi", "jetson"), required=True,
                     help="pi: Raspberry Pi OS 64-bit, torch's CPU-only build (--torch-index); jetson: JetPack 6 "
                          "with NVIDIA's torch wheel (--torch-wheel)")
    kit.add_argument("--wheel", type=Path, required=True,
                     help="fedge's wheel, built from the checkout: pip wheel --no-deps -w dist .")
    kit.add_argument("--app", action="append", default=[], type=Path, metavar="WHEEL", dest="apps",
                     help="an app's wheel (pip wheel --no-deps -w dist APP_DIR; repeatable: a device may hold "
                          "several), installed beside fedge with its dependencies; each app it registers must be "
                          "installed here too, as the coordinator runs it. One app: the service runs it (--app NAME)")
    kit.add_argument("--device", action="append", default=[], metavar="ID",
                     help="only this device (repeatable; default: every bundle in DEPLOY/devices)")
    kit.add_argument("--torch", default="torch==2.13.0", metavar="SPEC",
                     help="a Pi's torch pin (default torch==2.13.0)")
    kit.add_argument("--torch-index", default=None, metavar="URL",
                     help="where a Pi's torch comes from (default: PyTorch's index of CPU-only builds, about "
                          "200 MB to download); 'pypi' for the package index, whose aarch64 torch is a CUDA build "
                          "(2.7 GB, 4.9 GB installed, of no use on a Pi)")
    kit.add_argument("--torch-pip-args", default="", metavar="ARGS",
                     help="more pip arguments for torch on a Pi, e.g. '--find-links DIR' for wheels of your own")
    kit.add_argument("--torch-wheel", type=Path, default=None,
                     help="a Jetson: NVIDIA's PyTorch wheel for the devices' JetPack, copied into each kit")
    kit.add_argument("--torch-threads", type=int, default=0, metavar="N",
                     help="the service's torch CPU threads (0, the default: one per core)")
    kit.add_argument("--low-memory", action="store_true",
                     help="for 512 MB boards (Pi Zero 2 W): one torch thread and allocator settings that give freed "
                          "memory back: a smaller peak, slower training (docs/profiling.md#device-footprint); "
                          "install.sh gives a device under 1 GiB the allocator settings anyway")
    data = kit.add_mutually_exclusive_group()
    data.add_argument("--data-file", type=Path, default=None, metavar="NPZ",
                      help="an npz (arrays x, y) copied into every kit as the device's data")
    data.add_argument("--data-dir", type=Path, default=None, metavar="DIR",
                      help="each device's own data: DIR/ID.npz copied into kit ID")
    data.add_argument("--data-url", default="", metavar="URL",
                      help="data too large for the boot partition: install.sh fetches it from this http(s) URL, in "
                           "which {device} becomes the device's id, and checks it against --data-sha256")
    kit.add_argument("--data-sha256", default="", metavar="HEX|FILE",
                     help="with --data-url: the data's SHA-256, or a file of sha256sum lines naming ID.npz per device")
    spec = kit.add_mutually_exclusive_group()
    spec.add_argument("--data-spec", default="",
                      help="the service's --data (default npz:/var/lib/fedge/data.npz, where the kit puts the data; "
                           "with --app, /var/lib/fedge/data.npz, which the app's loader reads whatever its format)")
    spec.add_argument("--data-path", default=None, metavar="PATH",
                      help="the data is on the device already, at this path (a USB stick, a second partition): "
                           "the same as --data-spec npz:PATH (with --app, --data-spec PATH)")
    kit.add_argument("--model", default=None, help="fedge's own network the devices will train (default cnn): "
                                                   "install.sh refuses a device with less memory than training it "
                                                   "needs; with --app, the app's model and example input size it")
    kit.add_argument("--batch-size", type=int, default=32, metavar="N", help="its training batch size (default 32)")
    kit.add_argument("--image-size", type=int, default=None, metavar="N",
                     help="fedge's own network's input images' side (default 28; not with --app)")
    kit.add_argument("--channels", type=int, default=None, metavar="N",
                     help="fedge's own network's input images' channels (default 1; not with --app)")
    kit.add_argument("--privacy-budget", type=float, default=0.0, metavar="EPSILON",
                     help="every device keeps its own local-DP budget and refuses tasks that would take its epsilon "
                          "past this (the kit installs the accountant; docs/privacy.md#the-devices-own-budget)")
    kit.add_argument("--min-noise-multiplier", type=float, default=0.0, metavar="Z",
                     help="with --privacy-budget: the devices refuse tasks asking for less noise than this")
    kit.set_defaults(handler=_kit)


def _kit(args: argparse.Namespace) -> int:
    from coordinator.ops.flash_kit import CPU_INDEX, KitError, KitOptions, memory_need, write_kits
    from coordinator.ops.kit_apps import kit_apps

    data_path = args.data_path and (args.data_path if args.apps else f"npz:{args.data_path}")
    options = KitOptions(target=args.target, wheel=args.wheel, torch_spec=args.torch,
                         torch_index={None: CPU_INDEX, "pypi": ""}.get(args.torch_index, args.torch_index),
                         torch_pip_args=args.torch_pip_args, torch_wheel=args.torch_wheel,
                         torch_threads=args.torch_threads, low_memory=args.low_memory, data=args.data_file,
                         data_dir=args.data_dir, data_url=args.data_url, data_sha256=args.data_sha256,
                         data_spec=data_path or args.data_spec, apps=tuple(args.apps), model=args.model,
                         batch_size=args.batch_size, image_size=args.image_size, in_channels=args.channels,
                         privacy_budget=args.privacy_budget,
                         min_noise_multiplier=args.min_noise_multiplier)
    try:
        kits = write_kits(args.deploy, options, args.device or None)
        apps = kit_apps(options.apps)
    except KitError as exc:
        print(f"fedge-coordinator kit: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(kits)} {args.target} kits in {args.deploy / 'kits'}/ (each holds its device's password: "
          "keep them private until installed)")
    print(f"each device needs {memory_need(options, apps)[1]}; install.sh refuses one with less")
    if len(apps) == 1:
        app = apps[0]
        print(f"the devices get app {app.name} {app.identity.version} (digest {app.identity.digest[:12]}) and run "
              f"it: fedge-client run --app {app.name} (FEDGE_APP in client.env)")
    elif apps:
        print(f"the devices get apps {', '.join(f'{a.name} {a.identity.version}' for a in apps)}; each must be told "
              "which it runs: set FEDGE_APP=NAME in its kit's client.env (the service's fedge-client run --app NAME) "
              "before install.sh, which refuses to go on without it")
    print("next: copy kits/ID onto device ID and run: sudo bash KIT/install.sh (docs/deploy.md#flash-kits)")
    if len(apps) == 1:
        print(f"then train it: fedge-coordinator run ... --set app.module={apps[0].name} ([app] module in the run's "
              "config; docs/apps.md)")
    return 0
