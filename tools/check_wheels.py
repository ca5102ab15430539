#!/usr/bin/env python3
"""Will fedge's device side install on 64-bit ARM, and what does 32-bit Raspberry Pi OS lack?

A device installs fedge with the ``client`` extra (to train) or the ``infer`` extra (to
serve an ONNX model) from wheels: a Raspberry Pi or Jetson has neither the time nor,
usually, the compilers to build torch, onnxruntime or numpy from source. Whether a device
image can train or serve is therefore a question of which wheels the package index has
for its CPU, its glibc and its Python. This script asks pip itself, from any machine,
without installing anything:

* the requirements come from ``pyproject.toml`` (the extras and the base dependencies
  they pull in), with torch replaced by the version the Makefile pins, because that
  is what a device is told to install;
* each package is fetched on its own with ``pip download --no-deps --only-binary=:all:``
  and the target's platform tags, Python version and ABI, so one missing wheel never
  hides the others and pip's own wheel selection (tags, Requires-Python, yanked files)
  decides;
* the dependencies of every wheel found are read from the wheel's own metadata and
  followed, evaluating their environment markers for the *target* (pip evaluates
  markers for the machine it runs on, so a resolve with dependencies on an x86-64
  laptop would follow x86-64-only branches and miss aarch64-only ones);
* each downloaded wheel is deleted as soon as its metadata is read.

It needs the package index, so it is a script to run by hand (``make check-wheels``),
not a test. Exit status: 0 when the check ran (whatever it found), 2 for bad arguments
or a missing pip, 3 when the package index could not be reached.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser under its old name
    import tomli as tomllib  # type: ignore[no-redef]

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
except ModuleNotFoundError:  # every pip carries the same library
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.specifiers import SpecifierSet  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "fedge"
DEFAULT_EXTRAS = ("client", "infer")
# What each verdict needs installed, with every dependency of these: training runs
# torch on arrays fedge reads with NumPy; serving runs ONNX Runtime on NumPy arrays.
TRAIN_NEEDS = ("torch", "numpy")
SERVE_NEEDS = ("onnxruntime", "numpy")
# pip's output when it retried and gave up on the network rather than on the platform.
_UNREACHABLE = ("Retrying (Retry(", "NewConnectionError", "Network is unreachable",
                "Temporary failure in name resolution", "Max retries exceeded")


# --------------------------------------------------------------------------- targets


def manylinux_platforms(machine: str, glibc_minor: int) -> tuple[str, ...]:
    """Platform tags a device with glibc 2.<glibc_minor> accepts, best first.

    pip only expands the legacy ``manylinux2014``/``2010`` aliases by itself, so a
    ``--platform manylinux_2_35_aarch64`` alone would reject a ``manylinux_2_28`` wheel
    that the device installs happily: every glibc down to 2.17 is listed explicitly,
    then the legacy alias, then the plain ``linux_<machine>`` tag a device's own pip
    also accepts (it is what piwheels publishes).
    """
    tags = [f"manylinux_2_{minor}_{machine}" for minor in range(glibc_minor, 16, -1)]
    tags += [f"manylinux2014_{machine}", f"linux_{machine}"]
    return tuple(tags)


@dataclass(frozen=True)
class Target:
    """One device image: CPU, C library and Python, as pip's platform options see them."""

    name: str
    description: str
    python: str  # "3.11"
    machine: str  # platform_machine on the device: "aarch64", "armv7l"
    platforms: tuple[str, ...]

    @property
    def abi(self) -> str:
        return "cp" + self.python.replace(".", "")

    def marker_environment(self, extra: str = "") -> dict[str, str]:
        """The values PEP 508 markers see on the device (not on this machine)."""
        return {
            "implementation_name": "cpython",
            "implementation_version": f"{self.python}.0",
            "os_name": "posix",
            "platform_machine": self.machine,
            "platform_python_implementation": "CPython",
            "platform_release": "",
            "platform_system": "Linux",
            "platform_version": "",
            "python_full_version": f"{self.python}.0",
            "python_version": self.python,
            "sys_platform": "linux",
            "extra": extra,
        }


