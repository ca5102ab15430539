"""fedge's edge lab: an emulated fleet of slow, memory-capped, intermittently connected devices on
this Linux machine, limited by the kernel, running real fedge clients against a real coordinator.

    sudo python bench/edge_lab.py bench/fleets/mixed.toml --policy sync-random --policy sync-deadline \\
        --wall-clock-budget 900
    python bench/edge_lab.py bench/fleets/test.toml --dry-run
    sudo python bench/edge_lab.py --cleanup

docs/edge-lab.md describes the fleet file, what the OS enforces and what cannot be emulated here.
"""

from __future__ import annotations

import argparse
import atexit
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lab.calibration import time_dilation  # noqa: E402
from lab.fleet import FleetError, load_fleet  # noqa: E402
from lab.lab import Lab, LabError, LabOptions, cleanup_all  # noqa: E402
from lab.memory import device_memory, device_profile_peaks, memory_by_class  # noqa: E402
from lab.policies import POLICIES, coordinator_config, toml_text  # noqa: E402
from lab.results import accounting, accuracy_curve, read_jsonl, time_to_target  # noqa: E402
from lab.system import System  # noqa: E402

TARGET_POLICY = "sync-random"
CALIBRATION = Path(__file__).resolve().parent / "results" / "edge_lab_calibration.json"


class Stopped(Exception):
    """SIGTERM: leave through the same ``finally`` as Ctrl-C."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="edge_lab.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Build an emulated device fleet on this machine (as root): a bridge and one network "
                    "namespace per device with tc-shaped links, a cgroup per device capping CPU and memory, a "
                    "Mosquitto broker and the coordinator outside, one real fedge-client per device inside. Links "
                    "go down and up and CPU quotas drop on each device's schedule. Runs each --policy in turn on "
                    "the same fleet and writes accuracy against wall-clock time, contributors per class, result "
                    "counts, the change log and OOM kills to --out. Everything created is removed at the end, on "
                    "Ctrl-C, SIGTERM or failure. No added latency or loss: this kernel has no netem.",
        epilog=f"policies: {', '.join(f'{k} ({v})' for k, v in POLICIES.items())}. docs/edge-lab.md")
    p.add_argument("fleet", nargs="?", type=Path, help="fleet file (bench/fleets/*.toml)")
    p.add_argument("--policy", action="append", choices=list(POLICIES), default=None,
                   help=f"policy to run, repeatable, in order (default {TARGET_POLICY})")
    p.add_argument("--rounds", type=int, default=5, help="rounds per policy (default 5)")
    p.add_argument("--wall-clock-budget", type=float, default=None, metavar="SECONDS",
                   help="stop each policy after this many seconds (its accuracy so far counts)")
    p.add_argument("--restart-after", type=float, default=None, metavar="SECONDS",
                   help="restart the coordinator once (SIGTERM, then --resume) after this many seconds of training, "
                        "to check that no result is lost or counted twice across the restart")
    p.add_argument("--seed", type=int, default=0, help="seed of the run, the partitions and the schedules")
    p.add_argument("--data", choices=("digits", "fashion-mnist"), default="digits", help="dataset (default digits)")
    p.add_argument("--partition", default="dirichlet:0.5", help="how devices split the data (default dirichlet:0.5)")
    p.add_argument("--model", choices=("mlp", "cnn"), default="mlp", help="model (default mlp)")
    p.add_argument("--cpu-scale", type=float, default=None,
                   help="cores per unit of relative speed, overriding the fleet file's cpu_scale")
    p.add_argument("--per-round", type=int, default=0, help="devices selected per round (default: a third)")
    p.add_argument("--min-results", type=int, default=0, help="results that close a round (default: half of those)")
    p.add_argument("--expected", type=int, default=0, help="devices online before round 1 (default: --per-round)")
    p.add_argument("--round-timeout", type=float, default=120.0, help="seconds a round waits (default 120)")
    p.add_argument("--skip-existing", action="store_true", help="keep policies already in --out, run the others")
    p.add_argument("--out", type=Path, default=Path("bench/results/edge_lab.json"), help="results JSON")
    p.add_argument("--work", type=Path, default=Path("runs/edge-lab"),
                   help="where run directories and logs go (default runs/edge-lab/flabID)")
    p.add_argument("--lab-id", default=None, metavar="HEX4", help="the lab's 4-hex-digit id (default: random)")
    p.add_argument("--dry-run", action="store_true", help="print what would be created and run; change nothing")
    p.add_argument("--report", action="store_true",
                   help="rebuild --out's curves, devices' memory and times to target from its policies' run "
                        "directories; no lab")
    p.add_argument("--cleanup", action="store_true",
                   help="remove the leftovers of every crashed lab on this machine (processes, namespaces, "
                        "veths, bridges, cgroups named flabXXXX) and exit")
    return p


def say(text: str) -> None:
    print(f"[lab {time.strftime('%H:%M:%S')}] {text}", flush=True)


def _options(args: argparse.Namespace) -> LabOptions:
    extra = {"lab_id": args.lab_id} if args.lab_id else {}
    return LabOptions(rounds=args.rounds, budget=args.wall_clock_budget, restart_after=args.restart_after,
                      seed=args.seed, data=args.data,
                      partition=args.partition, model=args.model, per_round=args.per_round,
                      min_results=args.min_results, expected=args.expected, round_timeout=args.round_timeout,
                      work=args.work, **extra)


TARGET_DEFINITION = (f"{TARGET_POLICY}'s last test accuracy within the wall-clock budget (time_to_target_s: a "
                     "policy's first evaluation at or above it), and the mean of its last 3 (time_to_target_mean3_s: "
                     "a policy's own mean of 3 consecutive evaluations at or above it)")


def _targets(policies: dict[str, Any]) -> tuple[float | None, float | None]:
    """The target: the target policy's final accuracy, and the mean of its last 3 evaluations (steadier)."""
    curve = (policies.get(TARGET_POLICY) or {}).get("accuracy_vs_time", [])
    last = [p["test_accuracy"] for p in curve[-3:]]
    return (curve[-1]["test_accuracy"] if curve else None), (sum(last) / 3 if len(last) == 3 else None)


