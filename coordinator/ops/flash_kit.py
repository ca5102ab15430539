"""First-boot kits: one directory per device that turns a freshly flashed board into a fleet member.

``fedge-coordinator kit`` reads a provisioning directory (``fedge-coordinator provision``) and
writes ``kits/ID/`` for each device: ``install.sh`` (the same for every device), ``kit.env``
(what to install: the target, the torch pin and where it comes from, with its size, the memory the
client needs, the fedge wheel's name, the apps, where to fetch the device's data), ``client.env`` (the
service's data path, app and torch threads), the systemd unit, the fedge wheel, the fleet owner's app
wheels with their manifest (``apps/``, coordinator.ops.kit_apps), optionally the device's data (one
file for all, or each device's own), and its bundle. Copy one kit onto its device's boot partition (or anywhere on it)
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
from urllib.parse import urlparse

from coordinator.ops.kit_apps import KitApp, KitError, kit_apps
from coordinator.ops.provision import write_file
from edge_client.device_protocol import ONLINE_LINE
from edge_client.bundle import BundleError, read_bundle

__all__ = ["KitError", "KitOptions", "TARGETS", "CPU_INDEX", "write_kits", "kit_env", "client_env", "memory_need"]

TARGETS = ("pi", "jetson")
# Where the kit's data goes on the device (install.sh installs it there, whatever its format).
DATA_PATH = "/var/lib/fedge/data.npz"
# Every file of a kit but the bundle, the wheels and the data is text the kit writer makes or
# copies from this package, so a kit made by one fedge version installs that version.
_KIT_FILES = ("install.sh", "fedge-client.service")
_WHEEL_NAME = re.compile(r"^fedge-[^-]+-py3-none-any\.whl$")
_TORCH_WHEEL = re.compile(r"^torch-[^-]+-.*aarch64.*\.whl$")   # NVIDIA names its Jetson wheels freely
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

# PyTorch's own index of CPU-only wheels. The package index's torch for aarch64 is a CUDA build: 2.7 GB of
# wheels and a 4.9 GB venv on an emulated Pi (docs/deploy.md#flash-kits), none of it usable on a Pi.
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Sizes install.sh announces and checks free space for, in MB. The CUDA build's are measured (arm-device.md);
# the CPU build's are estimates from the x86-64 CPU build of torch 2.13.0 (a 192 MB wheel; with its dependencies
# about 870 MB installed), rounded up; fedge's are its client extra's packages (numpy, cryptography, zstandard, ...).
TORCH_CPU_MB = (200, 900)        # download, installed
TORCH_DEFAULT_MB = (2700, 4900)
FEDGE_MB = 200
# The client's peak while starting (torch's import, its other libraries, its npz, connecting), measured on
# x86-64 (docs/profiling.md#device-footprint: 260.4 MiB; torch's import alone 219.3 MiB). Training adds
# edge_client.memory_guard's estimate for the model: for the cnn at batch size 64 the two add up to 376 MiB,
# where the client measured a peak of 370 MiB.
CLIENT_STARTUP_MIB = 260


@dataclass(frozen=True)
class KitOptions:
    """What goes into every kit of one call."""

    target: str                         # "pi" or "jetson"
    wheel: Path                         # fedge's wheel, built from the checkout (pip wheel --no-deps -w dist .)
    torch_spec: str = "torch==2.13.0"   # a Pi's torch pin
    torch_index: str = CPU_INDEX        # where a Pi's torch comes from; "" for the package index (a CUDA build)
    torch_pip_args: str = ""            # more pip arguments for torch, e.g. "--find-links DIR"
    torch_wheel: Path | None = None     # a Jetson: NVIDIA's torch wheel for its JetPack
    torch_threads: int = 0              # the service's --torch-threads (0: one per core)
    low_memory: bool = False            # a 512 MB board: glibc gives freed memory back, one torch thread
    data: Path | None = None            # an npz for every kit
    data_dir: Path | None = None        # DIR/ID.npz: each device's own npz, into its kit
    data_url: str = ""                  # fetched by install.sh; "{device}" becomes the device's id
    data_sha256: str = ""               # with data_url: the sha256 of all, or a file as sha256sum prints (ID.npz)
    data_spec: str = ""                 # the service's --data; "" for where the kit puts the data (service_data)
    apps: tuple[Path, ...] = ()         # app wheels installed beside fedge (coordinator.ops.kit_apps)
    # what the devices will train, for the memory check at install: fedge's own network (default cnn on
    # 1x28x28 images); None with apps, whose example inputs size it
    model: str | None = None
    image_size: int | None = None
    in_channels: int | None = None
    batch_size: int = 32
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
    if sum(x is not None and x != "" for x in (options.data, options.data_dir, options.data_url)) > 1:
        raise KitError("give one of --data-file (one npz for all), --data-dir (DIR/ID.npz per device) and "
                       "--data-url (fetched on the device)")
    if options.data is not None and not options.data.is_file():
        raise KitError(f"--data-file {options.data} does not exist")
    if options.data_dir is not None and not options.data_dir.is_dir():
        raise KitError(f"--data-dir {options.data_dir} is not a directory: give one holding ID.npz per device")
    if options.data_url:
        if urlparse(options.data_url).scheme not in ("http", "https") or not urlparse(options.data_url).netloc:
            raise KitError(f"--data-url {options.data_url!r}: give an http:// or https:// URL")
        if not options.data_sha256:
            raise KitError("--data-url needs --data-sha256: the data's SHA-256 (sha256sum FILE), or a file of "
                           "sha256sum lines naming ID.npz per device, so a device refuses data that is not yours")
    elif options.data_sha256:
        raise KitError("--data-sha256 goes with --data-url")
    if options.apps and (options.model, options.image_size, options.in_channels) != (None, None, None):
        raise KitError("--model, --image-size and --channels size fedge's own networks; with --app the apps' "
                       "example inputs size the devices' memory check: leave them out")
    if not (options.batch_size > 0 and all(n is None or n > 0 for n in (options.image_size, options.in_channels))):
        raise KitError("--batch-size, --image-size and --channels must be positive")
    if not (options.privacy_budget >= 0 and options.min_noise_multiplier >= 0) or (
            options.min_noise_multiplier and not options.privacy_budget):
        raise KitError("--privacy-budget must be a positive epsilon (0: none) and --min-noise-multiplier >= 0, "
                       "given only with --privacy-budget")
    if any(c in options.data_spec + options.torch_pip_args + options.torch_index + options.data_url
           for c in "\"'`$\\\n"):
        raise KitError("--data-spec, --torch-index, --torch-pip-args and --data-url may not contain quotes, $, "
                       "backslashes or newlines")


def memory_need(options: KitOptions, apps: tuple[KitApp, ...] | None = None) -> tuple[int, str]:
    """MiB the client needs on a device to train ``options.model`` (with apps: the app that needs the most),
    and the sum spelled out for a person. ``apps``: ``kit_apps(options.apps)`` when the caller has them.

    A device below it is OOM-killed seconds after the service starts, before the client logs a line,
    so install.sh checks it first."""
    apps = _apps(options, apps)
    if apps:
        train, what = max(_app_training(app, options.batch_size) for app in apps)
        if len(apps) > 1:
            what += f" (the most of the kit's {len(apps)} apps)"
    else:
        train, what = _builtin_training(options)
    need = CLIENT_STARTUP_MIB + train
    return need, (f"{need} MiB: {CLIENT_STARTUP_MIB} to start (torch's import alone about 220) and {train} to "
                  f"train {what} at batch size {options.batch_size}")


def _builtin_training(options: KitOptions) -> tuple[int, str]:
    """MiB to train fedge's own network ``options.model`` (default cnn, on 1x28x28 images), and what it is."""
    from edge_client.memory_guard import estimate_task_bytes
    from edge_client.models import ModelSpecError
    from edge_client.registry import build_aside

    name, size, channels = options.model or "cnn", options.image_size or 28, options.in_channels or 1
    spec = {"name": name, "num_classes": 10, "in_channels": channels, "image_size": size}
    try:
        model = build_aside(spec)
    except (ModelSpecError, KeyError, ValueError) as exc:
        raise KitError(f"--model {name!r}: {exc}") from None
    return _mib(estimate_task_bytes(model, spec, options.batch_size)), f"{name} on {channels}x{size}x{size} images"