_ARM64 = ("64-bit ARM: Raspberry Pi OS 64-bit (bookworm, glibc 2.36) and Jetson L4T 36 / "
          "JetPack 6 (Ubuntu 22.04, glibc 2.35); tags up to glibc 2.35 so a wheel found fits both")
TARGETS: tuple[Target, ...] = (
    Target("aarch64-py3.10", _ARM64 + "; Python 3.10 is JetPack 6's own", "3.10", "aarch64",
           manylinux_platforms("aarch64", 35)),
    Target("aarch64-py3.11", _ARM64 + "; Python 3.11 is Raspberry Pi OS bookworm's own", "3.11",
           "aarch64", manylinux_platforms("aarch64", 35)),
    Target("aarch64-py3.12", _ARM64 + "; Python 3.12", "3.12", "aarch64",
           manylinux_platforms("aarch64", 35)),
    Target("armv7l-py3.11", "32-bit Raspberry Pi OS (bookworm, armv7l, glibc 2.36); Python 3.11",
           "3.11", "armv7l", manylinux_platforms("armv7l", 36)),
)
TARGETS_BY_NAME = {t.name: t for t in TARGETS}


# ---------------------------------------------------------------------- requirements


@dataclass
class RootRequirement:
    """A requirement fedge states itself, and which of its extras state it."""

    requirement: Requirement
    extras: list[str] = field(default_factory=list)


def read_extras(pyproject: Path, extras: Sequence[str]) -> list[RootRequirement]:
    """The requirements a device gets from ``pip install 'fedge[<extras>]'``.

    The base ``dependencies`` always come along; an extra that names ``fedge[other]``
    brings the other extra's requirements, as pip would. A package named by several
    extras appears once, with their specifiers combined.
    """
    project = tomllib.loads(Path(pyproject).read_text(encoding="utf-8"))["project"]
    optional = project.get("optional-dependencies", {})
    own_name = canonicalize_name(project.get("name", PROJECT))
    merged: dict[str, RootRequirement] = {}

    def add(text: str, label: str, seen: set[str]) -> None:
        req = Requirement(text)
        if canonicalize_name(req.name) == own_name:
            for sub in sorted(req.extras):
                expand(sub, label, seen)
            return
        key = canonicalize_name(req.name)
        if key in merged:
            root = merged[key]
            combined = Requirement(str(root.requirement))
            combined.specifier = root.requirement.specifier & req.specifier
            combined.extras = root.requirement.extras | req.extras
            root.requirement = combined
            if label not in root.extras:
                root.extras.append(label)
        else:
            merged[key] = RootRequirement(req, [label])

    def expand(extra: str, label: str, seen: set[str]) -> None:
        if extra in seen:
            return
        if extra not in optional:
            raise KeyError(f"pyproject.toml has no extra {extra!r} (it has: {', '.join(optional)})")
        seen.add(extra)
        for text in optional[extra]:
            add(text, label, seen)

    for extra in extras:
        seen: set[str] = set()
        for text in project.get("dependencies", []):
            add(text, "base", seen)
        expand(extra, extra, seen)
    return list(merged.values())


def read_torch_pin(makefile: Path) -> str | None:
    """The torch version the Makefile installs (``TORCH_VERSION ?= X``), if it sets one.

    fedge asks only for ``torch>=2.1``; devices are told to install the pinned version,
    so that is the one whose wheels matter.
    """
    try:
        text = Path(makefile).read_text(encoding="utf-8")
    except OSError:
        return None
    match = re.search(r"^TORCH_VERSION\s*[?:]?=\s*(\S+)", text, re.MULTILINE)
    return match.group(1) if match else None


