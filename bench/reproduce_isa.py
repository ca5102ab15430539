"""What the instruction set does to a cell's bits, measured: one short cell run twice under each setting.

``bench/reproduce.py`` promises the same bits on the same instruction set. This runs one cell of a matrix
(``bench/run_matrix.py``, a few rounds, off the protocol) twice unpinned and twice under each pin of
``bench/isa.py``, every run in a Python process of its own (a pin is read when torch loads), and compares
every learning metric of every round and the final model's hash: within a setting (the same bits, or a
regression the harness cannot hide behind the CPU) and across settings (whether the set alone moves the
bits). Before the runs, a small probe under each setting reads what each library says it uses: torch's
CPU capability, oneDNN's ISA (``ONEDNN_VERBOSE``) and MKL's branch (``MKL_VERBOSE``), so a pin that did
not take effect shows. The figures go to ``bench/results/reproduce_isa.json`` and are printed.

    nice -n 10 python bench/reproduce_isa.py            # about 4 minutes on 2 busy cores
    python bench/reproduce_isa.py --report              # print the figures written
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

import isa
from reproduce import first_difference

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "reproduce_isa.json"
CELL = {"matrix": "bench/matrices/server_opt.toml", "only": "a0.1/fedavg/s0", "seed": 0, "rounds": 3}
COMMAND = "nice -n 10 python bench/reproduce_isa.py"

__all__ = ["compare", "probe_in_force", "measure", "main"]


def _probe() -> None:
    """Run a convolution (oneDNN) and a matrix product (MKL) so that both libraries say, in their verbose output,
    which instruction set they use; print torch's CPU capability as JSON."""
    import torch

    torch.nn.functional.conv2d(torch.ones(16, 1, 28, 28), torch.ones(32, 1, 3, 3))   # large enough for oneDNN
    torch.ones(64, 64) @ torch.ones(64, 64)
    print(json.dumps({"torch": torch.backends.cpu.get_cpu_capability()}))


def probe_in_force(setting: str) -> dict[str, str | None]:
    """What torch, oneDNN and MKL use in a new process under ``setting`` (a pin, or "native")."""
    env = {**isa.pinned_environment(setting), "ONEDNN_VERBOSE": "1", "MKL_VERBOSE": "1"}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--probe"], env=env, capture_output=True,
                          text=True, timeout=300, check=True)
    onednn = re.search(r"^onednn_verbose,.*,cpu,isa:(.*)$", done.stdout, re.M)
    mkl = re.search(r"^MKL_VERBOSE SGEMM.* (CNR:\S+)", done.stdout, re.M)
    torch_line = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return {"torch": json.loads(torch_line[-1])["torch"] if torch_line else None,
            "onednn": onednn.group(1).strip() if onednn else None, "mkl": mkl.group(1) if mkl else None}