def _times_to_target(policies: dict[str, Any]) -> None:
    """Each policy's training time to the target, and to the steadier target by its own 3-evaluation mean."""
    target, mean3 = _targets(policies)
    for result in policies.values():
        curve = result.get("accuracy_vs_time", [])
        last = [p["test_accuracy"] for p in curve[-3:]]
        result["final_accuracy_mean3"] = round(sum(last) / 3, 4) if len(last) == 3 else None
        result["time_to_target_s"] = time_to_target(curve, target)
        result["time_to_target_mean3_s"] = time_to_target(curve, mean3, window=3)


def _calibration(cpu_scale: float, path: Path = CALIBRATION) -> dict[str, Any] | None:
    """What the lab's seconds mean on the boards, from the last calibration (bench/lab_calibration.py):
    ``time_dilation`` lab seconds per board second at this ``cpu_scale``. None without a calibration."""
    try:
        calibrated = json.loads(path.read_text()).get("calibrated_cpu_scale")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(calibrated, (int, float)) or calibrated <= 0:
        return None
    root = Path(__file__).resolve().parents[1]
    return {"file": str(path.relative_to(root)) if path.is_relative_to(root) else str(path),
            "calibrated_cpu_scale": calibrated, "cpu_scale": cpu_scale,
            "time_dilation": round(time_dilation(calibrated, cpu_scale), 2)}


def _summary(args: argparse.Namespace, lab: Lab, policies: dict[str, Any]) -> dict[str, Any]:
    """The results file: the fleet, the options, each policy and each policy's time to the target."""
    _times_to_target(policies)
    target, mean3 = _targets(policies)
    fleet = lab.fleet
    return {"fleet": fleet.name, "fleet_file": str(args.fleet), "cpu_scale": fleet.cpu_scale,
            "devices": len(fleet.devices),
            "classes": {c: sum(d.klass == c for d in fleet.devices) for c in fleet.classes},
            "expected_offline_fraction": round(fleet.expected_offline_fraction(), 3),
            "calibration": _calibration(fleet.cpu_scale),
            "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(lab.options).items()},
            "target": {"policy": TARGET_POLICY, "accuracy": target, "accuracy_mean3": mean3,
                       "definition": TARGET_DEFINITION},
            "policies": policies}


def _memory(result: dict[str, Any]) -> None:
    """Each device's process peak RSS again, from the policy's directories (the run's ``clients/ID.jsonl``
    and the devices' own ``state/ID/profile.jsonl``) and the ``/proc`` peak the lab recorded, beside the
    cgroup peak recorded; and the per-class summary of both. Without those directories (a results file
    from elsewhere, or from before process peaks were recorded) the process peak stays unknown (null)."""
    run_dir = Path(result["run_dir"])
    devices = result.get("devices") or {}
    for device, row in devices.items():
        profiles = device_profile_peaks(run_dir, run_dir.parent / "state" / device, device)
        row.update(device_memory(row.get("memory_peak_bytes"), profiles, row.get("process_proc_peak_bytes")))
    result["memory"] = memory_by_class(devices)


