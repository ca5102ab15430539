"""``fedge-export``: a run's model as a verified ONNX file with its model card, optionally int8 too.

    fedge-export RUN_DIR [--round N] [-o model.onnx]           the global model
    fedge-export [RUN_DIR] --client-state DIR                   one device's personalized model
    ... --int8 [--data SPEC] [--calibration-samples N] [--max-accuracy-drop POINTS]
    ... --int8 [--max-headline-drop FRACTION]                   a run on an app: guarded on its headline metric

Exit status: 0 written; 2 nothing written (bad source, data or parity); 3 the
float32 model was written but the int8 one was refused by its accuracy guard
(an app's: its headline metric's).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from edge_client.argcheck import OneLineParser, at_least, check_data_spec
from export import hooks

__all__ = ["main", "build_parser"]

progress = logging.getLogger("fedge.export.progress")   # which step runs: an int8 export takes a while


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="fedge-export",
        description="Export a run's model to ONNX (dynamic batch), check it against torch on real "
                    "test data and write a model card beside it. See docs/export.md.")
    parser.add_argument("source", type=Path, nargs="?", metavar="RUN_DIR",
                        help="run directory, or one checkpoints/round_NNNN.safetensors file; may be omitted with "
                             "--client-state RUN_DIR/clients/ID")
    parser.add_argument("--round", type=at_least(0), default=None, metavar="N",
                        help="export this round's checkpoint (default: the last)")
    parser.add_argument("-o", "--out", type=Path, default=None,
                        help="ONNX file to write (default RUN_DIR/export/model.onnx, or "
                             "STATE_DIR/export/model.onnx with --client-state)")
    parser.add_argument("--client-state", type=Path, default=None, metavar="DIR",
                        help="a device's state directory: export its personalized model, the run's global part with "
                             "the parts that stayed on this device (for the methods that keep some: docs/export.md)")
    parser.add_argument("--data", default=None, metavar="SPEC",
                        help="data for the parity check, the test accuracy and int8 calibration "
                             "(default: the run's data.eval)")
    parser.add_argument("--parity-samples", type=at_least(1), default=1000, metavar="N",
                        help="test samples torch and ONNX Runtime must agree on (default 1000)")
    parser.add_argument("--test-samples", type=at_least(0), default=0, metavar="N",
                        help="test samples for the reported accuracy (default 0: the whole test split)")
    parser.add_argument("--int8", action="store_true",
                        help="also write a statically quantized int8 model (QDQ) beside the float32 one")
    parser.add_argument("--calibration-samples", type=at_least(1), default=512, metavar="N",
                        help="training samples (an app's: evaluation samples) that calibrate the int8 activation "
                             "ranges (default 512)")
    parser.add_argument("--max-accuracy-drop", type=at_least(0.0, float), default=None, metavar="POINTS",
                        help="refuse an int8 model whose test accuracy is more than this many points below "
                             "float32 (default 1)")
    parser.add_argument("--max-headline-drop", type=at_least(0.0, float), default=None, metavar="FRACTION",
                        help="a run on an app: refuse an int8 model whose headline metric is worse than float32's "
                             "by more than this fraction of it, in the metric's direction (default 0.01: 1%%)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what each step does")
    return parser


def _describe(exported) -> list[str]:   # exported: export.pipeline.Exported
    card = exported.card
    lines = [f"wrote {exported.path} ({card['bytes']:,} bytes, sha256 {card['sha256'][:12]}), "
             f"card {exported.card_path.name}"]
    run = card["run"]
    what = f"client {card['personalized']['client']} of " if card.get("personalized") else ""
    lines.append(f"  {what}run {run['run_id']}, round {run['round']}, strategy {card['strategy']['name']}, "
                 f"model {card['model'].get('name')}")
    lines += hooks.describe(card)   # what the methods' export hooks did
    p = card["parity"]
    lines.append(f"  parity with torch on {p['samples']} test samples: max |difference| {p['max_abs_diff']:.2g}, "
                 f"same prediction on {p['argmax_agreement']:.2%}")
    t = card["test_data"]
    lines.append(f"  test accuracy {card['test_accuracy']:.4f} on {t['samples']} samples of {t['spec']}")
    start = card.get("initial_model")
    if start is not None:
        worse = "  WORSE THAN ITS START" if start["worse"] else ""
        lines.append(f"  the run's initial model (round 0) had {start['test_accuracy']:.4f}: "
                     f"{100 * start['accuracy_change']:+.2f} points{worse}")
    return lines


def _early_problem(args: argparse.Namespace) -> str:
    """What the command line shows wrong before torch and ONNX are imported ("" when nothing)."""
    from edge_client.data import DataError

    if args.source is None and args.client_state is None:
        return "pass a run directory (or checkpoint file), or --client-state DIR"
    if args.source is not None and not args.source.exists():
        return (f"{args.source} does not exist; pass a run directory (it holds checkpoints/) or a "
                "checkpoints/round_NNNN.safetensors file")
    if args.client_state is not None and not args.client_state.is_dir():
        return f"client state directory {args.client_state} does not exist; pass the device's --state-dir"
    try:
        if args.data is not None:
            check_data_spec(args.data)
    except DataError as exc:
        return f"--data: {exc}"
    return ""


def _show_progress() -> None:
    """Step lines on stderr whatever the log level: quantizing a model can take a minute on a small
    machine, and a silent minute looks like a hang."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("fedge-export: %(message)s"))
    progress.addHandler(handler)
    progress.setLevel(logging.INFO)
    progress.propagate = False