def _app_training(kit_app: KitApp, batch_size: int) -> tuple[int, str]:
    """MiB to train an app's model (its factory's default options) on its example input, and what it is."""
    from edge_client.app import APP_KEY, example_input
    from edge_client.memory_guard import estimate_task_bytes
    from edge_client.registry import build_aside

    spec = {APP_KEY: kit_app.identity.to_spec()}
    try:
        shape = example_input(kit_app.app, {}).shape
        train = estimate_task_bytes(build_aside(spec), spec, batch_size)
    except Exception as exc:   # noqa: BLE001 -- the app's own factory may raise anything: one line, not a traceback
        raise KitError(f"--app {kit_app.wheel.path.name}: app {kit_app.name}'s model does not build and run on its "
                       f"example input with its default options ({type(exc).__name__}: {exc}), which the kit sizes "
                       "the devices' memory with") from None
    return _mib(train), (f"app {kit_app.name} {kit_app.identity.version} on inputs of shape "
                         f"{'x'.join(map(str, shape))}")


def _mib(size: int) -> int:
    return -(-size // 2**20)


def _apps(options: KitOptions, apps: tuple[KitApp, ...] | None) -> tuple[KitApp, ...]:
    """The kit's apps: ``apps`` when the caller read them already, else ``options.apps`` read now."""
    return kit_apps(options.apps) if apps is None else apps


def service_data(options: KitOptions) -> str:
    """The service's ``--data``: ``options.data_spec``, else where the kit puts the data (an npz of fedge's own
    kinds; with apps, the path the apps' loaders read)."""
    return options.data_spec or (DATA_PATH if options.apps else f"npz:{DATA_PATH}")


def kit_env(options: KitOptions, data_url: str = "", data_sha256: str = "",
            apps: tuple[KitApp, ...] | None = None) -> str:
    """``kit.env``: what install.sh installs, read by bash (so values are plain words, quoted).

    ``data_url`` and ``data_sha256``: this device's data to fetch at install (its own URL and digest);
    ``apps``: ``kit_apps(options.apps)`` when the caller has them."""
    apps = _apps(options, apps)
    need, why = memory_need(options, apps)
    lines = ["# What install.sh installs; written by fedge-coordinator kit. No secrets here.",
             f'FEDGE_KIT_TARGET="{options.target}"',
             f'FEDGE_WHEEL="{options.wheel.name}"',
             # a device keeping its own privacy budget needs the accountant too
             f'FEDGE_EXTRA="{"private-client" if options.privacy_budget else "client"}"',
             f"FEDGE_MB={FEDGE_MB}",
             "# memory the client needs (MiB): install.sh refuses a device with less",
             f"FEDGE_NEED_MIB={need}",
             f'FEDGE_NEED_WHY="{why}"',
             "# what the client logs once the broker passed its presence back: install.sh waits for it",
             f'FEDGE_ONLINE_LINE="{ONLINE_LINE}"',
             "# a device with less memory than this (MiB) gets the low-memory settings in client.env, as",
             "# --low-memory would have given it (unless client.env sets the allocator already)",
             f"FEDGE_LOW_MEMORY_BELOW_MIB={LOW_MEMORY_BELOW_MIB}",
             f'FEDGE_LOW_MEMORY_ENV="{" ".join(f"{k}={v}" for k, v in LOW_MEMORY_ENV.items())}"']
    if apps:
        lines += ["# the apps installed beside fedge (apps/: their wheels, checked against SHA256SUMS, and apps.txt,",
                  "# each app as fedge-client apps must list it once installed: name, version, digest)",
                  f'FEDGE_APPS="{" ".join(app.name for app in apps)}"']
    if options.target == "jetson":
        # installed, a torch wheel takes about four times its size (the x86-64 CPU one: 192 MB to 790 MB)
        wheel_mb = -(-options.torch_wheel.stat().st_size // 10**6)
        lines += [f'TORCH_WHEEL="{options.torch_wheel.name}"', "TORCH_DOWNLOAD_MB=0",
                  f"TORCH_INSTALLED_MB={4 * wheel_mb}", 'TORCH_FROM="NVIDIA\'s wheel in the kit"']
    else:
        # another index is taken for a mirror of PyTorch's CPU builds: their sizes
        download, installed = TORCH_CPU_MB if options.torch_index else TORCH_DEFAULT_MB
        where = ("the CPU-only build from PyTorch's index " + options.torch_index if options.torch_index == CPU_INDEX
                 else f"from the index {options.torch_index}" if options.torch_index
                 else "the package index's build (a CUDA build on aarch64)")
        lines += [f'TORCH_SPEC="{options.torch_spec}"', f'TORCH_INDEX="{options.torch_index}"',
                  f'TORCH_PIP_ARGS="{options.torch_pip_args}"', f"TORCH_DOWNLOAD_MB={download}",
                  f"TORCH_INSTALLED_MB={installed}", f'TORCH_FROM="{where}"']
    if data_url:
        lines += ["# this device's data, fetched at install and checked by its SHA-256",
                  f'DATA_URL="{data_url}"', f'DATA_SHA256="{data_sha256}"']
    return "\n".join(lines) + "\n"


# glibc gives every block of 64 KiB or more its own mapping and returns freed memory at once, instead of
# keeping training's freed blocks in a heap that fragments; torch asks for transparent huge pages on its
# blocks of 2 MiB or more, so that mapping them costs fewer page faults (a kernel without them ignores
# it). Measured on the cnn: the client's peak fell by 42 MiB, to within torch's import + 100 MiB, at
# about twice the training CPU time (2.6 times without the huge pages; docs/profiling.md).
LOW_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "THP_MEM_ALLOC_ENABLE": "1"}
# Below this much memory install.sh gives the service those settings even from a kit made without
# --low-memory: a 512 MB board (the Pi Zero 2 W, a Pi 3 A+) then fits the cnn's training.
LOW_MEMORY_BELOW_MIB = 1024


def client_env(options: KitOptions, apps: tuple[KitApp, ...] | None = None) -> str:
    """``/etc/fedge/client.env``: the service's settings the bundle does not hold. ``apps``: as for kit_env;
    only their names are read here."""
    apps = _apps(options, apps)
    threads = 1 if options.low_memory and options.torch_threads == 0 else options.torch_threads
    lines = ["# fedge-client service settings, installed as /etc/fedge/client.env by the flash kit.",
             "# This device's data, passed as --data (npz:PATH, fashion-mnist:DIR or digits; with an app,",
             "# the location its loader reads).",
             f"FEDGE_DATA={service_data(options)}",
             "# torch CPU threads (0: one per core); 1 on a board short of memory.",
             f"FEDGE_TORCH_THREADS={threads}"]
    if len(apps) == 1:
        lines += ["# the app the service runs (fedge-client run --app), installed by the kit",
                  f"FEDGE_APP={apps[0].name}"]
    elif apps:
        names = ", ".join(app.name for app in apps)
        lines += [f"# this kit installs the apps {names}: say which this device runs (fedge-client run --app);",
                  "# install.sh refuses to go on until FEDGE_APP is set", f"#FEDGE_APP={apps[0].name}"]
    if options.low_memory:
        lines += ["# a board short of memory: glibc gives freed memory back, torch maps its large blocks in",
                  "# huge pages where the kernel has them (smaller peak, slower training)",
                  *(f"{k}={v}" for k, v in LOW_MEMORY_ENV.items())]
    if options.privacy_budget:
        lines += ["# this device's own local-DP budget: it refuses tasks that would take its epsilon past this",
                  f"FEDGE_PRIVACY_BUDGET={options.privacy_budget:g}",
                  f"FEDGE_MIN_NOISE_MULTIPLIER={options.min_noise_multiplier:g}"]
    return "\n".join(lines) + "\n"


def write_kits(deploy_dir: Path, options: KitOptions, devices: list[str] | None = None) -> dict[str, Path]:
    """Write ``deploy_dir/kits/ID/`` for ``devices`` (default: every bundle in ``deploy_dir/devices``)."""
    _check(options)
    bundles = _bundles(Path(deploy_dir), devices)
    data = _device_data(options, list(bundles))
    apps = kit_apps(options.apps)
    memory_need(options, apps)   # an unknown model is refused before anything is written
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
        url, digest = data[device] if isinstance(data[device], tuple) else ("", "")
        write_file(kit / "kit.env", kit_env(options, url, digest, apps), 0o644)
        write_file(kit / "client.env", client_env(options, apps), 0o644)
        write_file(kit / "bundle.toml", bundle.read_text(encoding="utf-8"), 0o600)
        for old in kit.glob("fedge-*.whl"):
            old.unlink()
        shutil.copy2(options.wheel, kit / options.wheel.name)
        if options.torch_wheel is not None:
            shutil.copy2(options.torch_wheel, kit / options.torch_wheel.name)
        _write_apps(kit / "apps", apps)
        (kit / "data.npz").unlink(missing_ok=True)   # a kit written again with other data keeps none of the old
        if isinstance(data[device], Path):
            shutil.copy2(data[device], kit / "data.npz")
        written[device] = kit
    return written


def _write_apps(folder: Path, apps: tuple[KitApp, ...]) -> None:
    """``folder``: the app wheels, their manifest ``SHA256SUMS`` (as sha256sum prints it, which install.sh
    checks them with) and ``apps.txt`` (each app as ``fedge-client apps`` lists it); none of an earlier kit's."""
    shutil.rmtree(folder, ignore_errors=True)
    if not apps:
        return
    folder.mkdir(mode=0o755)
    wheels = {app.wheel.path.name: app.wheel for app in apps}
    for name, wheel in wheels.items():
        shutil.copy2(wheel.path, folder / name)
    write_file(folder / "SHA256SUMS", "".join(f"{w.sha256}  {n}\n" for n, w in wheels.items()), 0o644)
    write_file(folder / "apps.txt", "".join(f"{app.identity.line()}\n" for app in apps), 0o644)


def _device_data(options: KitOptions, devices: list[str]) -> dict[str, Path | tuple[str, str] | None]:
    """Each device's data: a file for its kit, a (URL, SHA-256) to fetch at install, or None (the device
    has its data already, at ``data_spec``); everything checked before any kit is written."""
    if options.data is not None:
        return {d: options.data for d in devices}
    if options.data_dir is not None:
        missing = [d for d in devices if not (options.data_dir / f"{d}.npz").is_file()]
        if missing:
            raise KitError(f"--data-dir {options.data_dir} has no {', '.join(f'{d}.npz' for d in missing)}: "
                           "put one npz per device there, named by its id")
        return {d: options.data_dir / f"{d}.npz" for d in devices}
    if not options.data_url:
        return {d: None for d in devices}
    digests = _digests(options.data_sha256, devices)
    return {d: (options.data_url.replace("{device}", d), digests[d]) for d in devices}


def _digests(given: str, devices: list[str]) -> dict[str, str]:
    """The SHA-256 of each device's data: one digest for all, or a file as ``sha256sum *.npz`` prints it,
    whose names (their base name) are ``ID.npz``."""
    if _SHA256.match(given.lower()):
        return {d: given.lower() for d in devices}
    path = Path(given)
    if not path.is_file():
        raise KitError(f"--data-sha256 {given!r} is neither a SHA-256 (64 hex digits) nor a file of sha256sum lines")
    found = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2 and _SHA256.match(parts[0].lower()):
            found[Path(parts[1].strip().lstrip("*")).name] = parts[0].lower()
    missing = [d for d in devices if f"{d}.npz" not in found]
    if missing:
        raise KitError(f"--data-sha256 {path} names no {', '.join(f'{d}.npz' for d in missing)}: make it with "
                       "sha256sum ID.npz ... over the devices' files")
    return {d: found[f"{d}.npz"] for d in devices}


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
