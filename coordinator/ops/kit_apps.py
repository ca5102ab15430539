"""The apps a flash kit installs beside fedge (``fedge-coordinator kit --app WHEEL``).

Code never travels over MQTT: an app reaches a device only by being installed on it (docs/apps.md). A kit
carries the app wheels in ``apps/`` with their manifest (``SHA256SUMS``) and ``apps.txt``, each app as
``fedge-client apps`` lists it once installed (name, version, digest); ``install.sh`` checks the wheels
against the manifest, installs them into the device's venv beside fedge and compares what ``fedge-client
apps`` lists with ``apps.txt``.

Everything is checked when the kit is written: each wheel is read (a zip with one ``.dist-info`` whose
entry points register at least one app in the ``fedge.apps`` group), and each app it registers is loaded
from this machine, which runs the coordinator's side of the same app: its identity is the one the
coordinator's tasks will carry, so the wheel's files must give the same digest (a device installing other
files would refuse every task), and its example input sizes the devices' memory check.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from coordinator.ops.provision import ProvisionError
from edge_client.app import (
    BUILT_IN_APPS,
    ENTRY_POINT_GROUP,
    App,
    AppIdentity,
    app_identity,
    app_package,
    files_digest,
    load_app,
)

__all__ = ["KitError", "KitApp", "AppWheel", "read_app_wheel", "kit_apps", "BUILD_WHEEL"]

BUILD_WHEEL = "pip wheel --no-deps -w dist APP_DIR"
# NAME-VERSION[-BUILD]-PYTHON-ABI-PLATFORM.whl, in plain words: kit.env and install.sh need no quoting
_WHEEL_FILE = re.compile(r"^[A-Za-z0-9_.]+-[A-Za-z0-9_.!+]+(-[0-9][A-Za-z0-9_.]*)?(-[A-Za-z0-9_.]+){3}\.whl$")
_APP_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
_VERSION = re.compile(r"^[A-Za-z0-9_.+!-]+$")


class KitError(ProvisionError):
    """A kit cannot be written; the message says what to fix (coordinator.ops.flash_kit raises it too)."""


@dataclass(frozen=True)
class AppWheel:
    """One ``--app`` wheel, read: its file, its SHA-256, its distribution, and the apps it registers."""

    path: Path
    sha256: str
    distribution: str               # "name version", from its METADATA
    entries: dict[str, str]         # app name (the fedge.apps entry point's) -> import path
    python_files: dict[str, bytes]  # the wheel's .py files, by their path in it


@dataclass(frozen=True)
class KitApp:
    """An app a kit installs: its name (what ``fedge-client run --app`` takes), the app as this machine
    loads it, its identity, and the wheel that holds it."""

    name: str
    app: App
    identity: AppIdentity
    wheel: AppWheel


def read_app_wheel(path: Path) -> AppWheel:
    """``path`` read as an app wheel; KitError with one line saying what is wrong otherwise."""
    path = Path(path)
    if not path.is_file():
        raise KitError(f"--app {path}: no such file; build the app's wheel with {BUILD_WHEEL}")
    if not _WHEEL_FILE.match(path.name):
        raise KitError(f"--app {path.name} is not a wheel file (NAME-VERSION-py3-none-any.whl); build one with "
                       f"{BUILD_WHEEL}")
    try:
        with zipfile.ZipFile(path) as whl:
            names = whl.namelist()
            info = sorted({n.split("/")[0] for n in names if n.count("/") == 1 and n.endswith(".dist-info/METADATA")})
            if len(info) == 1:
                meta = importlib.metadata.PathDistribution(zipfile.Path(whl, at=f"{info[0]}/"))
                distribution = f"{meta.metadata['Name']} {meta.version}"
                entries = {e.name: e.value for e in meta.entry_points.select(group=ENTRY_POINT_GROUP)}
                python = {n: whl.read(n) for n in names if n.endswith(".py") and "__pycache__" not in n}
    except (zipfile.BadZipFile, OSError, ValueError, KeyError) as exc:
        raise KitError(f"--app {path.name} is not a readable wheel ({exc}); build it again with "
                       f"{BUILD_WHEEL}") from None
    if len(info) != 1:
        raise KitError(f"--app {path.name} holds {len(info) or 'no'} .dist-info/METADATA, not one: not a wheel pip "
                       f"can install; build it with {BUILD_WHEEL}")
    if not entries:
        raise KitError(f"--app {path.name} ({distribution}) registers no app: its metadata has no entry point in the "
                       f"{ENTRY_POINT_GROUP} group; add [project.entry-points.\"{ENTRY_POINT_GROUP}\"] NAME = "
                       "\"package.module:app\" to the app's pyproject.toml and build the wheel again")
    for name in entries:
        if not _APP_NAME.match(name) or name in BUILT_IN_APPS:
            raise KitError(f"--app {path.name} registers an app named {name!r}: app names are letters, digits, '_' "
                           f"and '-', other than fedge's own {', '.join(BUILT_IN_APPS)}")
    return AppWheel(path, hashlib.sha256(path.read_bytes()).hexdigest(), distribution, entries, python)


def kit_apps(paths: tuple[Path, ...]) -> tuple[KitApp, ...]:
    """Every app the wheels at ``paths`` register, each loaded from this machine and checked to be the
    wheel's; KitError with one line naming the wheel and what to do otherwise."""
    wheels = [read_app_wheel(p) for p in paths]
    seen: dict[str, str] = {}
    for wheel in wheels:
        for key in [wheel.distribution.split()[0].lower(), *(f"app {n}" for n in wheel.entries)]:
            if key in seen:
                raise KitError(f"--app {wheel.path.name} and --app {seen[key]} both hold {key}; give each once")
            seen[key] = wheel.path.name
    return tuple(_kit_app(wheel, name, path) for wheel in wheels for name, path in wheel.entries.items())


