"""SphereFed and FFC on Fashion-MNIST: what calibration costs and what it gains.

1. Cost, for ``cnn`` and ``vgg9`` with the sphere head: one client's FFC statistics
   over ``--samples`` training images (the time on a client, one torch thread as
   spawned clients use), the size of its result message in float64 and float32
   (tensor bytes and whole message), and the coordinator's time to decode, sum and
   solve the statistics of 10 such clients. The weights do not change the cost, so
   the models are freshly initialized.
2. Accuracy, from the run files ``bench/run_matrix.py bench/matrices/spherefed.toml``
   wrote to ``bench/results/spherefed/``: per cell, the last round's accuracy, the
   mean of the last 5 rounds, FFC's accuracy before and after calibration, the
   classifier bytes SphereFed saved per round and the FFC figures of the run.
   Training is deterministic, so when a ``sphere`` run is missing its figures come
   from the ``sphere+ffc`` run of the same cell and seed (its rows, with the last
   round's accuracy before calibration), marked "from sphere+ffc". Figures are means with
   the population std over seeds, and per seed the first round each row reached FedAvg's
   final accuracy in its cell. Where both twins ran, the report compares them round by
   round (``twin_check``): zero difference is what makes the derived rows exact. ``swing_std``
   and ``swing_range``: how much the uncalibrated accuracy moves between the evaluations of
   the run's second half (the last round's label mix pulls the model; FFC uses every client).
3. Like with like: every row (FedAvg, FedAvg + FFC, SphereFed, SphereFed + FFC, ...) on the same
   three figures, the mean of the last 5 evaluations, the last round (calibrated for FFC rows)
   and the best evaluation, with its gap over FedAvg on each figure seed by seed, and the last
   round against FedAvg's best; and what the whole run sent, FFC's extra pass included: the
   participations of training and of the FFC pass (every client, once), bytes up and down and
   FFC's part of them. ``--matrix spherefed_lr`` reads the rate tuning's runs instead, and adds the
   rate's choice (:func:`rate_choice`).

Prints the tables and writes ``bench/results/MATRIX_ffc.json`` (``spherefed_ffc.json`` by default).

    python bench/spherefed_ffc.py [--samples 6000] [--skip-cost] [--skip-report] [--matrix spherefed]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from benchmark_protocol import rounds_to_reach
from coordinator.ui.report import human_bytes
from edge_client.wire.codec import parse_codec
from edge_client.data import load_dataset
from edge_client.models import federated_names
from edge_client.registry import build_model
from edge_client.objectives import LocalData, TaskContext
from edge_client.wire.protocol import ResultBody, decode, encode
from methods.spherefed.device import WIRE_CODECS, FfcStats, ffc_stats, wire_numbers, wire_shapes
from methods.spherefed.model import CLASSIFIER
from edge_client.wire.updates import ResidualStore, UploadSettings, decode_upload, encode_upload
from profiling.profiler import Profiler

RESULTS = Path(__file__).resolve().parent / "results"
LAST_ROUNDS = 5
CLIENTS = 10


def _result_message(tensors: dict[str, torch.Tensor], dtype: str, n: int) -> bytes:
    """The stats as a client sends them: raw values in the FFC codec, in a result envelope."""
    settings = UploadSettings(parse_codec(WIRE_CODECS[dtype]), "raw")
    wire, delta = encode_upload(tensors, {}, settings, ResidualStore(None), "run", raw_only=True)
    body = ResultBody(num_samples=n, metrics={"ffc_seconds": 0.0}, codec=settings.codec, delta=tuple(delta))
    return encode("result", run_id="20261122-000000-000000", round=30, task_id="0" * 16, sender="sim-000",
                  body=body.to_body(), tensors=wire)


def measure_cost(model_name: str, samples: int) -> dict[str, Any]:
    data = load_dataset("fashion-mnist")
    spec = {"name": model_name, "num_classes": data.num_classes, "in_channels": data.in_channels,
            "image_size": data.image_size, "head": "sphere", "sphere_seed": 0}
    torch.manual_seed(0)
    model = build_model(spec)
    classes, dim = model.classifier.out_features, model.classifier.in_features
    local = LocalData(torch.from_numpy(data.x_train[:samples]), torch.from_numpy(data.y_train[:samples]))
    ctx = TaskContext(seed=0, round=30, client_id="sim-000", state_dir=None, profiler=Profiler())
    out: dict[str, Any] = {"model": model_name, "d": dim, "classes": classes, "samples": samples,
                           "numbers": wire_numbers(dim, classes),
                           "extractor_fp32_bytes": 4 * sum(model.state_dict()[k].numel()
                                                           for k in federated_names(model) if k != CLASSIFIER),
                           "classifier_fp32_bytes": 4 * classes * dim}
    for dtype in ("float64", "float32"):
        started = time.perf_counter()
        result = ffc_stats(model, local, {"dtype": dtype}, ctx)
        out[f"client_seconds_{dtype}"] = time.perf_counter() - started
        payload = _result_message(result.tensors, dtype, samples)
        out[f"message_bytes_{dtype}"] = len(payload)
        out[f"tensor_bytes_{dtype}"] = sum(t.numel() * t.element_size() for t in result.tensors.values())
        started = time.perf_counter()   # the coordinator: decode and check 10 results, sum, solve
        parts = []
        for _ in range(CLIENTS):
            msg = decode(payload)
            tensors = decode_upload(msg.tensors, ResultBody.from_body(msg.body), wire_shapes(dim, classes), {})
            parts.append(FfcStats.from_wire(tensors, dim, classes))
        calibration = FfcStats.reduce(parts).solve(0.0)
        out[f"coordinator_seconds_{dtype}"] = time.perf_counter() - started
        out[f"singular_{dtype}"] = calibration.singular
    return out


def print_cost(console: Console, rows: list[dict[str, Any]]) -> None:
    table = Table(title=f"FFC cost on Fashion-MNIST (client: {rows[0]['samples']} images, 1 torch thread; "
                        f"coordinator: {CLIENTS} clients)")
    for name in ("model", "d", "numbers", "message f64", "message f32", "vs model upload", "client s",
                 f"coordinator s ({CLIENTS})"):
        table.add_column(name, justify="left" if name == "model" else "right")
    for r in rows:
        ratio = r["message_bytes_float64"] / r["extractor_fp32_bytes"]
        table.add_row(r["model"], str(r["d"]), f"{r['numbers']:,}", human_bytes(r["message_bytes_float64"]),
                      human_bytes(r["message_bytes_float32"]), f"{ratio:.2f}x",
                      f"{r['client_seconds_float64']:.2f}", f"{r['coordinator_seconds_float64']:.3f}")
    console.print(table)


# ----------------------------------------------------------------------------- the matrix runs


def _mean_last(values: list[float]) -> float:
    tail = values[-LAST_ROUNDS:]
    return sum(tail) / len(tail)


def _run_figures(record: dict[str, Any], derived: bool = False) -> dict[str, Any]:
    """One run's figures; ``derived``: a sphere run read off its sphere+ffc twin (before calibration)."""
    trained = [r for r in _accuracy_rows(record, derived) if r["round"] > 0]
    rows = [r for r in trained if r.get("test_accuracy") is not None]   # the evaluated rounds (eval.every)
    accs = [r["test_accuracy"] for r in rows]
    last = rows[-1]
    # How far the uncalibrated model swings between evaluations over the second half of the run:
    # the pull of the last round's clients' label mix, which a calibration on all clients removes.
    uncalibrated = [r.get("ffc_accuracy_before", r["test_accuracy"]) for r in rows if 2 * r["round"] >= record["rounds"]]
    fig: dict[str, Any] = {"seed": record["seed"], "rounds": record["rounds"], "last": accs[-1],
                           "swing_std": statistics.pstdev(uncalibrated) if len(uncalibrated) > 1 else 0.0,
                           "swing_range": max(uncalibrated) - min(uncalibrated),
                           "last5": _mean_last(accs), "best": max(accs),
                           "classifier_bytes_saved_per_round": statistics.fmean(r.get("classifier_bytes_saved", 0)
                                                                                for r in trained),
                           # the training phase's upload: without the FFC results sent in the same round
                           "bytes_up_per_round": statistics.fmean(r["bytes_up"] - r.get("ffc_bytes_up", 0)
                                                                  for r in trained),
                           # the whole run, FFC's extra pass counted: a row without it is compared on these too
                           "train_participations": sum(r.get("returned", 0) for r in trained),
                           "ffc_participations": 0 if derived else sum(r.get("ffc_returned", 0) for r in trained),
                           "run_bytes_up": sum(r["bytes_up"] - (r.get("ffc_bytes_up", 0) if derived else 0)
                                               for r in trained),
                           "run_bytes_down": sum(r["bytes_down"] - (r.get("ffc_bytes_down", 0) if derived else 0)
                                                 for r in trained),
                           "ffc_run_bytes_up": 0 if derived else sum(r.get("ffc_bytes_up", 0) for r in trained),
                           "ffc_run_bytes_down": 0 if derived else sum(r.get("ffc_bytes_down", 0) for r in trained)}
    if "ffc_accuracy_after" in last and not derived:
        fig.update({k: last[k] for k in ("ffc_accuracy_before", "ffc_accuracy_after", "ffc_ridge", "ffc_singular",
                                         "ffc_client_seconds_max", "ffc_coordinator_seconds", "ffc_stats_numbers")})
        fig["ffc_gain"] = last["ffc_accuracy_after"] - last["ffc_accuracy_before"]
        fig["ffc_bytes_up_per_client"] = last["ffc_bytes_up"] // max(last["ffc_returned"], 1)
    return fig


