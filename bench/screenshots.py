"""The docs' two screenshots, each of a real run, taken by headless Chromium.

``report``: the HTML profiling report of ``bench/report_screenshot.py``'s short SphereFed run
(its run, render and screenshot, called as they are), written to ``IMAGES/report-sizing.png``
for docs/profiling.md.

``dashboard``: ``deploy/grafana-fedge.json`` over a real run, for docs/monitoring.md. A local
Mosquitto, a real Prometheus (``/usr/bin/prometheus``, ``apt-get install prometheus``) scraping
every second, a coordinator (``fedge-coordinator run --metrics-port``: FedAvg, the ``cnn`` on
digits, 4 spawned clients at site ``lab``, 3 of the devices online a round for 4 local epochs, 15
rounds) and one aggregation worker (``fedge-coordinator worker --metrics-port``) so the worker
panels have data. A fifth device, ``dev-desk`` at site ``desk``, started beside them, is
stopped once it has answered 3 tasks, so the fleet panels show a device leave.
After the run, every panel of the dashboard file is drawn at its ``gridPos`` from its own PromQL
queries, evaluated by that Prometheus (``bench/dashboard_render.py``: ``$instance`` is the
variable's "All" value ``.*``, ``$__rate_interval`` Grafana's rule for a 1 s scrape; the time
range from 10 s before the first device came online to the run's end), into one HTML page that
Chromium screenshots to ``IMAGES/dashboard.png``. Grafana itself is not involved (it is not
packaged for this machine); it draws the same queries. The privacy panel stays "No data": the run
has no differential privacy, which aggregation workers cannot run with.

Every process started here (broker, Prometheus, coordinator, its clients, the worker) is stopped
by its PID when the script ends, on errors, Ctrl-C and SIGTERM too; the temporary directory is
removed unless ``--out`` names one to keep.

    python bench/screenshots.py [report] [dashboard] [--images docs/images] [--out DIR] [--rounds N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dashboard_render import first_sample, page_height, render_dashboard  # noqa: E402
from report_screenshot import make_report, screenshot  # noqa: E402

from coordinator.config import dump_config, load_config  # noqa: E402
from coordinator.ops.broker import free_port  # noqa: E402
from coordinator.ops.mosquitto import LocalMosquitto  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana-fedge.json"
SCRAPE_SECONDS = 1
WIDTH = 1400             # px: the page, and Chromium's window
PREFIX = "dashboard"
PACKET_BYTES = 8 * 1024 * 1024   # a worker needs results unchunked
SITE = "lab"                     # the spawned clients' site (their class is their architecture)
VISITOR, VISITOR_SITE, VISITOR_TASKS = "dev-desk", "desk", 3   # a device that leaves after 3 tasks
LEAD_SECONDS = 10        # the time range starts this long before the first device is online
PROMETHEUS_CONFIG = """global:
  scrape_interval: {scrape}s
  evaluation_interval: {scrape}s
scrape_configs:
  - job_name: fedge
    static_configs:
      - targets: ["127.0.0.1:{coordinator}", "127.0.0.1:{worker}"]