def _kit_app(wheel: AppWheel, name: str, path: str) -> KitApp:
    here = f"--app {wheel.path.name}: app {name} ({path})"
    try:
        app = load_app(path)
        identity = app_identity(app)
    except Exception as exc:   # noqa: BLE001 -- the app's own import may raise anything: one line, not a traceback
        raise KitError(f"{here} does not load on this machine, which must hold it as the coordinator runs it and "
                       f"the kit sizes the devices' memory with it (pip install {wheel.path}): {exc}") from None
    if app.name != name:
        raise KitError(f"{here} calls itself {app.name!r}: devices find an app by its own name, so register it as "
                       f"{app.name} = \"{path}\"")
    if not _VERSION.match(app.version):
        raise KitError(f"{here}: its version {app.version!r} is not in plain words (letters, digits, '.', '+', '-', "
                       "'_', '!'), which a kit writes into install.sh's files; give it a version such as 1.0.2")
    package = app_package(app)
    inside = _package_files(wheel, package)
    digest = files_digest(inside) if inside else identity.digest   # an app declared outside its wheel: not compared
    if digest != identity.digest:
        raise KitError(f"{here}: the files of {package} installed here (digest {identity.digest[:12]}) are not the "
                       f"wheel's (digest {digest[:12]}), and devices with the wheel's would refuse this "
                       f"coordinator's tasks; install the wheel here (pip install --force-reinstall {wheel.path}) or "
                       "build it from the app as installed")
    if inside and identity.weights and not Path(app.weights).is_absolute():
        _check_weights(wheel, f"{package}/{PurePosixPath(app.weights).as_posix()}", identity.weights, here)
    return KitApp(name, app, identity, wheel)


def _check_weights(wheel: AppWheel, member: str, wanted: str, here: str) -> None:
    """The app's starting weights (App.weights, package data) are in the wheel, the file installed here."""
    try:
        with zipfile.ZipFile(wheel.path) as whl:
            found = hashlib.sha256(whl.read(member)).hexdigest()
    except KeyError:
        raise KitError(f"{here}: its weights file is not in the wheel (as {member}); ship it as package data (e.g. "
                       "[tool.setuptools.package-data] in its pyproject.toml) and build the wheel again: devices "
                       "without it cannot load the app") from None
    if found != wanted:
        raise KitError(f"{here}: the wheel's weights file {member} has sha256 {found[:12]}, the one installed here "
                       f"{wanted[:12]}, and devices with the wheel's would refuse this coordinator's tasks; install "
                       f"the wheel here (pip install --force-reinstall {wheel.path}) or build it from the app as "
                       "installed")


def _package_files(wheel: AppWheel, package: str) -> list[tuple[str, bytes]]:
    """The wheel's Python files of ``package`` as the app's digest takes them (edge_client.app.files_digest):
    relative to the package's directory, or the module's file alone; empty when the wheel does not hold it."""
    if f"{package}.py" in wheel.python_files:
        return [(f"{package}.py", wheel.python_files[f"{package}.py"])]
    return [(n[len(package) + 1:], data) for n, data in wheel.python_files.items() if n.startswith(f"{package}/")]