def read_runs(results: Path, matrix: str = "spherefed") -> list[dict[str, Any]]:
    """The matrix's run files, read once for the table and the twin check."""
    return [json.loads(p.read_text()) for p in sorted((results / matrix).glob("*.json"))]


def collect(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Table rows (cell, method) with figures averaged over the seeds present."""
    runs: dict[tuple[str, str, int, int], tuple[dict[str, Any], bool]] = {}
    for rec in records:
        cell, method = "/".join(rec["labels"][:-1]), rec["labels"][-1]
        runs[(cell, method, rec["seed"], rec["rounds"])] = (rec, False)
    for (cell, method, seed, rounds), (rec, _) in list(runs.items()):
        if method == "sphere+ffc" and (cell, "sphere", seed, rounds) not in runs:
            runs[(cell, "sphere", seed, rounds)] = (rec, True)
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for (cell, method, seed, rounds), (rec, derived) in runs.items():
        groups.setdefault((cell, method, rounds), []).append({**_run_figures(rec, derived), "derived": derived})
    order = ["fedavg", "fedavg+ffc", "sphere", "sphere+ffc", "sphere+ffc+pan", "sphere+ffc+top10"]
    table = []
    for (cell, method, rounds), figs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][2],
                                                                              order.index(kv[0][1])
                                                                              if kv[0][1] in order else 99)):
        figs.sort(key=lambda f: f["seed"])
        row: dict[str, Any] = {"cell": cell, "method": method, "rounds": rounds, "seeds": [f["seed"] for f in figs],
                               "derived_from_sphere_ffc": any(f["derived"] for f in figs)}
        for key in figs[0]:
            if key not in ("seed", "rounds", "derived") and all(isinstance(f.get(key), (int, float))
                                                                and not isinstance(f.get(key), bool) for f in figs):
                row[key] = statistics.fmean(f[key] for f in figs)
        for key in ("last", "last5", "best", "ffc_accuracy_before", "ffc_accuracy_after", "ffc_gain"):
            values = [f[key] for f in figs if key in f]
            if len(values) == len(figs) > 1:
                row[f"{key}_std"] = statistics.pstdev(values)   # population std over seeds, as run_matrix
        row["per_seed"] = figs
        table.append(row)
    add_rounds_to_fedavg(table, runs)
    add_gaps_to_fedavg(table)
    return table


def rate_choice(records: list[dict[str, Any]], protocol_records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rate tuning's choice, made as FedAvg's rate was (bench/matrices/tuning.toml): per rate, the mean of
    the last 5 evaluations averaged over the alphas, seed 0, with the protocol's constant 0.02 read from the
    SphereFed matrix's ``cnn`` ``sphere+ffc`` seed-0 runs; the calibrated last round and the best evaluation
    beside it. Sorted best first; ``chosen`` marks the first."""
    by_rate: dict[str, dict[str, dict[str, Any]]] = {}
    for rec in records:
        alpha, rate = rec["labels"][0], rec["labels"][-1]
        by_rate.setdefault(rate, {})[alpha] = _run_figures(rec)
    for rec in protocol_records:
        if rec["labels"][1:] == ["cnn", "sphere+ffc"] and rec["seed"] == 0 and rec["rounds"] == 100:
            by_rate.setdefault("lr0.02", {})[rec["labels"][0]] = _run_figures(rec)
    alphas = sorted({a for figs in by_rate.values() for a in figs})
    rows = [{"rate": rate, "alphas": {a: {k: figs[a][k] for k in ("last5", "last", "best")} for a in alphas},
             "selection": statistics.fmean(figs[a]["last5"] for a in alphas)}
            for rate, figs in by_rate.items() if set(figs) == set(alphas)]
    rows.sort(key=lambda r: -r["selection"])
    for i, row in enumerate(rows):
        row["chosen"] = i == 0
    return rows


def print_rate_choice(console: Console, rows: list[dict[str, Any]]) -> None:
    alphas = sorted(rows[0]["alphas"]) if rows else []
    table = Table(title="SphereFed + FFC's own learning rate, cnn, seed 0 (accuracy in %): chosen by the mean of the "
                        "last 5 evaluations over both alphas, as FedAvg's was")
    for column in ["rate", "selection", *(f"{a} {k}" for a in alphas for k in ("last 5", "last round", "best"))]:
        table.add_column(column, justify="left" if column == "rate" else "right")
    for row in rows:
        table.add_row(row["rate"] + (" (chosen)" if row["chosen"] else ""), f"{100 * row['selection']:.2f}",
                      *(f"{100 * row['alphas'][a][k]:.2f}" for a in alphas for k in ("last5", "last", "best")))
    console.print(table)


# A row's figure against FedAvg's in the same cell and seed: (row's metric, FedAvg's metric). The first three
# compare like with like; the last three are the calibrated round against each of FedAvg's figures.
GAPS = {"last5": ("last5", "last5"), "last": ("last", "last"), "best": ("best", "best"),
        "last_vs_last5": ("last", "last5"), "last_vs_best": ("last", "best")}


def add_gaps_to_fedavg(table: list[dict[str, Any]]) -> None:
    """Per seed, each row's figures minus FedAvg's in the same cell (``gap_<name>``, mean and per seed):
    a headline that puts a row's round 100 against FedAvg's mean of the last 5 mixes two metrics, and
    these show each comparison on its own."""
    fedavg = {(r["cell"], r["rounds"]): {f["seed"]: f for f in r["per_seed"]} for r in table
              if r["method"] == "fedavg"}
    for row in table:
        base = fedavg.get((row["cell"], row["rounds"]))
        if not base or row["method"] == "fedavg":
            continue
        for name, (mine, theirs) in GAPS.items():
            per_seed = [f[mine] - base[f["seed"]][theirs] for f in row["per_seed"] if f["seed"] in base]
            if per_seed:
                row[f"gap_{name}"] = statistics.fmean(per_seed)
                row[f"gap_{name}_per_seed"] = per_seed


def twin_check(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where a sphere run and its sphere+ffc twin both ran: the largest difference of their test accuracies
    over the evaluated rounds (the calibrated round read as before). Zero means the derived rows are exact."""
    by_key = {(tuple(r["labels"]), r["seed"], r["rounds"]): r for r in records}
    checks = []
    for (labels, seed, rounds), rec in sorted(by_key.items()):
        twin = by_key.get(((*labels[:-1], "sphere+ffc"), seed, rounds))
        if labels[-1] != "sphere" or twin is None:
            continue
        own = {r["round"]: r["test_accuracy"] for r in rec["rows"] if r.get("test_accuracy") is not None}
        derived = {r["round"]: r["test_accuracy"] for r in _accuracy_rows(twin, True)
                   if r.get("test_accuracy") is not None}
        common = sorted(set(own) & set(derived))
        checks.append({"cell": "/".join(labels[:-1]), "seed": seed, "rounds": rounds, "compared": len(common),
                       "max_abs_difference": max((abs(own[k] - derived[k]) for k in common), default=None)})
    return checks


def add_rounds_to_fedavg(table: list[dict[str, Any]], runs: dict[tuple[str, str, int, int], tuple[dict, bool]]) -> None:
    """Per seed, the first round a row reached FedAvg's final accuracy (its mean of the last rounds) in
    the same cell: the harness's ``rounds to baseline``, here with the derived sphere rows too."""
    targets = {(r["cell"], r["rounds"]): r["last5"] for r in table if r["method"] == "fedavg"}
    for row in table:
        target = targets.get((row["cell"], row["rounds"]))
        row["rounds_to_fedavg_final"] = [rounds_to_reach(_accuracy_rows(*runs[(row["cell"], row["method"], seed,
                                                                               row["rounds"])]), target)
                                         for seed in row["seeds"]]


def _accuracy_rows(record: dict[str, Any], derived: bool) -> list[dict[str, Any]]:
    """A run's rows; for a sphere row derived from its sphere+ffc twin, the calibrated round reads as before."""
    if not derived:
        return record["rows"]
    return [{**r, "test_accuracy": r["ffc_accuracy_before"]} if "ffc_accuracy_before" in r else r
            for r in record["rows"]]


def print_verdict(console: Console, rows: list[dict[str, Any]]) -> None:
    """Every row on the same three figures, its gaps over FedAvg on each, and what its run sent in all."""
    table = Table(title="Like with like: every row on the same figures; gaps over FedAvg per seed, in points; "
                        "the whole run's participations and upload, FFC's extra pass included")
    for name in ("cell", "method", f"last {LAST_ROUNDS}", "last round", "best", f"Δ last {LAST_ROUNDS}",
                 "Δ last round", "Δ best", "last round - FedAvg's best", "participations (train + FFC)",
                 "up (FFC)", "down (FFC)"):
        table.add_column(name, justify="left" if name in ("cell", "method") else "right")

    def pct(r: dict[str, Any], key: str) -> str:
        if r.get(key) is None:
            return ""
        return f"{100 * r[key]:.2f}" + (f" ± {100 * r[key + '_std']:.2f}" if key + "_std" in r else "")

    def gap(r: dict[str, Any], name: str) -> str:
        per_seed = r.get(f"gap_{name}_per_seed")
        return "" if not per_seed else "/".join(f"{100 * g:+.1f}" for g in per_seed)

    for r in rows:
        extra = r.get("ffc_participations", 0)
        method = r["method"] + (" *" if r["derived_from_sphere_ffc"] else "")
        table.add_row(f"{r['cell']} r{r['rounds']}", method, pct(r, "last5"), pct(r, "last"), pct(r, "best"),
                      gap(r, "last5"), gap(r, "last"), gap(r, "best"),
                      gap(r, "last_vs_best"),
                      f"{r.get('train_participations', 0):.0f} + {extra:.0f}",
                      f"{human_bytes(r.get('run_bytes_up', 0))} ({human_bytes(r.get('ffc_run_bytes_up', 0))})",
                      f"{human_bytes(r.get('run_bytes_down', 0))} ({human_bytes(r.get('ffc_run_bytes_down', 0))})")
    console.print(table)
    console.print(f"last {LAST_ROUNDS}: mean of the last {LAST_ROUNDS} evaluations (the protocol's final figure; "
                  "for FFC rows only the last of them is calibrated); last round: the last evaluation (calibrated "
                  "for FFC rows); best: the best evaluation of the run. Δ: the row minus FedAvg in the same cell, "
                  "seed by seed, on the same figure. Participations and bytes: means over seeds of whole runs.")


def print_report(console: Console, rows: list[dict[str, Any]]) -> None:
    table = Table(title="SphereFed on Fashion-MNIST (accuracy in %, mean ± population std over seeds)")
    for name in ("cell", "method", "rounds", "seeds", "last", f"last {LAST_ROUNDS}", "FFC before", "FFC after",
                 "gain", "rounds to FedAvg", "swing", "classifier saved/round", "FFC up/client", "FFC client s",
                 "FFC coord s"):
        table.add_column(name, justify="left" if name in ("cell", "method") else "right")

    def pct(r: dict[str, Any], key: str, sign: str = "") -> str:
        if r.get(key) is None:
            return ""
        spread = f" ± {100 * r[key + '_std']:.2f}" if key + "_std" in r else ""
        return f"{100 * r[key]:{sign}.2f}{spread}"

    for r in rows:
        saved = r.get("classifier_bytes_saved_per_round") or 0
        reached = ",".join("-" if n is None else str(n) for n in r["rounds_to_fedavg_final"])
        table.add_row(r["cell"], r["method"] + (" *" if r["derived_from_sphere_ffc"] else ""), str(r["rounds"]),
                      ",".join(map(str, r["seeds"])), pct(r, "last"), pct(r, "last5"), pct(r, "ffc_accuracy_before"),
                      pct(r, "ffc_accuracy_after"), pct(r, "ffc_gain", "+"), reached, pct(r, "swing_std"),
                      human_bytes(saved) if saved else "",
                      human_bytes(r["ffc_bytes_up_per_client"]) if "ffc_bytes_up_per_client" in r else "",
                      f"{r['ffc_client_seconds_max']:.2f}" if "ffc_client_seconds_max" in r else "",
                      f"{r['ffc_coordinator_seconds']:.3f}" if "ffc_coordinator_seconds" in r else "")
    console.print(table)
    if any(r["derived_from_sphere_ffc"] for r in rows):
        console.print("* from the sphere+ffc run of the same cell and seed: identical training, accuracy before "
                      "calibration")
    console.print("swing: std of the uncalibrated test accuracy over the evaluations of the run's second half")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=6000, help="training images of the client whose cost is "
                                                                  "measured (Fashion-MNIST / 10 clients = 6000)")
    parser.add_argument("--skip-cost", action="store_true", help="only rebuild the accuracy table")
    parser.add_argument("--skip-report", action="store_true", help="only measure the cost")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--matrix", default="spherefed",
                        help="the matrix whose run files to read (spherefed, or spherefed_lr for the rate tuning); "
                             "the report is written to RESULTS/MATRIX_ffc.json")
    args = parser.parse_args()
    console = Console(width=None if sys.stdout.isatty() else 170)
    path = args.results / f"{args.matrix}_ffc.json"
    report: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    report["machine"] = {"python": platform.python_version(), "arch": platform.machine(), "cpus": os.cpu_count(),
                         "torch": torch.__version__}
    if not args.skip_cost:
        torch.set_num_threads(1)
        report["cost"] = [measure_cost(name, args.samples) for name in ("cnn", "vgg9")]
    if report.get("cost"):
        print_cost(console, report["cost"])
    if not args.skip_report:
        records = read_runs(args.results, args.matrix)
        report["accuracy"] = collect(records)
        report["final_accuracy"] = (f"last: the last round's test accuracy (after calibration for FFC runs); "
                                    f"last {LAST_ROUNDS}: mean of the last {LAST_ROUNDS} rounds' test accuracy")
        report["twin_check"] = twin_check(records)
        if args.matrix == "spherefed_lr":
            report["rate_choice"] = rate_choice(records, read_runs(args.results, "spherefed"))
    if report.get("accuracy"):
        print_report(console, report["accuracy"])
        print_verdict(console, report["accuracy"])
    if report.get("rate_choice"):
        print_rate_choice(console, report["rate_choice"])
    for check in report.get("twin_check", []):
        console.print(f"sphere against sphere+ffc before calibration, {check['cell']} seed {check['seed']}: "
                      f"{check['compared']} evaluated rounds, largest difference {check['max_abs_difference']}")
    args.results.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    console.print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
