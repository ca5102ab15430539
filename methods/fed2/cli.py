"""``fedge-coordinator fed2-depth``: measure where Fed2's grouped layers should start (``model.fed2_from``).

The registry names :func:`add_command`; ``fedge-coordinator`` adds it to its commands. Building the
parser imports nothing heavy: torch and the measurement (:mod:`methods.fed2.diagnostics`) are
imported when the command runs, after the data spec is checked.
"""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path
from typing import Any

from edge_client.argcheck import at_least, check_data_spec

__all__ = ["add_command"]

_PARAGRAPHS = (
    "Train the model briefly on central data, then measure for every hidden layer how much its neurons "
    "differ in the classes they prefer.",
    "A neuron's preference for class c is the sum over held-out class-c images of activation x gradient "
    "of the class-c logit. A layer's variance is the total variance of these vectors (each divided by "
    "its absolute sum) across the layer's neurons, scaled to [0, 1]: near 0 the layer is generic, near 1 "
    "its neurons specialize by class. Fed2 should group the layers from the lowest one from which every "
    "variance is above the threshold, up to the classifier.",
    "Use the answer in a Fed2 run: fedge-coordinator run ... --set model.fed2_from=LAYER. Layers are "
    "numbered as the table shows: the extractor's weight layers 1, 2, ..., the classifier last. "
    "See docs/fed2-depth.md.",
)


def add_command(sub: Any, name: str) -> None:  # sub: the parser's subparsers
    """Add the command to ``fedge-coordinator`` under ``name``."""
    depth = sub.add_parser(
        name, help="measure where Fed2's grouped layers should start (model.fed2_from)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="\n\n".join(textwrap.fill(text, 79, break_on_hyphens=False) for text in _PARAGRAPHS))
    depth.add_argument("--model", default="cnn", help="model from the registry: cnn, vgg9, mlp (default cnn)")
    depth.add_argument("--width", type=float, default=None, help="width multiplier of the hidden layers")
    depth.add_argument("--norm", default=None, help="normalization: none, gn (Fed2 uses GroupNorm) or bn")
    depth.add_argument("--data", default="fashion-mnist",
                       help="digits, fashion-mnist[:DIR], npz:PATH (default fashion-mnist)")
    depth.add_argument("--samples", type=at_least(1), default=5000,
                       help="training images for the brief training (5000)")
    depth.add_argument("--epochs", type=at_least(1), default=1, help="epochs of the brief training (1)")
    depth.add_argument("--threshold", type=float, default=None,
                       help="variance above which a layer counts as class-specific (default 0.3)")
    depth.add_argument("--seed", type=int, default=0, help="seed for model init, sample choice and shuffling")
    depth.add_argument("--plot", type=Path, default=None, help="write a PNG bar plot of the variance per layer")
    depth.add_argument("--json", type=Path, default=None, help="write the measurement as JSON")
    depth.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Measure, write what ``--json`` and ``--plot`` ask for and show the table; 2 when the input is wrong."""
    from edge_client.data import DataError

    try:   # before torch is imported
        check_data_spec(args.data)
    except DataError as exc:
        print(f"fedge-coordinator fed2-depth: {exc}")   # where its other errors go
        return 2
    from rich.console import Console
    from rich.markup import escape

    from edge_client.models import ModelSpecError
    from methods.fed2.diagnostics import DEFAULT_THRESHOLD, Fed2DepthError, fed2_depth, plot_variances

    console = Console()
    spec = {"name": args.model, **{k: v for k, v in (("width", args.width), ("norm", args.norm)) if v is not None}}
    threshold = DEFAULT_THRESHOLD if args.threshold is None else args.threshold
    try:
        with console.status(f"training {escape(args.model)} on {escape(args.data)} and measuring preferences"):
            result = fed2_depth(spec, data=args.data, samples=args.samples, epochs=args.epochs, seed=args.seed,
                                threshold=threshold)
        if args.json is not None:
            import json

            args.json.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        if args.plot is not None:
            plot_variances(result, args.plot)
    except (DataError, ModelSpecError, Fed2DepthError, OSError) as exc:
        console.print(f"[red]fedge-coordinator fed2-depth: {escape(str(exc))}[/red]", soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/yellow]")
        return 130
    _show(console, args, result)
    return 0


def _show(console: Any, args: argparse.Namespace, result: Any) -> None:  # result: diagnostics.Fed2Depth
    from rich.markup import escape
    from rich.table import Table

    options = ", ".join(f"{k} {v}" for k, v in result.spec.items() if k in ("width", "norm"))
    table = Table(title=f"class-preference variance: {escape(args.model)}{f' ({options})' if options else ''} "
                        f"on {escape(result.data)}")
    for column, justify in (("layer", "right"), ("kind", "left"), ("neurons", "right"), ("variance", "right"),
                            ("", "left")):
        table.add_column(column, justify=justify)
    for layer in result.layers:
        mark = ("<- fed2_from" if layer.index == result.suggested
                else "grouped" if layer.index > result.suggested else "")
        dead = f" ({layer.dead} dead)" if layer.dead else ""
        table.add_row(str(layer.index), layer.kind, f"{layer.neurons}{dead}", f"{layer.variance:.3f}", mark)
    table.add_row(str(result.classifier), "linear", str(result.spec["num_classes"]), "-",
                  "<- fed2_from (classifier only)" if result.suggested == result.classifier else "grouped")
    console.print(table)
    console.print(f"trained {result.epochs} epoch(s) on {result.train_samples:,} images (held-out accuracy "
                  f"{result.accuracy:.3f}); preferences on {result.eval_samples:,} test images; threshold "
                  f"{result.threshold:g}; {result.seconds:.1f} s", highlight=False)
    for label, path in (("plot", args.plot), ("json", args.json)):
        if path is not None:
            console.print(f"{label}: {escape(str(path))}", highlight=False)
    if result.barely_trained:
        console.print(f"[yellow]warning: the model barely trained (held-out accuracy {result.accuracy:.3f}); "
                      "these variances are mostly those of random weights: raise --samples or --epochs[/yellow]",
                      soft_wrap=True)
    console.print(f"suggested: model.fed2_from = {result.suggested}", highlight=False)
