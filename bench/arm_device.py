"""A Raspberry Pi in the loop: an emulated aarch64 device installs fedge with the flash kit, trains in
federated runs beside x86 devices, and serves the exported ONNX model.

    sudo .venv/bin/python bench/arm_device.py                  # everything; resumable
    sudo .venv/bin/python bench/arm_device.py --stage install  # only build the root and run the kit

Needs root, ``apt-get install -y qemu-user-static debootstrap mosquitto`` and the package index
(the aarch64 wheels: torch alone is 2.7 GB with its CUDA packages). The kit's default, PyTorch's
CPU-only index, is out of this machine's reach, so the kit here takes torch from the package index. The arm64 root, the
deployment and the device data are cached in ``--cache`` (default /var/cache/fedge-arm64), so a
second run reuses them; ``--rebuild`` starts from scratch. Emulation runs aarch64 code tens of
times slower than this machine: every time from the emulated device is labelled emulated, and
none is a Pi's. Results: bench/results/arm_device.json (each stage's part is written as it ends).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT_DIR = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT_DIR))

from arm.fleet_files import ARM_DEVICE, ensure_data, ensure_deployment  # noqa: E402
from arm.install import install_infer, run_kit  # noqa: E402
from arm.rootfs import (DEFAULT_CACHE, DEFAULT_CPU, ArmError, chroot_cmd, ensure_binfmt, ensure_rootfs,  # noqa: E402
                        mounted)
from coordinator.ops.flash_kit import KitOptions, write_kits  # noqa: E402

STAGES = ("install", "runs", "serve")
RESULTS = ROOT_DIR / "bench" / "results" / "arm_device.json"


def build_wheel(dist: Path) -> Path:
    """fedge's wheel from this checkout, as a fleet owner builds it for the kit."""
    if dist.exists():
        shutil.rmtree(dist)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(dist), str(ROOT_DIR)], check=True, stdin=subprocess.DEVNULL)
    wheels = sorted(dist.glob("fedge-*.whl"))
    if len(wheels) != 1:
        raise ArmError(f"building fedge's wheel left {len(wheels)} wheels in {dist}")
    return wheels[0]


def save(results: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(path)


def stage_install(cache: Path, root: Path, wheel: Path, port: int, nice: int, log: Path) -> dict:
    """Run the flash kit in the arm64 root (the first time: the real install), then again (idempotence)."""
    deploy = ensure_deployment(cache / "deploy", port)
    data = ensure_data(cache / "data")
    # torch from the package index: PyTorch's CPU index, the kit's default, is out of this machine's reach
    options = KitOptions(target="pi", wheel=wheel, low_memory=True, data=data[ARM_DEVICE], torch_index="")
    kits = write_kits(deploy, options, [ARM_DEVICE])
    first_time = not (root / "opt/fedge/.venv/bin/fedge-client").exists()
    print(f"flash kit for {ARM_DEVICE} in the arm64 root ({'first install' if first_time else 'already installed'})")
    runs = []
    for attempt in range(2 if first_time else 1):
        if attempt:
            write_kits(deploy, options, [ARM_DEVICE])
        got = run_kit(root, kits[ARM_DEVICE], log, nice)
        print(f"  kit run {attempt + 1}: {got['wall_s']} s wall, {got['cpu_s']} s CPU (emulated); {got['summary']}")
        runs.append(got)
    print("  infer venv (numpy, onnxruntime, psutil; no torch)")
    infer = install_infer(root, wheel, log, nice)
    first = cache / "first_install.json"   # the install from scratch, kept while the root is reused
    if first_time:
        first.write_text(json.dumps({"kit": runs[0], "infer_venv": infer}, indent=2) + "\n")
    return {"first_install": json.loads(first.read_text()) if first.exists() else None,
            "this_time": {"kit_runs": runs, "infer_venv": infer},
            "unit_check": verify_unit(root), "torch_index": torch_index_note()}


def verify_unit(root: Path) -> dict:
    """What the root's own ``systemd-analyze verify`` (aarch64, as on Pi OS) says of the installed unit."""
    if not (root / "usr/bin/systemd-analyze").exists():
        return {"checked": False, "why": "systemd is not installed in the root"}
    done = subprocess.run(chroot_cmd(root, ["systemd-analyze", "verify", "/etc/systemd/system/fedge-client.service"]),
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    enabled = (root / "etc/systemd/system/multi-user.target.wants/fedge-client.service").is_symlink()
    return {"checked": True, "ok": done.returncode == 0, "output": (done.stdout + done.stderr).strip()[-2000:],
            "enabled": enabled}


def torch_index_note() -> str:
    return ("torch==2.13.0 for linux aarch64 from the package index is a CUDA build: 427 MB for torch plus "
            "cuda-toolkit, cuDNN, NCCL, NVSHMEM, cuSPARSELt and triton, 29 wheels and 2.7 GB in all "
            "(pip download, manylinux aarch64 tags, Python 3.11); none of the CUDA packages is used on a Pi")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=("all", *STAGES), default="all", help="run one stage (default all)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"cache directory (default {DEFAULT_CACHE})")
    parser.add_argument("--rebuild", action="store_true", help="remove the cached root and deployment first")
    parser.add_argument("--port", type=int, default=18883, help="the TLS broker's port on 127.0.0.1 (default 18883)")
    parser.add_argument("--nice", type=int, default=0, help="run the emulated installs at this nice level")
    parser.add_argument("--cpu", default=DEFAULT_CPU,
                        help=f"the CPU qemu emulates (default {DEFAULT_CPU}, a Pi 4's core; cortex-a76 for a Pi 5). "
                             "qemu's own default, max, makes torch compute wrong results (bench/arm/rootfs.py)")
    parser.add_argument("--results", type=Path, default=RESULTS, help=f"results JSON (default {RESULTS})")
    args = parser.parse_args(argv)
    os.environ["FEDGE_ARM_CPU"] = args.cpu   # read by every command run in the root
    cache = args.cache.resolve()
    root = cache / "root"
    log = cache / "arm_device.log"
    try:
        ensure_binfmt()
        if args.rebuild and cache.exists():
            shutil.rmtree(cache)
        cache.mkdir(parents=True, exist_ok=True)
        print(f"arm64 root {root}")
        built = ensure_rootfs(root, log)
        results = json.loads(args.results.read_text()) if args.results.exists() else {}
        results.update({"host": {"machine": platform.machine(), "cores": os.cpu_count()},
                        "emulation": f"qemu-user (qemu-aarch64-static, binfmt_misc), CPU {args.cpu}, Debian "
                                     "bookworm arm64"})
        if built:
            results["rootfs_build_s"] = {k: round(v, 1) for k, v in built.items()}
        wheel = build_wheel(cache / "dist")
        with mounted(root):
            for stage in STAGES if args.stage == "all" else (args.stage,):
                t = time.monotonic()
                if stage == "install":
                    results["install"] = stage_install(cache, root, wheel, args.port, args.nice, log)
                else:
                    from arm import stages
                    results[stage] = getattr(stages, stage)(cache, root, args.port, log)
                print(f"stage {stage} done in {time.monotonic() - t:.0f} s")
                save(results, args.results)
    except ArmError as exc:
        print(f"arm_device: {exc}", file=sys.stderr)
        return 1
    print(f"results: {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