def _trained_an_app(source: Path, round: int | None) -> bool:
    from export.app_export import run_app_of
    from export.source import open_run

    return run_app_of(open_run(Path(source), round)) is not None


def _export_app(args: argparse.Namespace) -> int:
    """A run on an app: its graph, parity and the app's own metrics on the card; with --int8, the int8 model
    guarded on the app's headline metric."""
    from export.app_export import export_app_float32, export_app_int8
    from export.errors import QuantizationError
    from export.quantize import QuantSettings

    if args.max_accuracy_drop is not None:
        print("fedge-export: --max-accuracy-drop is for fedge's own networks; an app's int8 model is guarded on its "
              "headline metric: --max-headline-drop FRACTION", file=sys.stderr)
        return 2
    exported = export_app_float32(Path(args.source), round=args.round, out=args.out, data=args.data,
                                  parity_samples=args.parity_samples)
    card = exported.card
    print(f"wrote {exported.path} ({card['bytes']:,} bytes; app {card['app']['name']} {card['app']['version']}; "
          f"served by ONNX Runtime: {_scores(card)}; parity max |difference| {card['parity']['max_abs_diff']:.2g})")
    if not args.int8:
        return 0
    limit = QuantSettings.max_headline_drop if args.max_headline_drop is None else args.max_headline_drop
    settings = QuantSettings(calibration_samples=args.calibration_samples, max_headline_drop=limit)
    progress.info("int8: static quantization, refused if its test %s is more than %s%% worse than float32's",
                  card["headline"], f"{100 * settings.max_headline_drop:g}")
    try:
        quantized = export_app_int8(exported, settings)
    except QuantizationError as exc:
        print(f"fedge-export: int8: {exc}", file=sys.stderr)
        return 3
    q = quantized.card["quantization"]
    name = q["headline"]
    print(f"wrote {quantized.path} ({q['int8_bytes']:,} bytes, {q['size_ratio']:.1%} of float32); served by ONNX "
          f"Runtime: {_scores(quantized.card)}")
    print(f"  test {name} float32 {q[f'float32_{name}']:.4f}, int8 {q[f'int8_{name}']:.4f} "
          f"({100 * q['headline_worse_by']:.2f}% worse, limit {100 * q['max_headline_drop']:g}%), "
          f"calibrated on {q['calibration_samples']} samples of the app's evaluation data")
    return 0


def _scores(card: dict) -> str:
    """An app's card's metrics as ONNX Runtime served them: ``test_mae 0.5932, test_r2 0.4871``."""
    return ", ".join(f"{k} {card[k]:.4f}" for k in card if k.startswith("test_") and k != "test_data")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    problem = _early_problem(args)
    if problem:
        print(f"fedge-export: {problem}", file=sys.stderr)
        return 2
    _show_progress()
    progress.info("exporting %s to ONNX and checking it against torch on up to %d test samples",
                  args.client_state or args.source, args.parity_samples)
    try:
        from export.errors import ExportError, QuantizationError
        from export.pipeline import ExportOptions, export_global, export_int8, export_personalized
        from export.quantize import QuantSettings
    except ImportError as exc:
        print(f"fedge-export needs onnx and onnxruntime: pip install 'fedge[export]' ({exc})", file=sys.stderr)
        return 2
    options = ExportOptions(out=args.out, data=args.data, parity_samples=args.parity_samples,
                            test_samples=args.test_samples)
    try:
        if args.client_state is None and _trained_an_app(args.source, args.round):
            return _export_app(args)
        if args.max_headline_drop is not None:
            print("fedge-export: --max-headline-drop is for runs on apps; fedge's own networks are guarded on their "
                  "accuracy: --max-accuracy-drop POINTS", file=sys.stderr)
            return 2
        if args.client_state is not None:
            exported = export_personalized(args.source, args.client_state, round=args.round, options=options)
        else:
            exported = export_global(args.source, round=args.round, options=options)
    except ExportError as exc:
        print(f"fedge-export: {exc}", file=sys.stderr)
        return 2
    print("\n".join(_describe(exported)))
    if not args.int8:
        return 0
    max_drop = QuantSettings.max_drop if args.max_accuracy_drop is None else args.max_accuracy_drop
    progress.info("int8: static quantization, refused if its test accuracy is more than %s points below "
                  "float32's", f"{max_drop:g}")
    try:
        quantized = export_int8(exported, QuantSettings(calibration_samples=args.calibration_samples,
                                                        max_drop=max_drop))
    except QuantizationError as exc:
        print(f"fedge-export: int8: {exc}", file=sys.stderr)
        return 3
    q = quantized.card["quantization"]
    print(f"wrote {quantized.path} ({q['int8_bytes']:,} bytes, {q['size_ratio']:.1%} of float32), "
          f"card {quantized.card_path.name}")
    print(f"  test accuracy float32 {q['float32_accuracy']:.4f}, int8 {q['int8_accuracy']:.4f} "
          f"(drop {q['accuracy_drop_points']:.2f} points, limit {q['max_accuracy_drop_points']:g}), "
          f"calibrated on {q['calibration_samples']} training samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