def _report(out: Path) -> int:
    """Recompute what the run directories say (the curves' training clock, the accounting, the devices'
    memory, the target and the times to it) in an existing results file, e.g. after the way they are
    computed changed."""
    if not out.exists():
        print(f"edge_lab.py: {out} does not exist; run a lab first", file=sys.stderr)
        return 2
    results = json.loads(out.read_text())
    policies = results.get("policies", {})
    for name, result in policies.items():
        _memory(result)
        seen = {p["round"]: p["t"] for p in result.get("accuracy_vs_time", []) if p.get("t") is not None}
        rows = read_jsonl(Path(result["run_dir"]) / "metrics.jsonl")
        if not rows:   # the run directory is gone (another machine): keep what the file says
            say(f"{name}: {result['run_dir']} has no metrics.jsonl; its curve and accounting are kept as they are")
            continue
        result["accuracy_vs_time"] = accuracy_curve(rows, seen)
        result["accounting"] = accounting(Path(result["run_dir"]), rows)
    _times_to_target(policies)
    target, mean3 = _targets(policies)
    results["target"].update(accuracy=target, accuracy_mean3=mean3, definition=TARGET_DEFINITION)
    for name, result in policies.items():
        say(f"{name}: final accuracy {result.get('final_accuracy')}, time to target {result['time_to_target_s']} s "
            f"(mean of 3 evaluations: {result['time_to_target_mean3_s']} s)")
        for klass, m in result["memory"].items():
            say(f"  {klass}: cgroup peak {m['cgroup_peak_mib']} MiB (page cache in, shared pages charged elsewhere); "
                f"client process peak RSS {m['process_peak_rss_mib']} MiB ({m['with_process_peak']} of "
                f"{m['devices']} devices known)")
    out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


def _dry_run(lab: Lab, policies: list[str]) -> int:
    lab.setup()
    expected, per_round, min_results = lab.options.resolved(lab.fleet)
    say(f"busiest case: the {per_round} fastest devices training at once need "
        f"{lab.fleet.busiest_cpu(per_round):.2f} cores; expected offline share "
        f"{lab.fleet.expected_offline_fraction():.0%}")
    calibration = _calibration(lab.fleet.cpu_scale)
    if calibration:
        d = calibration["time_dilation"]
        say(f"calibration ({calibration['file']}): cpu_scale {lab.fleet.cpu_scale} against a calibrated "
            f"{calibration['calibrated_cpu_scale']}: the lab runs {d:.2f}x slower than the boards; a "
            f"{lab.options.round_timeout:.0f} s round deadline here is {lab.options.round_timeout / d:.0f} s "
            "on the boards")
    for policy in policies:
        config = coordinator_config(policy, broker="mqtt://127.0.0.1:PORT", out=f"{lab.work}/{policy}/run",
                                    rounds=lab.options.rounds, seed=lab.options.seed, model=lab.options.model,
                                    data=lab.options.data, partition=lab.options.partition, expected=expected,
                                    per_round=per_round, min_results=min_results,
                                    round_timeout=lab.options.round_timeout)
        say(f"{policy}: coordinator config\n{toml_text(config)}")
    lab.teardown()
    return 0


def _run(args: argparse.Namespace, lab: Lab, policies: list[str]) -> int:
    from lab.runner import run_policy

    done: dict[str, Any] = {}
    if args.skip_existing and args.out.exists():
        done = json.loads(args.out.read_text()).get("policies", {})
    lab.setup()
    for policy in policies:
        if policy in done and done[policy].get("status") != "error":
            say(f"{policy}: already in {args.out}, skipped (--skip-existing)")
            continue
        done[policy] = run_policy(lab, policy)
        r = done[policy]
        say(f"{policy}: {r['status']} after {r['wall_clock_s']:.0f}s, {r['rounds_completed']} rounds, "
            f"final accuracy {r['final_accuracy']}, results {r['results']}")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(_summary(args, lab, done), indent=1) + "\n")
    problems = lab.teardown()
    say(f"results: {args.out}")
    return 1 if problems or any(r.get("status") == "error" for r in done.values()) else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    system = System(dry_run=args.dry_run, echo=print)
    if args.cleanup:
        return 1 if cleanup_all(system, say) else 0
    if args.report:
        return _report(args.out)
    if args.fleet is None:
        build_parser().error("give a fleet file (bench/fleets/test.toml), or --cleanup")
    try:
        fleet = load_fleet(args.fleet, args.cpu_scale)
    except FleetError as exc:
        print(f"edge_lab.py: {exc}", file=sys.stderr)
        return 2
    lab = Lab(fleet, _options(args), system, say)
    policies = list(dict.fromkeys(args.policy or [TARGET_POLICY]))
    if args.dry_run:
        return _dry_run(lab, policies)

    def stopped(signum: int, frame: object) -> None:
        raise Stopped()
    signal.signal(signal.SIGTERM, stopped)
    # A shell starts a background job with SIGINT ignored, and an ignored signal stays ignored across exec: the
    # coordinators would then ignore the SIGINT that ends a policy's budget. A handler is reset to the default
    # on exec, so with one here every coordinator and client acts on SIGINT, and so does the lab.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    atexit.register(lab.teardown)
    try:
        return _run(args, lab, policies)
    except LabError as exc:
        print(f"edge_lab.py: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Stopped):
        say("interrupted")
        return 130
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):   # nothing may cut the clean-up short
            signal.signal(signum, signal.SIG_IGN)
        lab.teardown()


if __name__ == "__main__":
    sys.exit(main())
