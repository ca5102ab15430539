"""The edge lab's absolute speed: the published training time of a known model on a real board
(``lab.calibration.ANCHOR``, ResNet-18 on a Raspberry Pi 5), the same work measured here on one torch
thread, and the ``cpu_scale`` that makes an emulated board as fast as the real one.

A device's CPU share is ``speed x cpu_scale`` of one core, and a CFS quota stretches CPU time by
1/share, so a device does in ``t / share`` what one full core does in ``t``. Measuring ``t`` for the
anchor's work gives the share at which the emulated board matches the real one, hence the calibrated
``cpu_scale``; the fleet's own ``cpu_scale`` is usually smaller (the devices training at once must fit
this machine's cores), and the ratio of the two is how much slower than the real boards the lab runs:
its round deadlines must be stretched by that much to mean what they mean on the boards.

It also times fedge's own work (the lab's ``cnn`` on 28x28 images, batch 32) and projects how long one
task of ``--task-samples`` images takes on each class of the fleet, at the fleet's scale and at the
calibrated one. With ``--verify-quota`` (root, cgroup v1 or v2) the anchor's step also runs in a child
capped at the calibrated Pi 4's share, to check the 1/share stretch; the cgroup is removed after.

The machine may be busy (this is noted in the output with the load average): every figure is the
minimum over ``--repeats`` runs of ``--steps`` steps, one torch thread.

    python bench/lab_calibration.py [--repeats 3] [--steps 3] [--fleet bench/fleets/mixed.toml] [--verify-quota]

Prints the figures and writes ``bench/results/edge_lab_calibration.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench_io import RESULTS, write_result  # noqa: E402
from lab.calibration import (ANCHOR, SPEEDS, calibrated_cpu_scale, derived_speeds, projected_seconds,  # noqa: E402
                             share_for, time_dilation)
from lab.fleet import load_fleet  # noqa: E402

OUT = RESULTS / "edge_lab_calibration.json"


class _Block(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with batch norm, and the shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                                  nn.ReLU(inplace=True), nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(cout))
        self.short = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.short(x))


def resnet18(num_classes: int = 1000) -> nn.Module:
    """ResNet-18 as in torchvision and timm (11.69 M parameters): written out, no extra package needed."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                               nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [_Block(cin, cout, stride), _Block(cout, cout, 1)]
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes))


def _fedge_cnn() -> nn.Module:
    from edge_client.models import build_model
    return build_model({"name": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 28})


def step_seconds(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, repeats: int) -> list[float]:
    """Seconds per training step (forward, backward, SGD update), one value per repeat of ``steps`` steps,
    after one untimed warm-up step."""
    from edge_client.optim import DeviceSGD
    opt = DeviceSGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def one() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    model.train()
    one()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            one()
        out.append((time.perf_counter() - start) / steps)
    return out


