"""A short real run, its HTML report, and a screenshot of the report in headless Chromium.

The run: SphereFed with its FFC calibration after the last round (two kinds of task,
``sphere_train`` and ``ffc_stats``) on digits with the ``cnn`` model, over a local Mosquitto.
Three clients are spawned by the coordinator on iid partitions; a fourth, ``dev-big``, is
started on its own on four times the digits train split (it holds more data, so its
rounds are longer though each sample costs it no more), and is stopped after round 2 and
started again a few seconds later, so the report has an offline span to show. After the
run every device's state directory gets an ONNX Runtime benchmark of the exported model
(``fedge-profile infer``). Then ``fedge-profile html`` writes the report and headless
Chromium screenshots it (``apt-get install chromium``). ``bench/screenshots.py report`` takes
this picture for docs/profiling.md, beside the dashboard's.

All four devices are processes on this one machine: the report's figures are this
machine's, labelled with the class and site each process was given.

    python bench/report_screenshot.py [--out DIR] [--png docs/images/report-sizing.png] [--rounds 5]
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from coordinator.config import load_config
from coordinator.ops.mosquitto import LocalMosquitto
from coordinator.runtime.run import run_federated
from edge_client.data import load_dataset
from profiling.html import render_html
from profiling.runs import load

PREFIX = "sizing"
BIG_ENV = {"FEDGE_DEVICE_CLASS": "x86-4x-data", "FEDGE_SITE": "desk"}   # dev-big's class and site
MAX_PNG_BYTES = 250 * 1024   # the docs' images stay small


def _client(broker: str, out: Path, data: Path) -> subprocess.Popen:
    env = {**os.environ, **BIG_ENV}
    return subprocess.Popen([sys.executable, "-m", "edge_client.cli", "run", "--broker", broker, "--client-id",
                             "dev-big", "--data", f"npz:{data}", "--prefix", PREFIX, "--state-dir",
                             str(out / "clients" / "dev-big"), "--torch-threads", "1", "--exit-after-run"], env=env)


def _rounds_done(out: Path) -> int:
    metrics = out / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) - 1 if metrics.is_file() else 0


def _bounce(broker: str, out: Path, data: Path, after_round: int, away: float, procs: list) -> None:
    """Stop dev-big once ``after_round`` rounds are done, and start it again ``away`` seconds later."""
    while _rounds_done(out) < after_round:
        if procs[-1].poll() is not None:
            return
        time.sleep(0.2)
    procs[-1].terminate()
    procs[-1].wait(timeout=60)
    time.sleep(away)
    procs.append(_client(broker, out, data))


def produce_run(work: Path, rounds: int) -> Path:
    """Run the federation described above in ``work``; return the run directory."""
    digits = load_dataset("digits")
    big = work / "big.npz"
    np.savez(big, x=np.tile(digits.x_train, (4, 1, 1, 1)), y=np.tile(digits.y_train, 4),
             x_test=digits.x_test, y_test=digits.y_test)
    out = work / "run"
    os.environ["FEDGE_SITE"] = "rack"   # the spawned clients inherit it; their class is their architecture
    with LocalMosquitto(workdir=work / "mosquitto") as broker:
        procs = [_client(broker.url, out, big)]
        bouncer = threading.Thread(target=_bounce, args=(broker.url, out, big, 2, 6.0, procs), daemon=True)
        bouncer.start()
        try:
            config = load_config(None, [
                ("run", "strategy", "spherefed"), ("run", "rounds", rounds), ("run", "out", str(out)),
                ("model", "name", "cnn"), ("model", "head", "sphere"), ("data", "eval", "digits"),
                ("clients", "expected", 4), ("clients", "spawn", 3), ("clients", "min_results", 3),
                ("clients", "round_timeout", 30.0), ("clients", "presence_timeout", 60.0),
                ("transport", "broker", broker.url), ("transport", "prefix", PREFIX)])
            run_federated(config, say=print)
        finally:
            bouncer.join(timeout=90)
            for proc in procs:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.terminate()
    return out


def benchmark_inference(run: Path) -> None:
    """``fedge-profile infer`` of the exported model into each device's state directory under ``clients/``."""
    model = run / "export" / "model.onnx"
    for state in sorted(p for p in (run / "clients").iterdir() if p.is_dir()):
        env = {**os.environ, **(BIG_ENV if state.name == "dev-big" else {})}   # the facts it records are its own
        subprocess.run([sys.executable, "-m", "profiling.cli", "infer", str(model), "--state-dir", str(state),
                        "--runs", "100", "--warmup", "10"], check=True, env=env)


def screenshot(html: Path, png: Path, width: int = 1400, height: int = 2400) -> bool:
    """Headless Chromium's picture of the top of ``html``; False when chromium is not installed."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("chromium is not installed (apt-get install chromium): no screenshot", file=sys.stderr)
        return False
    png.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--screenshot={png}", f"--window-size={width},{height}", html.resolve().as_uri()],
                   check=True, capture_output=True, timeout=120)
    _shrink(png)
    return True


def _shrink(png: Path) -> None:
    """Quantize the screenshot to a palette when it is over :data:`MAX_PNG_BYTES` (a report is mostly flat
    colours, so 256 of them keep it legible)."""
    if png.stat().st_size <= MAX_PNG_BYTES:
        return
    from PIL import Image

    with Image.open(png) as image:
        buffer = io.BytesIO()
        image.convert("RGB").quantize(colors=256).save(buffer, format="PNG", optimize=True)
    png.write_bytes(buffer.getvalue())


def make_report(work: Path, png: Path, *, rounds: int = 5, run: Path | None = None) -> Path:
    """Produce the run in ``work`` (or take ``run``), write its report to ``work/report.html`` and
    screenshot it to ``png``; return ``png``. Chromium missing is an error here (the caller asked for a picture)."""
    if run is None:
        run = produce_run(work, rounds)
        benchmark_inference(run)
    html = work / "report.html"
    html.write_text(render_html(load(run)), encoding="utf-8")
    print(f"run {run}\nreport {html}")
    if not screenshot(html, png):
        raise RuntimeError("chromium is not installed (apt-get install chromium): no screenshot")
    return png


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="work directory (default: a new temporary one)")
    parser.add_argument("--png", type=Path, default=Path("report-sizing.png"), help="screenshot to write")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--run", type=Path, default=None, help="render this run directory instead of producing one")
    args = parser.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="fedge-report-"))
    work.mkdir(parents=True, exist_ok=True)
    png = make_report(work, args.png, rounds=args.rounds, run=args.run)
    print(f"screenshot {png} ({png.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