def pin_torch(roots: list[RootRequirement], version: str | None) -> list[RootRequirement]:
    """Replace torch's range by ``==version`` (keeping its marker), as the installer does."""
    if not version:
        return roots
    out = []
    for root in roots:
        if canonicalize_name(root.requirement.name) == "torch":
            pinned = Requirement(str(root.requirement))
            if not root.requirement.specifier.contains(version, prereleases=True):
                print(f"warning: torch=={version} is outside pyproject's {root.requirement}",
                      file=sys.stderr)
            pinned.specifier = SpecifierSet(f"=={version}")
            root = RootRequirement(pinned, list(root.extras))
        out.append(root)
    return out


# ------------------------------------------------------------------------------- pip


def pip_download_command(
    python: str,
    requirement: str,
    target: Target,
    dest: Path,
    extra_index_urls: Sequence[str] = (),
) -> list[str]:
    """The pip command that fetches the one wheel a device would install for ``requirement``.

    ``--no-deps`` keeps it to one package (dependencies are followed by this script, with
    the target's markers); ``--only-binary=:all:`` because a device should not build from
    source; ``--no-cache-dir`` so checking four platforms does not leave gigabytes of
    wheels in the user's cache.
    """
    cmd = [
        python, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
        "--dest", str(dest),
        "--python-version", target.python,
        "--implementation", "cp",
        "--abi", target.abi,
    ]
    for platform in target.platforms:
        cmd += ["--platform", platform]
    for url in extra_index_urls:
        cmd += ["--extra-index-url", url]
    cmd.append(requirement)
    return cmd


@dataclass
class WheelInfo:
    """What a found wheel says about itself."""

    filename: str
    name: str
    version: str
    size: int
    requires_dist: list[str]


@dataclass
class Missing:
    """No wheel: pip's one-line reason."""

    reason: str


FetchResult = WheelInfo | Missing


def read_wheel(path: Path) -> WheelInfo:
    """Name, version and dependencies from a wheel's METADATA (the same file pip reads)."""
    with zipfile.ZipFile(path) as zf:
        meta_name = next(n for n in zf.namelist()
                         if n.count("/") == 1 and n.split("/")[0].endswith(".dist-info")
                         and n.endswith("/METADATA"))
        message = email.parser.Parser().parsestr(zf.read(meta_name).decode("utf-8", "replace"))
    return WheelInfo(
        filename=path.name,
        name=message["Name"],
        version=message["Version"],
        size=path.stat().st_size,
        requires_dist=list(message.get_all("Requires-Dist") or []),
    )


def pip_environment() -> dict[str, str]:
    """This process's environment with pip's constraint files switched off.

    A constraint file configured on this machine (``PIP_CONSTRAINT`` or pip's config
    files) says nothing about what a device can install, and pip reports a package
    that has no wheel under a constraint as a confusing "conflicting dependencies".
    The indexes and find-links configured here still apply.
    """
    env = dict(os.environ)
    env["PIP_CONSTRAINT"] = os.devnull
    return env