def _anchor_inputs(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(batch, *ANCHOR.image, generator=gen), torch.randint(0, 1000, (batch,), generator=gen)


def measure(steps: int, repeats: int) -> dict[str, Any]:
    """Both workloads on one torch thread: the anchor's ResNet-18 step and fedge's cnn step."""
    torch.manual_seed(0)
    x, y = _anchor_inputs(ANCHOR.batch)
    anchor = step_seconds(resnet18(), x, y, steps, repeats)
    gen = torch.Generator().manual_seed(1)
    cx, cy = torch.randn(32, 1, 28, 28, generator=gen), torch.randint(0, 10, (32,), generator=gen)
    cnn = step_seconds(_fedge_cnn(), cx, cy, max(20, steps * 10), repeats)
    return {"anchor_step_s": anchor, "cnn_step_s": cnn}


# -- the optional check of the CFS quota's 1/share stretch, in a child inside a cgroup ----------------------

def _cgroup_dir(name: str) -> tuple[Path, bool]:
    root = Path("/sys/fs/cgroup")
    if (root / "cgroup.controllers").exists():
        return root / name, True
    return root / "cpu" / name, False


def verify_quota(share: float, steps: int) -> dict[str, Any]:
    """Run the anchor's step in a child process capped at ``share`` of a core; its seconds per step.
    The cgroup is made for this child only and removed afterwards, whatever happens."""
    path, v2 = _cgroup_dir(f"fedge-calibration-{os.getpid()}")
    path.mkdir()
    try:
        quota = max(1000, round(share * 100_000))
        if v2:
            (path / "cpu.max").write_text(f"{quota} 100000\n")
        else:
            (path / "cpu.cfs_period_us").write_text("100000\n")
            (path / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        join = 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"'
        done = subprocess.run(["sh", "-c", join, "join", str(path), sys.executable, __file__, "--child",
                               "--steps", str(steps)], capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"the capped child failed: {done.stderr.strip()[-500:]}")
        return {"share": quota / 100_000, "step_s": json.loads(done.stdout.strip().splitlines()[-1])}
    finally:
        for _ in range(50):   # the child has exited; the directory goes once the kernel has let go of it
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _child(steps: int) -> int:
    torch.set_num_threads(1)
    x, y = _anchor_inputs(ANCHOR.batch)
    print(json.dumps(step_seconds(resnet18(), x, y, steps, 1)))
    return 0


# -- the figures ----------------------------------------------------------------------------------------------

def summarize(measured: dict[str, Any], fleet_scale: float, task_samples: int) -> dict[str, Any]:
    """From the measured step times: the calibrated scale, the dilation at the fleet's scale and what one
    task takes per class at both scales."""
    host = min(measured["anchor_step_s"])
    board = ANCHOR.seconds_per_batch
    speed = SPEEDS[ANCHOR.speed_class]
    calibrated = calibrated_cpu_scale(host, board, speed)
    cnn_sample = min(measured["cnn_step_s"]) / 32
    task_host = cnn_sample * task_samples
    per_class = {c: {"speed": s,
                     "share_calibrated": round(s * calibrated, 4), "share_fleet": round(s * fleet_scale, 4),
                     "task_s_calibrated": round(projected_seconds(task_host, s, calibrated), 1),
                     "task_s_fleet": round(projected_seconds(task_host, s, fleet_scale), 1)}
                 for c, s in SPEEDS.items()}
    return {"anchor": {**vars(ANCHOR), "seconds_per_batch": round(board, 3)},
            "host_anchor_step_s": round(host, 4),
            "share_matching_anchor_board": round(share_for(host, board), 4),
            "calibrated_cpu_scale": round(calibrated, 4), "fleet_cpu_scale": fleet_scale,
            "time_dilation": round(time_dilation(calibrated, fleet_scale), 2),
            "pi4_resnet18_step_s_emulated_at_fleet_scale":
                round(projected_seconds(host, SPEEDS["pi4-4gb"], fleet_scale), 2),
            "host_cnn_sample_ms": round(1000 * cnn_sample, 4), "task_samples": task_samples,
            "classes": per_class}


def _machine() -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "torch_threads": 1,
            "python": platform.python_version()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each workload; the minimum counts")
    p.add_argument("--steps", type=int, default=3, help="ResNet-18 steps per run (the cnn runs 10x as many)")
    p.add_argument("--fleet", type=Path, default=HERE / "fleets" / "mixed.toml", help="the fleet whose cpu_scale")
    p.add_argument("--task-samples", type=int, default=2000, help="images in one projected task (one epoch)")
    p.add_argument("--verify-quota", action="store_true", help="also run the step capped at the Pi 4's share (root)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args.steps)
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    load_before = os.getloadavg()
    started = time.time()
    measured = measure(args.steps, args.repeats)
    fleet = load_fleet(args.fleet)
    result = {"machine": _machine(), "load_average_before": [round(v, 2) for v in load_before],
              "measured": {k: [round(v, 4) for v in vals] for k, vals in measured.items()},
              **summarize(measured, fleet.cpu_scale, args.task_samples),
              "speeds_by_source": {k: {s: round(v, 2) for s, v in d.items()} for k, d in derived_speeds().items()}}
    if args.verify_quota:
        share = SPEEDS["pi4-4gb"] * result["calibrated_cpu_scale"]
        check = verify_quota(share, args.steps)
        predicted = result["host_anchor_step_s"] / check["share"]
        result["quota_check"] = {**check, "predicted_step_s": round(predicted, 2),
                                 "measured_over_predicted": round(min(check["step_s"]) / predicted, 3)}
    result["load_average_after"] = [round(v, 2) for v in os.getloadavg()]
    result["wall_s"] = round(time.time() - started, 1)
    _print(result)
    write_result(args.out, result)
    return 0


def _print(r: dict[str, Any]) -> None:
    a = r["anchor"]
    print(f"machine: {r['machine']['cpu']}, {r['machine']['cores']} cores, torch {r['machine']['torch']}, "
          f"1 thread; load average before {r['load_average_before']}, after {r['load_average_after']}")
    print(f"anchor: {a['model']} training, batch {a['batch']}, {a['board']}: {a['seconds_per_batch']:.2f} s/batch "
          f"({a['source']})")
    print(f"here, one full core: {r['host_anchor_step_s']:.3f} s/batch (min of {r['measured']['anchor_step_s']})")
    print(f"share of a core matching the {a['board']}: {r['share_matching_anchor_board']:.3f} -> calibrated "
          f"cpu_scale {r['calibrated_cpu_scale']:.4f} per unit of speed")
    print(f"the fleet's cpu_scale {r['fleet_cpu_scale']}: the lab runs {r['time_dilation']:.2f}x slower than the "
          f"boards (deadlines must be stretched by as much)")
    print(f"fedge cnn, batch 32: {r['host_cnn_sample_ms']:.3f} ms per image on one core; one task of "
          f"{r['task_samples']} images per class:")
    for c, v in r["classes"].items():
        print(f"  {c:<12} speed {v['speed']:>4}  calibrated {v['share_calibrated']:.3f} core, "
              f"{v['task_s_calibrated']:>6} s"
              f"   fleet {v['share_fleet']:.3f} core, {v['task_s_fleet']:>6} s")
    if "quota_check" in r:
        q = r["quota_check"]
        print(f"quota check: capped at {q['share']:.3f} core, {min(q['step_s']):.2f} s/step against "
              f"{q['predicted_step_s']:.2f} predicted ({q['measured_over_predicted']:.3f}x)")


if __name__ == "__main__":
    sys.exit(main())
