"""``fedge-coordinator``: run federated training (``run``) or the whole pipeline (``demo``)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

__all__ = ["main", "build_parser"]

# flag -> (section, key, type, help)
_FLAGS: dict[str, tuple[str, str, type, str]] = {
    "--strategy": ("run", "strategy", str, "the method: fedavg, fedprox, spherefed, dfl (docs/methods.md)"),
    "--model": ("model", "name", str, "model from the registry: mlp, cnn, vgg9"),
    "--rounds": ("run", "rounds", int, "number of federated rounds"),
    "--clients": ("clients", "expected", int, "how many clients the run waits for before round 1"),
    "--clients-per-round": ("clients", "per_round", int, "clients sampled each round (0: all)"),
    "--min-results": ("clients", "min_results", int,
                      "results needed to aggregate a round; fewer retries it with a fresh sample (0: all selected)"),
    "--round-timeout": ("clients", "round_timeout", float, "seconds a round waits for results"),
    "--data": ("data", "eval", str, "evaluation data: digits, fashion-mnist[:DIR], npz:PATH"),
    "--partition": ("data", "partition", str,
                    "how spawned clients split the data: iid, dirichlet:ALPHA, shards:K, "
                    "attribute:color|rotate:DOMAINS[+LABEL_SPEC]"),
    "--transport": ("transport", "kind", str, "mqtt (default) or inproc (clients as threads, no broker)"),
    "--broker": ("transport", "broker", str,
                 "broker URL mqtt://HOST:PORT; omitted: start the embedded broker on 127.0.0.1"),
    "--spawn-clients": ("clients", "spawn", int,
                        "start N local fedge-client processes on partitions 0..N-1 (threads with inproc)"),
    "--seed": ("run", "seed", int, "seed for model init, sampling, partitions and local shuffling"),
    "--out": ("run", "out", str, "run directory (default runs/RUN_ID)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedge-coordinator",
        description="fedge coordinator: runs federated rounds with edge clients over MQTT.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="run (or resume) a federated training run",
                         description="Run a federated training run. Flags override the --config file; "
                                     "--set SECTION.KEY=VALUE overrides any other key. The resolved config "
                                     "is written to OUT/config.toml.")
    run.add_argument("--config", type=Path, help="TOML config file (see README's config reference)")
    for flag, (section, key, typ, text) in _FLAGS.items():
        run.add_argument(flag, type=typ, default=None, help=f"{text} [{section}.{key}]")
    run.add_argument("--resume", action="store_true",
                     help="continue the run in --out from its last checkpoint (reads OUT/config.toml)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override any config key, e.g. --set train.lr=0.01 (repeatable)")
    run.add_argument("-v", "--verbose", action="store_true", help="log client and round events to the terminal")
    demo = sub.add_parser("demo", help="the whole pipeline on digits with 4 local client processes",
                          description="Start the embedded broker, spawn 4 client processes on scikit-learn's "
                                      "digits, train with FedAvg for a few rounds and print the run directory.")
    demo.add_argument("--rounds", type=int, default=5, help="number of rounds (default 5)")
    demo.add_argument("--out", default=None, help="run directory (default runs/RUN_ID)")
    demo.add_argument("-v", "--verbose", action="store_true", help="log client and round events to the terminal")
    return parser


def _config_from_args(args: argparse.Namespace):  # -> RunConfig
    from coordinator.config import load_config, parse_override

    overrides = []
    for flag, (section, key, _typ, _text) in _FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            overrides.append((section, key, value))
    overrides += [parse_override(item) for item in args.set]
    config_path = args.config
    if args.resume and config_path is None and args.out:
        config_path = Path(args.out) / "config.toml"
    return load_config(config_path, overrides)


def _demo_config(args: argparse.Namespace):  # -> RunConfig
    from coordinator.config import load_config

    overrides = [("run", "strategy", "fedavg"), ("run", "rounds", args.rounds), ("model", "name", "cnn"),
                 ("data", "eval", "digits"), ("data", "partition", "iid"), ("clients", "expected", 4),
                 ("clients", "spawn", 4), ("transport", "kind", "mqtt"), ("transport", "broker", "")]
    if args.out:
        overrides.append(("run", "out", args.out))
    return load_config(None, overrides)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from rich.console import Console
    from rich.logging import RichHandler
    from rich.markup import escape

    console = Console(stderr=False)
    handler = RichHandler(console=Console(stderr=True), show_path=False)
    handler.setLevel(logging.INFO if args.verbose else logging.WARNING)
    logging.basicConfig(level=logging.WARNING, handlers=[handler], format="%(message)s")

    from coordinator.checkpoint import CheckpointError
    from coordinator.config import ConfigError
    from coordinator.engine import RunError
    from coordinator.report import RoundTable
    from coordinator.run import RunInterrupted, run_federated
    from edge_client.data import DataError
    from edge_client.models import ModelSpecError
    from edge_client.wire.protocol import ProtocolError
    from edge_client.wire.transport import TransportError

    try:
        config = _demo_config(args) if args.command == "demo" else _config_from_args(args)
        with RoundTable(console, title=f"fedge {config.run.strategy} / {config.model['name']}") as table:
            result = run_federated(config, resume=getattr(args, "resume", False),
                                   say=lambda text: console.print(f"[dim]{escape(text)}[/dim]"), on_round=table.add,
                                   on_progress=table.progress)
    except (ConfigError, DataError, ModelSpecError, TransportError, RunError, CheckpointError, ProtocolError) as exc:
        # One line however long (piped output would wrap at 80 columns); messages hold [section] names.
        console.print(f"[red]fedge-coordinator: {escape(str(exc))}[/red]", soft_wrap=True)
        return 2
    except RunInterrupted as stop:
        console.print(f"[yellow]{escape(_interrupted(stop))}[/yellow]", soft_wrap=True)
        return 130
    except KeyboardInterrupt:
        console.print("[yellow]interrupted before the run started; nothing was written[/yellow]")
        return 130
    s = result.summary
    if s.get("rounds") is not None:
        accuracy = (f"final test accuracy {s['final_accuracy']:.4f}" if s["final_accuracy"] is not None
                    else f"final personalized accuracy {s['final_personalized_accuracy'] or 0.0:.4f}")
        console.print(f"{accuracy} after {s['rounds']} rounds ({s['bytes_down'] + s['bytes_up']:,} bytes moved)")
    console.print(f"run directory: {result.out_dir}")
    console.print(escape(f"next: fedge-profile show {result.out_dir}   fedge-profile html {result.out_dir} "
                         f"-o report.html   fedge-export {result.out_dir}"), highlight=False, soft_wrap=True)
    return 0


def _interrupted(stop) -> str:  # stop: coordinator.run.RunInterrupted
    """What is true after Ctrl-C: what can be resumed, or that nothing can."""
    if stop.checkpointed_round:
        return (f"interrupted; round {stop.checkpointed_round} is checkpointed: continue with "
                f"fedge-coordinator run --resume --out {stop.out_dir}")
    if stop.out_dir is not None:
        return f"interrupted before any round was checkpointed; nothing to resume in {stop.out_dir}"
    return "interrupted before round 1 finished; nothing was checkpointed, so there is nothing to resume"


if __name__ == "__main__":
    sys.exit(main())
