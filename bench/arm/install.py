"""Install fedge on the emulated aarch64 device the way a fleet owner would: with the flash kit.

The kit (``fedge-coordinator kit --target pi``) is copied to where a Pi's boot partition is
mounted (``/boot/firmware/fedge-kit``) and ``install.sh`` runs as root inside the arm64 root; a
second venv gets the ``infer`` extra alone (no torch), as a device that only serves a model would.
Wall and CPU seconds are both recorded: under emulation, and on a machine that may be busy, CPU
seconds are the steadier figure; neither is a Pi's.
"""

from __future__ import annotations

import re
import resource
import shutil
import subprocess
import time
from pathlib import Path

from arm.rootfs import ArmError, chroot_cmd

__all__ = ["run_kit", "install_infer", "dir_bytes", "timed"]

KIT_IN_ROOT = "/boot/firmware/fedge-kit"
INFER_VENV = "/opt/fedge-infer/.venv"
_STEP = re.compile(r"\[fedge-kit\] step (\w+) done in (\d+) s")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(cmd: list[str], log: Path, nice: int = 0) -> dict[str, object]:
    """Run ``cmd`` (output appended to ``log``); its wall and CPU seconds, exit code and printed lines."""
    wall, cpu = time.monotonic(), _children_cpu()
    with open(log, "ab") as out:
        out.write(("\n$ " + " ".join(cmd) + "\n").encode())
        out.flush()
        before = out.tell()
        done = subprocess.run(["nice", "-n", str(nice), *cmd], stdout=out, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL)
    text = Path(log).read_bytes()[before:].decode(errors="replace")
    return {"wall_s": round(time.monotonic() - wall, 1), "cpu_s": round(_children_cpu() - cpu, 1),
            "returncode": done.returncode, "output": text}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def run_kit(root: Path, kit: Path, log: Path, nice: int = 0) -> dict[str, object]:
    """Copy ``kit`` into the root's boot partition and run its install.sh there; steps, seconds, sizes."""
    target = root / KIT_IN_ROOT.lstrip("/")
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(kit, target)
    got = timed(chroot_cmd(root, ["bash", f"{KIT_IN_ROOT}/install.sh"]), log, nice)
    output = str(got.pop("output"))
    if got["returncode"] != 0:
        tail = " | ".join(output.strip().splitlines()[-4:])
        raise ArmError(f"the flash kit failed on aarch64: {tail} (log {log})")
    got["steps_s"] = {name: int(s) for name, s in _STEP.findall(output)}
    got["summary"] = next((line for line in output.splitlines() if "[fedge-kit] ok:" in line), "")
    got["bundle_left_in_kit"] = (target / "bundle.toml").exists()
    got["venv_bytes"] = dir_bytes(root / "opt/fedge/.venv")
    return got


def install_infer(root: Path, wheel: Path, log: Path, nice: int = 0) -> dict[str, object]:
    """A second venv with fedge's ``infer`` extra only (numpy, onnxruntime, psutil): what serving needs."""
    venv = root / INFER_VENV.lstrip("/")
    inside = f"/tmp/{wheel.name}"
    shutil.copy2(wheel, root / inside.lstrip("/"))
    steps = [["python3", "-m", "venv", INFER_VENV],
             [f"{INFER_VENV}/bin/python", "-m", "pip", "install", "-q", "--disable-pip-version-check",
              f"{inside}[infer]"]]
    wall = cpu = 0.0
    if not (venv / "bin/fedge-profile").exists():
        for cmd in steps:
            got = timed(chroot_cmd(root, cmd), log, nice)
            if got["returncode"] != 0:
                raise ArmError(f"installing the infer extra failed on aarch64 (log {log})")
            wall += float(got["wall_s"])
            cpu += float(got["cpu_s"])
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "venv_bytes": dir_bytes(venv),
            "reused": wall == 0.0}
