"""A Debian bookworm arm64 root file system (Pi OS 64-bit is bookworm arm64), run under qemu-user.

Built once with debootstrap and kept outside the repository (``/var/cache/fedge-arm64`` by
default): a first build downloads about 100 MB and takes tens of minutes, most of it dpkg's
configuration running under emulation. Everything here needs root.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["ArmError", "ensure_binfmt", "ensure_rootfs", "mounted", "chroot_cmd", "emulated_cpu", "DEFAULT_CACHE"]

DEFAULT_CACHE = Path("/var/cache/fedge-arm64")
BINFMT = Path("/proc/sys/fs/binfmt_misc")
QEMU_CONF = Path("/usr/lib/binfmt.d/qemu-aarch64.conf")
MIRROR = "http://deb.debian.org/debian"
# systemd as on Pi OS (not running: no init here), so the kit's unit is checked and enabled as there
PACKAGES = "python3,python3-venv,python3-pip,ca-certificates,systemd"
READY = ".fedge-rootfs-ready"
# What pip inside the root needs from this machine: its CA bundle and settings (a mirror or proxy).
HOST_FILES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pip.conf", "/etc/resolv.conf")
# The CPU qemu emulates (QEMU_CPU). Its default, "max", offers SVE and SME, and there torch 2.13's
# aarch64 build computes F.linear wrongly (a 16-wide dot product sums 4 of its terms); a real Pi's
# core (Cortex-A72: Pi 4; Cortex-A76: Pi 5) has neither and gives x86's results. bench/arm_device.py
# --cpu sets it; stages.cpu_check records what both give.
DEFAULT_CPU = "cortex-a72"


def emulated_cpu() -> str:
    return os.environ.get("FEDGE_ARM_CPU", DEFAULT_CPU)


class ArmError(RuntimeError):
    """The emulated device cannot be set up; the message says what to install or fix."""


def _run(*cmd: str, log: Path | None = None) -> None:
    out = open(log, "ab") if log else subprocess.DEVNULL
    try:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    finally:
        if log:
            out.close()
    if done.returncode != 0:
        raise ArmError(f"{' '.join(cmd)} failed ({done.returncode})" + (f"; see {log}" if log else ""))


def ensure_binfmt() -> None:
    """Register qemu's aarch64 interpreter with binfmt_misc (needs qemu-user-static), once per boot."""
    if os.geteuid() != 0:
        raise ArmError("the emulated device needs root (binfmt_misc, chroot, mounts)")
    if not QEMU_CONF.exists() or shutil.which("debootstrap") is None:
        raise ArmError("install the emulator and debootstrap: apt-get install -y qemu-user-static debootstrap")
    if not (BINFMT / "register").exists():
        _run("mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT))
    if not (BINFMT / "qemu-aarch64").exists():
        (BINFMT / "register").write_text(QEMU_CONF.read_text().strip())


def ensure_rootfs(root: Path, log: Path, echo=print) -> dict[str, float]:
    """Build ``root`` unless a complete one is there; the seconds each stage took (empty when reused)."""
    if (root / READY).exists():
        return {}
    root.parent.mkdir(parents=True, exist_ok=True)
    timings = {}
    if not (root / "debootstrap").exists() and not (root / "usr/bin/python3").exists():
        echo(f"  debootstrap arm64 bookworm into {root} (first stage: download and unpack)")
        t = time.monotonic()
        _run("debootstrap", "--arch=arm64", "--foreign", "--variant=minbase", f"--include={PACKAGES}",
             "bookworm", str(root), MIRROR, log=log)
        timings["debootstrap_first_stage_s"] = time.monotonic() - t
    if (root / "debootstrap").exists():
        echo("  debootstrap second stage under emulation (tens of minutes)")
        t = time.monotonic()
        _run("chroot", str(root), "/debootstrap/debootstrap", "--second-stage", log=log)
        timings["debootstrap_second_stage_s"] = time.monotonic() - t
    _run("chroot", str(root), "dpkg", "--configure", "-a", log=log)
    if not (root / "usr/bin/systemctl").exists():   # a root built before systemd was in PACKAGES
        _run("env", "DEBIAN_FRONTEND=noninteractive", "chroot", str(root), "apt-get", "install", "-y", "-q",
             "--no-install-recommends", "systemd", log=log)
    (root / READY).write_text("ok\n")
    return timings


@contextlib.contextmanager
def mounted(root: Path) -> Iterator[Path]:
    """/proc and /dev inside ``root`` (pip and python need them), and this machine's CA bundle, pip settings
    and resolver, for as long as the block runs.

    Not /sys: this x86 machine's sysfs has no ``cpu0/regs/identification/midr_el1``, and torch's oneDNN
    (xbyak_aarch64) crashes the process with SIGSEGV when /sys is there without it; with no /sys at all
    it falls back, and cpuinfo only prints that it cannot list the processors."""
    for host in HOST_FILES:
        if Path(host).exists():
            target = root / host.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(host, target)
    mounts = []
    try:
        for kind, source, target in (("proc", "proc", "proc"), ("bind", "/dev", "dev"), ("bind", "/dev/pts", "dev/pts")):
            path = root / target
            path.mkdir(exist_ok=True)
            if os.path.ismount(path):
                continue
            args = ["mount", "--bind", source, str(path)] if kind == "bind" else ["mount", "-t", kind, source,
                                                                                  str(path)]
            _run(*args)
            mounts.append(path)
        yield root
    finally:
        for path in reversed(mounts):
            subprocess.run(["umount", "-l", str(path)], stdin=subprocess.DEVNULL, capture_output=True)


def chroot_cmd(root: Path, cmd: list[str], *, user: str | None = None, env: dict[str, str] | None = None) -> list[str]:
    """``cmd`` run inside ``root`` (as ``user``: "UID:GID") on the emulated CPU, with exactly ``env`` plus a PATH."""
    environment = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
                   "HOME": "/root", "QEMU_CPU": emulated_cpu(), **(env or {})}
    spec = [f"--userspec={user}"] if user else []
    return ["env", "-i", *(f"{k}={v}" for k, v in environment.items()), "chroot", *spec, str(root), *cmd]