def pip_reason(output: str) -> str:
    """pip's first error line, without its ``ERROR:`` prefix, or its last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln[len("ERROR:"):].strip() for ln in lines if ln.startswith("ERROR:")]
    reason = errors[0] if errors else (lines[-1] if lines else "pip failed without output")
    if any(marker in output for marker in _UNREACHABLE):
        reason = "package index unreachable: " + reason
    return reason


def make_pip_fetcher(
    python: str,
    target: Target,
    workdir: Path,
    extra_index_urls: Sequence[str] = (),
    timeout: float = 1800.0,
) -> Callable[[str], FetchResult]:
    """A fetch function for :func:`resolve` that runs pip and deletes each wheel after reading it."""
    counter = 0

    def fetch(requirement: str) -> FetchResult:
        nonlocal counter
        counter += 1
        dest = workdir / f"{target.name}-{counter}"
        dest.mkdir(parents=True)
        try:
            cmd = pip_download_command(python, requirement, target, dest, extra_index_urls)
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                      stdin=subprocess.DEVNULL, env=pip_environment())
            except subprocess.TimeoutExpired:
                return Missing(f"pip did not finish within {timeout:.0f} s")
            wheels = sorted(dest.glob("*.whl"))
            if proc.returncode != 0 or not wheels:
                return Missing(pip_reason(proc.stdout + "\n" + proc.stderr))
            return read_wheel(wheels[0])
        finally:
            shutil.rmtree(dest, ignore_errors=True)

    return fetch


# ------------------------------------------------------------------------- resolving


@dataclass
class Package:
    """One package a target needs: what it was asked for and what the index had."""

    name: str
    specifier: SpecifierSet = field(default_factory=SpecifierSet)
    extras: set[str] = field(default_factory=set)
    required_by: list[str] = field(default_factory=list)
    wheel: WheelInfo | None = None
    reason: str | None = None
    depends_on: set[str] = field(default_factory=set)
    _expanded: set[str] = field(default_factory=set)
    _fetched: bool = False

    @property
    def key(self) -> str:
        return canonicalize_name(self.name)

    def requirement_text(self) -> str:
        return f"{self.name}{self.specifier}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.wheel.name if self.wheel else self.name,
            "requirement": self.requirement_text(),
            "version": self.wheel.version if self.wheel else None,
            "wheel": self.wheel.filename if self.wheel else None,
            "size_bytes": self.wheel.size if self.wheel else None,
            "missing": self.wheel is None,
            "reason": self.reason,
            "required_by": list(self.required_by),
            "depends_on": sorted(self.depends_on),
        }


def resolve(
    roots: Iterable[RootRequirement],
    target: Target,
    fetch: Callable[[str], FetchResult],
    progress: Callable[[str], None] | None = None,
) -> dict[str, Package]:
    """Every package ``roots`` need on ``target``, each with its wheel or why there is none.

    A worklist instead of pip's resolver, because pip would evaluate the dependencies'
    markers for this machine: each package is fetched alone and its ``Requires-Dist``
    followed under the target's markers (and the extras asked of it). Specifiers from
    several dependents are combined; a package whose chosen version falls outside a
    later, tighter specifier is fetched again. There is no backtracking: where pip
    would try older versions of a dependent to escape a conflict, this reports the
    conflict as a missing wheel, which is the honest answer for a device anyway.
    """
    packages: dict[str, Package] = {}
    queue: deque[str] = deque()

    def want(req: Requirement, by: str, extra_contexts: Iterable[str] = ("",)) -> str | None:
        if req.marker is not None and not any(
            req.marker.evaluate(target.marker_environment(e)) for e in extra_contexts
        ):
            return None
        key = canonicalize_name(req.name)
        pkg = packages.get(key)
        if pkg is None:
            pkg = packages[key] = Package(name=req.name)
        before = (str(pkg.specifier), frozenset(pkg.extras))
        pkg.specifier = pkg.specifier & req.specifier
        pkg.extras |= set(req.extras)
        if by not in pkg.required_by:
            pkg.required_by.append(by)
        stale = pkg.wheel is not None and not pkg.specifier.contains(pkg.wheel.version,
                                                                      prereleases=True)
        if stale:
            pkg._fetched = False
        if not pkg._fetched or (str(pkg.specifier), frozenset(pkg.extras)) != before:
            if key not in queue:
                queue.append(key)
        return key

    for root in roots:
        want(root.requirement, ", ".join(root.extras))

    while queue:
        pkg = packages[queue.popleft()]
        if not pkg._fetched:
            pkg._fetched = True
            result = fetch(pkg.requirement_text())
            if isinstance(result, WheelInfo):
                pkg.wheel, pkg.reason = result, None
                pkg._expanded = set()
                if progress:
                    progress(f"{target.name}: {pkg.requirement_text()} -> {result.filename}")
            else:
                pkg.wheel, pkg.reason = None, result.reason
                if progress:
                    progress(f"{target.name}: {pkg.requirement_text()} -> MISSING ({result.reason})")
        if pkg.wheel is None:
            continue
        contexts = {""} | pkg.extras
        if contexts <= pkg._expanded:
            continue
        pkg._expanded |= contexts
        for text in pkg.wheel.requires_dist:
            key = want(Requirement(text), pkg.wheel.name, sorted(contexts))
            if key is not None:
                pkg.depends_on.add(key)
    return packages


# ------------------------------------------------------------------------ summarizing


def closure(packages: dict[str, Package], names: Iterable[str]) -> set[str]:
    """``names`` and everything they depend on, as far as the found wheels say."""
    seen: set[str] = set()
    stack = [canonicalize_name(n) for n in names]
    while stack:
        key = stack.pop()
        if key in seen:
            continue
        seen.add(key)
        pkg = packages.get(key)
        if pkg is not None:
            stack.extend(pkg.depends_on)
    return seen


def _verdict(packages: dict[str, Package], needs: Sequence[str]) -> dict[str, Any]:
    keys = closure(packages, needs)
    blockers = sorted(k for k in keys if k not in packages or packages[k].wheel is None)
    found = [packages[k] for k in keys if k in packages and packages[k].wheel is not None]
    return {
        "ok": not blockers,
        "needs": list(needs),
        "missing": blockers,
        "wheels": len(found),
        "bytes": sum(p.wheel.size for p in found if p.wheel),
    }


def summarize(packages: dict[str, Package]) -> dict[str, Any]:
    """The two questions a device image raises: can it train, can it serve ONNX?

    Training needs torch and NumPy with every dependency they have on that platform;
    serving needs ONNX Runtime and NumPy likewise. Anything else without a wheel is
    listed too (a missing codec compressor, say, costs a feature, not the device).
    """
    train = _verdict(packages, TRAIN_NEEDS)
    serve = _verdict(packages, SERVE_NEEDS)
    return {
        "can_train": train["ok"],
        "can_serve_onnx": serve["ok"],
        "train": train,
        "serve": serve,
        "missing": sorted(k for k, p in packages.items() if p.wheel is None),
    }


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover


def summary_line(target_name: str, summary: dict[str, Any]) -> str:
    """One line per target: the two verdicts, what they cost in wheels, what blocks them."""
    def part(label: str, verdict: dict[str, Any]) -> str:
        needs = " + ".join(verdict["needs"])
        if verdict["ok"]:
            return f"{label}: yes ({needs}: {verdict['wheels']} wheels, {_size(verdict['bytes'])})"
        return f"{label}: no (no wheel for {', '.join(verdict['missing'])})"

    missing = ", ".join(summary["missing"]) or "none"
    return (f"{target_name}: {part('can train', summary['train'])}; "
            f"{part('can serve ONNX', summary['serve'])}; without a wheel: {missing}")


def format_table(target: Target, packages: dict[str, Package], summary: dict[str, Any]) -> str:
    """The plain-text table for one target, sorted by package name."""
    head = [f"== {target.name}: {target.description}",
            f"   pip --python-version {target.python} --abi {target.abi} --platform "
            f"{target.platforms[0]} ... {target.platforms[-1]} ({len(target.platforms)} tags)"]
    rows = [("package", "version", "size", "needed by", "wheel")]
    for key in sorted(packages):
        p = packages[key]
        if p.wheel:
            rows.append((p.wheel.name, p.wheel.version, _size(p.wheel.size),
                         ", ".join(p.required_by), p.wheel.filename))
        else:
            rows.append((p.name, "-", "-", ", ".join(p.required_by), f"MISSING: {p.reason}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
    return "\n".join(head + [ln.rstrip() for ln in lines] + [summary_line(target.name, summary)])


# ------------------------------------------------------------------------------- main


def pip_version(python: str) -> str | None:
    """The pip that will do the work, or None when that interpreter has none."""
    try:
        proc = subprocess.run([python, "-m", "pip", "--version"], capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.split(" from ")[0].strip() if proc.returncode == 0 else None


def build_parser() -> argparse.ArgumentParser:
    """Command-line options (kept apart so ``--help`` can be tested without the network)."""
    targets = "\n".join(f"  {t.name:16} {t.description}" for t in TARGETS)
    parser = argparse.ArgumentParser(
        prog="check_wheels.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Check that the package index has wheels for fedge's device side (the `client`\n"
            "extra to train, the `infer` extra to serve ONNX) on 64-bit and 32-bit ARM\n"
            "images, using pip's own wheel selection. Downloads each wheel once into a\n"
            "temporary directory to read its dependencies, then deletes it; installs nothing."
        ),
        epilog=(
            f"targets (default: all):\n{targets}\n\n"
            "Prints one table per target (package, version, size, who needs it, the wheel\n"
            "or MISSING with pip's reason) and a summary line: can train (torch + numpy and\n"
            "their dependencies), can serve ONNX (onnxruntime + numpy and theirs).\n"
            "32-bit Raspberry Pi OS usually installs from piwheels: pass its index with\n"
            "--extra-index-url to check that setup. Exit status: 0 when the check ran,\n"
            "2 for bad arguments or no pip, 3 when the package index was unreachable."
        ),
    )
    parser.add_argument("--target", action="append", choices=sorted(TARGETS_BY_NAME),
                        metavar="NAME", help="check only this target (repeatable)")
    parser.add_argument("--extras", default=",".join(DEFAULT_EXTRAS),
                        help="comma-separated extras of pyproject.toml to check (default: %(default)s)")
    parser.add_argument("--torch-version", default=None,
                        help="torch version to require (default: TORCH_VERSION from the Makefile)")
    parser.add_argument("--extra-index-url", action="append", default=[], metavar="URL",
                        help="passed to pip as is (repeatable); by default only the configured index is used")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter whose pip does the work (default: this one)")
    parser.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml", help=argparse.SUPPRESS)
    parser.add_argument("--makefile", type=Path, default=ROOT / "Makefile", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds one pip download may take (default: %(default)s)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check for the chosen targets, print the tables, optionally write JSON."""
    args = build_parser().parse_args(argv)
    version = pip_version(args.python)
    if version is None:
        print(f"error: {args.python} has no working pip; use --python .venv/bin/python "
              "(or `make check-wheels`, which does)", file=sys.stderr)
        return 2
    extras = [e.strip() for e in args.extras.split(",") if e.strip()]
    try:
        roots = read_extras(args.pyproject, extras)
    except KeyError as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 2
    torch_version = args.torch_version or read_torch_pin(args.makefile)
    roots = pin_torch(roots, torch_version)
    targets = [TARGETS_BY_NAME[n] for n in args.target] if args.target else list(TARGETS)
    progress = None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))

    results = []
    unreachable = False
    with tempfile.TemporaryDirectory(prefix="fedge-wheels-") as tmp:
        for target in targets:
            fetch = make_pip_fetcher(args.python, target, Path(tmp), args.extra_index_url,
                                     args.timeout)
            packages = resolve(roots, target, fetch, progress)
            summary = summarize(packages)
            print(format_table(target, packages, summary), end="\n\n", flush=True)
            unreachable |= any(p.reason and p.reason.startswith("package index unreachable")
                               for p in packages.values())
            results.append({
                "name": target.name,
                "description": target.description,
                "python": target.python,
                "abi": target.abi,
                "platforms": list(target.platforms),
                "summary": summary,
                "summary_line": summary_line(target.name, summary),
                "packages": [packages[k].as_dict() for k in sorted(packages)],
            })

    if args.json:
        report = {
            "generated": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
            "pip": version,
            "extras": extras,
            "torch_version": torch_version,
            "extra_index_urls": list(args.extra_index_url),
            "requirements": [{"requirement": str(r.requirement), "extras": r.extras} for r in roots],
            "targets": results,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        if progress:
            progress(f"wrote {args.json}")
    if unreachable:
        print("error: the package index could not be reached; the MISSING rows above are not "
              "verdicts", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