"""


@contextlib.contextmanager
def _process(args: list[str], log: Path, *, env: dict[str, str] | None = None, stop_timeout: float = 20.0):
    """``args`` as a child process writing to ``log``; on leaving, it and any children it started (the
    coordinator's spawned clients) are terminated by PID, then killed if they outlive ``stop_timeout``."""
    with log.open("w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        yield proc
    finally:
        try:
            family = [proc.pid] + [child.pid for child in psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        procs = []
        for pid in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                procs.append(psutil.Process(pid))
                procs[-1].terminate()
        _, alive = psutil.wait_procs(procs, timeout=stop_timeout)
        for leftover in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                leftover.kill()
        proc.wait()


def _wait_for_url(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}: see {log}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2):
                return
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s: see {log}")


def _visitor_args(broker: str, work: Path) -> list[str]:
    return [sys.executable, "-m", "edge_client.cli", "run", "--broker", broker, "--client-id", VISITOR, "--data",
            "digits", "--partition", "dirichlet:0.5", "--partition-index", "0", "--num-partitions", "4", "--seed", "1",
            "--prefix", PREFIX, "--state-dir", str(work / VISITOR), "--torch-threads", "1",
            "--max-message-bytes", str(PACKET_BYTES), "--exit-after-run"]


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _wait_until(done, coordinator: subprocess.Popen) -> bool:
    """Poll ``done()`` while the run goes; False when the run ended first."""
    while not done():
        if coordinator.poll() is not None:
            return False
        time.sleep(0.2)
    return True


@contextlib.contextmanager
def monitored_run(work: Path, rounds: int):
    """Yield (Prometheus URL, start, end) once a run watched by Prometheus is over; Prometheus and the
    broker stop when the context ends."""
    prometheus_bin = shutil.which("prometheus")
    if prometheus_bin is None:
        raise RuntimeError("prometheus is not installed: apt-get install prometheus (or put its binary on PATH)")
    coordinator_port, worker_port, prometheus_port = free_port(), free_port(), free_port()
    (work / "prometheus.yml").write_text(PROMETHEUS_CONFIG.format(scrape=SCRAPE_SECONDS, coordinator=coordinator_port,
                                                                 worker=worker_port))
    prometheus_url = f"http://127.0.0.1:{prometheus_port}"
    with contextlib.ExitStack() as stack:
        broker = stack.enter_context(LocalMosquitto(workdir=work / "mosquitto"))
        config = load_config(None, [
            ("run", "strategy", "fedavg"), ("run", "rounds", rounds), ("run", "out", str(work / "run")),
            ("run", "seed", 0), ("model", "name", "cnn"), ("data", "eval", "digits"),
            ("data", "partition", "dirichlet:0.5"), ("clients", "expected", 4), ("clients", "spawn", 4),
            ("clients", "per_round", 3), ("train", "epochs", 4), ("clients", "round_timeout", 60.0),
            ("workers", "count", 1),
            ("transport", "broker", broker.url), ("transport", "prefix", PREFIX),
            ("transport", "max_message_bytes", PACKET_BYTES)])
        dump_config(config, work / "run.toml")
        prometheus = stack.enter_context(_process(
            [prometheus_bin, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prometheus_port}"], work / "prometheus.log"))
        _wait_for_url(f"{prometheus_url}/-/ready", prometheus, work / "prometheus.log")
        start = time.time()
        stack.enter_context(_process(
            [sys.executable, "-m", "coordinator.ui.cli", "worker", "--config", str(work / "run.toml"), "--id",
             "worker-1", "--exit-after-run", "--metrics-port", str(worker_port)], work / "worker.log"))
        with _process([sys.executable, "-m", "coordinator.ui.cli", "run", "--config", str(work / "run.toml"),
                       "--metrics-port", str(coordinator_port)], work / "coordinator.log",
                      env={**os.environ, "FEDGE_SITE": SITE}) as coordinator:
            answers = work / "run" / "clients" / f"{VISITOR}.jsonl"
            with _process(_visitor_args(broker.url, work), work / "visitor.log",
                          env={**os.environ, "FEDGE_SITE": VISITOR_SITE}):
                _wait_until(lambda: _lines(answers) >= VISITOR_TASKS, coordinator)
            # leaving stops it: it finishes the task at hand, and its will says it is offline
            if coordinator.wait(timeout=60 * rounds + 300) != 0:
                raise RuntimeError(f"the run failed: see {work / 'coordinator.log'}")
        time.sleep(3 * SCRAPE_SECONDS)   # the range ends a few scrapes after the run, where its series stop
        end = time.time()
        yield prometheus_url, start, end


def take_dashboard(work: Path, images: Path, rounds: int) -> Path:
    """The dashboard drawn over a monitored run, screenshot to ``images/dashboard.png``."""
    with monitored_run(work, rounds) as (prometheus, start, end):
        # the time range a user would pick: from shortly before the first device came online (the minute
        # before it, Python starting and the clients loading torch, shows only the coordinator waiting)
        arrival = first_sample(prometheus, "sum(fedge_devices_online)", start, end, SCRAPE_SECONDS)
        start = max(start, (arrival or start) - LEAD_SECONDS)
        page = render_dashboard(DASHBOARD, prometheus, start, end, scrape_seconds=SCRAPE_SECONDS, width=WIDTH,
                                note="deploy/grafana-fedge.json's panels and queries, evaluated by Prometheus, "
                                     "drawn by bench/screenshots.py (not Grafana)")
    html = work / "dashboard.html"
    html.write_text(page, encoding="utf-8")
    png = images / "dashboard.png"
    if not screenshot(html, png, width=WIDTH, height=page_height(json.loads(DASHBOARD.read_text())["panels"])):
        raise RuntimeError("chromium is not installed (apt-get install chromium): no screenshot")
    return png


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:-1]))
    parser.add_argument("which", nargs="*", metavar="report|dashboard",
                        help="the screenshots to take (default: both)")
    parser.add_argument("--images", type=Path, default=ROOT / "docs" / "images", help="where the PNGs go")
    parser.add_argument("--out", type=Path, default=None,
                        help="work directory, kept (default: a temporary one, removed at the end)")
    parser.add_argument("--rounds", type=int, default=15, help="rounds of the dashboard's run (the report's: 5)")
    args = parser.parse_args()
    which = args.which or ["report", "dashboard"]
    unknown = sorted(set(which) - {"report", "dashboard"})
    if unknown:
        parser.error(f"unknown screenshot {unknown}: say report, dashboard or both")
    # SIGTERM (a CI timeout, kill PID) leaves through the finally blocks too: they stop every process started here
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    work = args.out or Path(tempfile.mkdtemp(prefix="fedge-screenshots-"))
    try:
        if "report" in which:
            (work / "report").mkdir(parents=True, exist_ok=True)
            png = make_report(work / "report", args.images / "report-sizing.png", rounds=5)
            print(f"report screenshot {png} ({png.stat().st_size // 1024} KiB)")
        if "dashboard" in which:
            (work / "dashboard").mkdir(parents=True, exist_ok=True)
            png = take_dashboard(work / "dashboard", args.images, args.rounds)
            print(f"dashboard screenshot {png} ({png.stat().st_size // 1024} KiB)")
    finally:
        if args.out is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
