"""``fedge-profile``: read what runs and devices recorded, and benchmark inference on a device.

    fedge-profile show RUN_DIR_OR_PROFILE          terminal report (rich tables, else plain text)
    fedge-profile html RUN_DIR -o report.html      self-contained HTML report with plots (matplotlib)
    fedge-profile infer MODEL.onnx [--data SPEC]   ONNX Runtime latency on this device (no torch needed)

Each command imports only what it needs: ``show`` runs on a device with only the
``client`` extra (no rich: plain-text tables), and ``infer`` on one with onnxruntime
and numpy but no torch, rich or matplotlib.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from profiling.errors import ProfileError

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedge-profile",
        description="Reports on where federated training spends time and memory on each device, and an "
                    "ONNX Runtime latency benchmark for the device itself.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    show = sub.add_parser("show", help="print a report of a run directory or a device's profile history",
                          description="Print one row per device (median round time, phase breakdown, peak memory, "
                                      "temperature, straggler rank) and one per round (the headline metric: "
                                      "accuracy, or a run's app's own; bytes), or, for a device's profile.jsonl, "
                                      "one row per task and inference benchmark. "
                                      "Without rich installed the tables are plain text.")
    show.add_argument("path", type=Path, metavar="RUN_DIR_OR_PROFILE",
                      help="a run directory (the coordinator's --out), a device's state directory "
                           "(fedge-client --state-dir) or its profile.jsonl, or a run's clients/ID.jsonl")
    page = sub.add_parser("html", help="write a self-contained HTML report with plots",
                          description="Write one HTML file with the report's tables and plots embedded: first "
                                      "what sizes hardware (peak memory against each device's memory and the kind "
                                      "of task that set it, speed per sample, traffic, time offline, memory, CPU "
                                      "and temperature over time, inference benchmarks), then the headline metric "
                                      "(accuracy, or a run's app's own) and bytes per round, round time per "
                                      "device, phase breakdown and memory.")
    page.add_argument("path", type=Path, metavar="RUN_DIR", help="a run directory or a profile file")
    page.add_argument("-o", "--output", type=Path, default=Path("report.html"),
                      help="file to write (default report.html)")
    infer = sub.add_parser("infer", help="benchmark an ONNX model's latency on this device",
                           description="Run MODEL.onnx with ONNX Runtime: warm-up, then --runs timed runs at batch 1 "
                                       "and at --batch; print p50/p95/p99 latency, throughput and peak memory, and "
                                       "append them to the device's profile history (--state-dir/profile.jsonl). "
                                       "An app's export is fed as the model card beside it says (input shape and "
                                       "dtype), without torch or the app.")
    infer.add_argument("model", type=Path, metavar="MODEL.onnx", help="the ONNX model file")
    infer.add_argument("--data", default=None, metavar="SPEC",
                       help="npz:PATH with real samples (array x_test or x; with labels y_test or y the model's "
                            "accuracy on them is reported too, except for an app's export, whose metrics are the "
                            "app's code); default: seeded random input")
    infer.add_argument("--runs", type=int, default=200, help="timed runs per batch size (default 200)")
    infer.add_argument("--warmup", type=int, default=20, help="untimed runs first (default 20)")
    infer.add_argument("--batch", type=int, default=32, help="the larger batch size (default 32)")
    infer.add_argument("--provider", default="auto", choices=("auto", "cpu", "cuda", "tensorrt"),
                       help="ONNX Runtime execution provider: cpu (a Raspberry Pi), cuda or tensorrt (a Jetson with "
                            "NVIDIA's onnxruntime-gpu); auto (default) takes the first of tensorrt, cuda, cpu that "
                            "this onnxruntime offers, and the report says which ran")
    infer.add_argument("--threads", type=int, default=1,
                       help="ONNX Runtime intra-op threads (default 1; 0: one per core)")
    infer.add_argument("--state-dir", type=Path, default=Path(os.environ.get("FEDGE_STATE_DIR", "fedge-state")),
                       help="the device's state directory, as for fedge-client (default $FEDGE_STATE_DIR or "
                            "./fedge-state)")
    infer.add_argument("--no-record", action="store_true", help="do not append to the profile history")
    return parser


def _show(args: argparse.Namespace) -> int:
    from profiling.report import render, render_plain
    from profiling.runs import load

    run = load(args.path)
    try:
        from rich.console import Console
    except ImportError:   # a device with only the client extra
        render_plain(run)
        return 0
    # Piped into a file or a pager (and COLUMNS unset), tables keep their full width instead of
    # rich's 80-column default.
    piped = not sys.stdout.isatty() and not os.environ.get("COLUMNS")
    render(run, Console(width=200) if piped else Console())
    return 0


def _html(args: argparse.Namespace) -> int:
    from profiling.html import render_html
    from profiling.runs import load

    text = render_html(load(args.path))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output} ({len(text) // 1024} KiB)")
    return 0


def _infer(args: argparse.Namespace) -> int:
    from profiling.infer import InferSettings, benchmark, format_result

    settings = InferSettings(runs=args.runs, warmup=args.warmup, batch=args.batch, threads=args.threads,
                             data=args.data, provider=args.provider)
    record = benchmark(args.model, settings, state_dir=None if args.no_record else args.state_dir)
    print(format_result(record))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = {"show": _show, "html": _html, "infer": _infer}[args.command]
    try:
        return command(args)
    except ImportError as exc:
        missing = (exc.name or "").split(".")[0]
        extra = "infer" if args.command == "infer" else "coordinator"
        fix = f"pip install {missing}, or the {extra} extra" if missing else f"install the {extra} extra"
        print(f"fedge-profile {args.command} needs {missing or exc}, which is not installed: {fix} "
              f"(pip install 'fedge[{extra}]')", file=sys.stderr)
        return 2
    except ProfileError as exc:
        print(f"fedge-profile {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:   # `fedge-profile show RUN | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