def _run_cell(setting: str, out: Path, cell: dict[str, Any]) -> dict[str, Any]:
    """Run ``cell`` once under ``setting`` through bench/run_matrix.py (a process of its own); its run file."""
    command = [sys.executable, str(HERE / "run_matrix.py"), str(HERE.parent / cell["matrix"]), "--only", cell["only"],
               "--rounds", str(cell["rounds"]), "--seeds", str(cell["seed"]), "--off-protocol", "--results", str(out),
               "--isa", setting]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    files = sorted(out.glob("*/*-r*.json"))
    if done.returncode != 0 or len(files) != 1:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n"
                           f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
    record = json.loads(files[0].read_text())
    record["wall_seconds"] = time.monotonic() - started
    return record


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two run files of one cell: bit-identical (every learning metric of every round and the model hash), or the
    first difference."""
    found = first_difference(a["rows"], b["rows"])
    same_hash = a.get("model_hash") == b.get("model_hash")
    return {"bit_identical": found is None and same_hash, "same_model_hash": same_hash,
            "first_difference": None if found is None else found.describe()}


def _summary(record: dict[str, Any]) -> dict[str, Any]:
    rows = record["rows"]
    accuracy = [r["test_accuracy"] for r in rows if r.get("test_accuracy") is not None]
    return {"model_hash": record["model_hash"], "train_loss": [r["train_loss"] for r in rows if "train_loss" in r],
            "final_test_accuracy": accuracy[-1] if accuracy else None,
            "round_seconds": [round(r["seconds"], 2) for r in rows if r.get("round", 0) > 0 and "seconds" in r],
            "torch_cpu_capability": record["machine"]["torch_cpu_capability"], "isa": record.get("isa")}


def measure(settings: list[str], repeats: int, cell: dict[str, Any], console: Console) -> dict[str, Any]:
    """Run the cell ``repeats`` times under each setting, one process at a time; the figures."""
    for setting in settings:
        isa.require(setting)
    found: dict[str, Any] = {}
    records: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="fedge-isa-") as scratch:
        for setting in settings:
            in_force = probe_in_force(setting)
            console.print(f"{setting}: torch {in_force['torch']}, oneDNN {in_force['onednn']}, MKL {in_force['mkl']}",
                          highlight=False)
            records[setting] = []
            for i in range(repeats):
                record = _run_cell(setting, Path(scratch) / f"{setting}-{i}", cell)
                records[setting].append(record)
                console.print(f"  run {i + 1}: model {record['model_hash'][7:19]}, train loss "
                              f"{record['rows'][-1].get('train_loss')!r}, {record['wall_seconds']:.0f} s",
                              highlight=False)
            found[setting] = {"env": isa.PINS.get(setting, {}), "in_force": in_force,
                              "runs": [_summary(r) for r in records[setting]],
                              "repeat": [compare(records[setting][0], r) for r in records[setting][1:]]}
    first = records[settings[0]][0]
    across = [{"a": a, "b": b, **compare(records[a][0], records[b][0])}
              for i, a in enumerate(settings) for b in settings[i + 1:]]
    return {"what": "one cell run repeatedly under each instruction-set setting, each run in a process of its own; "
                    "repeat: each later run against the first of its setting; across: the first runs of two settings",
            "command": COMMAND, "cell": cell, "repeats": repeats,
            "machine": {k: first["machine"][k] for k in ("arch", "cpus", "cpu_model", "cpu_id", "cpu_flags",
                                                         "cpu_caches")},
            "versions": first["versions"], "source": first["source"], "settings": found, "across": across,
            "same_setting_bit_identical": all(c["bit_identical"] for s in found.values() for c in s["repeat"]),
            "settings_that_differ": [f"{c['a']} / {c['b']}" for c in across if not c["bit_identical"]]}


def show(figures: dict[str, Any], console: Console) -> None:
    """The figures as two tables: each setting's runs, and each pair of settings."""
    m = figures["machine"]
    console.print(f"{figures['cell']['matrix']} {figures['cell']['only']}, {figures['cell']['rounds']} rounds, "
                  f"{figures['repeats']} runs per setting, on {m['cpu_model']} ({m['cpu_id']}), torch "
                  f"{figures['versions']['torch']}", highlight=False)
    table = Table("setting", "torch / oneDNN / MKL in force", "model hash per run", "final acc",
                  "last train loss", "repeats bit-identical")
    for name, s in figures["settings"].items():
        f = s["in_force"]
        table.add_row(name, f"{f['torch']} / {f['onednn']} / {f['mkl']}",
                      " ".join(r["model_hash"][7:19] for r in s["runs"]),
                      " ".join(f"{r['final_test_accuracy']:.4f}" for r in s["runs"]),
                      " ".join(repr(r["train_loss"][-1]) for r in s["runs"]),
                      "yes" if all(c["bit_identical"] for c in s["repeat"]) else
                      "; ".join(c["first_difference"] or "model hash" for c in s["repeat"] if not c["bit_identical"]))
    console.print(table)
    pairs = Table("settings", "bit-identical", "first difference")
    for c in figures["across"]:
        pairs.add_row(f"{c['a']} / {c['b']}", "yes" if c["bit_identical"] else "no", c["first_difference"] or "")
    console.print(pairs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join([isa.NATIVE, *isa.PINS]),
                        help=f"comma-separated: {isa.NATIVE} and pins of bench/isa.py (default: all)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per setting (default 2)")
    parser.add_argument("--rounds", type=int, default=CELL["rounds"], help=f"rounds per run (default {CELL['rounds']})")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"where the figures go (default {RESULTS})")
    parser.add_argument("--report", action="store_true", help="run nothing: print the figures in --out")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        _probe()
        return 0
    console = Console(width=None if sys.stdout.isatty() else 160)
    if not args.report:
        try:
            figures = measure(args.settings.split(","), args.repeats, {**CELL, "rounds": args.rounds}, console)
        except (isa.IsaError, RuntimeError) as exc:
            console.print(f"[red]{exc}[/red]", highlight=False)
            return 2
        args.out.write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")
        console.print(f"written to {args.out}")
    elif not args.out.exists():
        console.print(f"[red]{args.out} does not exist: run {COMMAND} first[/red]", highlight=False)
        return 2
    show(json.loads(args.out.read_text(encoding="utf-8")), console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
