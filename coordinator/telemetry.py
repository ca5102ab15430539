"""Prometheus metrics of a run and of an aggregation worker: a fleet you can watch while it trains.

Why: ``metrics.jsonl`` and ``clients/`` tell what a run did once it is over; a person running a
fleet wants to see it as it goes, on a dashboard with alerts (devices dropping off, results
rejected, rounds slowing down, devices running hot) and beside the rest of their machines.
Prometheus scrapes an HTTP endpoint; this module serves one, on request only (``[metrics]``,
``--metrics-port``), and invents no figure of its own:

- the round counters come from each ``metrics.jsonl`` row as it is written (:meth:`RunTelemetry.observe`
  is handed every row the run completes), so a counter equals the sum of its column over the rows
  this process wrote (Prometheus takes a restart as a counter reset), and the gauges their last
  value (a run on an app: its headline metric's ``test_NAME`` as ``fedge_headline_metric``);
- the devices online come from the presences the coordinator's roster holds, read at each scrape;
- the device percentiles come from the latest profile each online device sent with a result;
- a worker's counters are the ones it prints when it stops.

Each coordinator or worker has a registry of its own (not prometheus_client's global one), so several
in one process (tests, benchmarks) never collide. prometheus_client is imported only when metrics are
asked for: a coordinator without it runs as before, and one that asks for metrics without it is told
how to install it before anything starts (:func:`missing_library`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any

from coordinator.config_sections import MetricsSection
from coordinator.runtime.profiles import device_labels
from storage.errors import FedgeError

if TYPE_CHECKING:
    from coordinator.config import RunConfig
    from coordinator.runtime.presence import Roster
    from coordinator.runtime.profiles import ProfileStore
    from edge_client.app import App

__all__ = ["MetricsError", "MetricsServer", "RunTelemetry", "WorkerTelemetry", "run_telemetry", "missing_library",
           "QUANTILES", "DEVICE_FIGURES", "ROW_FIGURES", "HEADLINE_GAUGE"]

log = logging.getLogger("fedge.coordinator")

QUANTILES = (0.5, 0.9, 0.99)
# metric name -> (the profile field it is read from, what it says); over the online devices' latest training
# profiles (ProfileStore.latest)
DEVICE_FIGURES = {
    "fedge_device_task_seconds": ("seconds", "Seconds a device took for its last training task, as it measured "
                                             "them"),
    "fedge_device_step_seconds": ("step_p50", "Median seconds of one training step in a device's last training "
                                              "task"),
    "fedge_device_peak_memory_bytes": ("peak_rss_bytes", "Peak resident memory of a device's last training task"),
    "fedge_device_temperature_celsius": ("temperature_c", "CPU temperature a device read after its last training "
                                                          "task"),
}
# a row's column -> the gauge holding its last value
ROW_FIGURES = {
    "test_accuracy": ("fedge_test_accuracy", "Test-set accuracy of the last evaluated global model"),
    "test_loss": ("fedge_test_loss", "Test-set loss of the last evaluated global model"),
    "train_loss": ("fedge_train_loss", "The devices' training loss in the last round, sample-weighted"),
    "dp_epsilon": ("fedge_dp_epsilon", "Differential privacy spent so far (epsilon at privacy.delta; with "
                   "privacy on)"),
}
# a run on an app: the gauge holding the last value of its headline metric's column (test_NAME)
HEADLINE_GAUGE = ("fedge_headline_metric", ("A run on an app: its headline metric (the metric label; higher_is_better "
                                            "says its direction) of the last evaluated global model"))
MAX_GROUPS = 100   # (class, site) pairs shown apiece; the rest are summed under "other": devices choose them
ROUND_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)


class MetricsError(FedgeError, RuntimeError):
    """The metrics endpoint cannot be served; the message says what to change."""


missing_library = MetricsSection.missing_library


def _prometheus() -> Any:
    """prometheus_client, or MetricsError saying how to install it."""
    try:
        import prometheus_client
    except ImportError:
        raise MetricsError(missing_library() or "prometheus-client does not import: reinstall it "
                                                "(pip install --force-reinstall prometheus-client)") from None
    return prometheus_client


class MetricsServer:
    """An HTTP endpoint serving one registry at ``/metrics``, on a thread of its own until :meth:`close`.

    prometheus_client's own ``start_http_server`` can be neither stopped nor asked for its port in every
    version the coordinator extra allows; its WSGI app on the standard library's server can.
    """

    def __init__(self, registry: Any, host: str, port: int) -> None:
        from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

        class Server(ThreadingMixIn, WSGIServer):
            daemon_threads = True
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        class Quiet(WSGIRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:   # a scrape every 15 s is no news
                pass

        app = _prometheus().make_wsgi_app(registry)
        try:
            self._httpd = make_server(host, port, app, server_class=Server, handler_class=Quiet)
        except OSError as exc:
            raise MetricsError(f"cannot serve metrics on {host}:{port} ({exc.strerror or exc}): choose another "
                               "metrics.port (--metrics-port N; 0 picks a free one) or metrics.host") from None
        self.host, self.port = host, self._httpd.server_port
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="fedge-metrics", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def _quantile(values: list[float], q: float) -> float:
    """The q-quantile of sorted ``values``, interpolated between the two nearest ranks (numpy's default)."""
    position = q * (len(values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


def _outcomes(row: Mapping[str, Any]) -> list[tuple[str, str, int]]:
    """(outcome, reason, count) of a row's results. ``accepted`` is ``returned`` less what was dropped after
    the intake took it (``norm_rejected``, and ``dropped_stale`` in asynchronous runs); ``failed`` is split
    into memory refusals and other device errors; ``dropped`` holds the receive queue's drops by reason."""
    def n(key: str) -> int:
        value = row.get(key, 0)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    norm, stale, memory = n("norm_rejected"), n("dropped_stale"), n("failed_memory")
    drops = row.get("inbox_dropped") or {}
    return [("accepted", "", n("returned") - norm - stale), ("late", "", n("late")),
            ("rejected", "check", n("rejected")), ("rejected", "norm_bound", norm),
            ("failed", "memory", memory), ("failed", "device_error", n("failed") - memory),
            ("duplicate", "", n("duplicates")), ("unexpected", "", n("unexpected")),
            ("dropped", "stale", stale), ("dropped", "worker_lost", n("worker_lost")),
            *(("dropped", str(reason), int(count)) for reason, count in sorted(drops.items()))]


class RunTelemetry:
    """A run's metrics in a registry of their own: counters fed from the rows, the fleet read at each scrape."""

    def __init__(self, *, run_id: str, strategy: str, model: str, headline: str | None = None,
                 higher_is_better: bool = True) -> None:
        """``headline``: a run on an app, its headline metric (rows' ``test_NAME``) and its direction; fedge's own
        networks are judged by accuracy, which ``fedge_test_accuracy`` carries."""
        prom = _prometheus()
        self.registry = prom.CollectorRegistry(auto_describe=True)
        r = self.registry
        prom.Gauge("fedge_run_info", "The run this coordinator serves (always 1)", ["run_id", "strategy", "model"],
                   registry=r).labels(run_id, strategy, model).set(1)
        self.round = prom.Gauge("fedge_round", "The last round whose metrics.jsonl row is written", registry=r)
        self.results = prom.Counter("fedge_results", "Results on the devices' result topics by outcome "
                                    "(accepted, late, rejected, failed, duplicate, unexpected, dropped) and reason",
                                    ["outcome", "reason"], registry=r)
        for outcome, reason, _ in _outcomes({}):   # every series from the start, at 0
            self.results.labels(outcome, reason)
        self.selected = prom.Counter("fedge_clients_selected", "Clients the rounds counted on (the rows' selected)",
                                     registry=r)
        self.weight_capped = prom.Counter("fedge_weight_capped", "Results whose claimed sample count was capped at "
                                          "the run's weight bound (the rows' weight_capped)", registry=r)
        self.presence_ignored = prom.Counter("fedge_presence_ignored", "Presences that re-sent no task within "
                                             "clients.presence_interval (the rows' presence_ignored)", registry=r)
        self.app_refused = prom.Gauge("fedge_devices_app_refused", "Devices out of the run because their installed "
                                      "app is not the run's, as the last round ended (the rows' app_refused)",
                                      registry=r)
        self.bytes = prom.Counter("fedge_bytes", "Bytes of tasks and the model broadcast (down) and of results (up)",
                                  ["direction"], registry=r)
        for direction in ("down", "up"):
            self.bytes.labels(direction)
        self.round_seconds = prom.Histogram("fedge_round_seconds", "Wall time of a round's exchanges and "
                                            "aggregation (the rows' seconds)", buckets=ROUND_BUCKETS, registry=r)
        self.last_round_seconds = prom.Gauge("fedge_last_round_seconds", "Wall time of the last round", registry=r)
        self._gauge = lambda name, text, labels=(): prom.Gauge(name, text, list(labels), registry=r)
        self.figures: dict[str, Any] = {}   # a row's column -> its gauge, made when a row first has the column
        self._headline = None if headline is None else (headline, "true" if higher_is_better else "false")
        self._headline_gauge: Any = None    # made when a row first has the headline's column
        self._fleet: Callable[[], tuple[Mapping[str, Any], Mapping[str, Mapping[str, Any]]]] = lambda: ({}, {})
        r.register(_FleetCollector(lambda: self._fleet()))

    def watch(self, roster: Roster, profiles: ProfileStore) -> None:
        """Read the fleet at each scrape from a coordinator's roster (presences) and profile store (latest
        profiles). ``dict()`` copies each in one step while the engine's thread may change them."""
        self._fleet = lambda: (dict(roster.online), dict(profiles.latest))

    def observe(self, row: Mapping[str, Any]) -> None:
        """Count a round's row: called with every row the run writes to ``metrics.jsonl``, as it writes it."""
        self.round.set(row["round"])
        for outcome, reason, count in _outcomes(row):
            if count > 0:
                self.results.labels(outcome, reason).inc(count)
        self.selected.inc(max(0, int(row.get("selected", 0))))
        self.weight_capped.inc(max(0, int(row.get("weight_capped", 0))))
        self.presence_ignored.inc(max(0, int(row.get("presence_ignored", 0))))
        if row["round"] >= 1:   # absent from a row: none (round 0 trains nothing and says nothing of the fleet)
            self.app_refused.set(max(0, int(row.get("app_refused", 0))))
        self.bytes.labels("down").inc(max(0, int(row.get("bytes_down", 0))))
        self.bytes.labels("up").inc(max(0, int(row.get("bytes_up", 0))))
        for key, (name, text) in ROW_FIGURES.items():   # absent until a row has it: no accuracy of 0 before one
            value = row.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if key not in self.figures:
                    self.figures[key] = self._gauge(name, text)
                self.figures[key].set(value)
        if self._headline is not None:   # absent until a row has it, as the figures
            value = row.get(f"test_{self._headline[0]}")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if self._headline_gauge is None:
                    self._headline_gauge = self._gauge(*HEADLINE_GAUGE, ("metric", "higher_is_better")).labels(
                        *self._headline)
                self._headline_gauge.set(value)
        if row["round"] >= 1 and isinstance(row.get("seconds"), (int, float)):   # round 0 trains nothing
            self.round_seconds.observe(row["seconds"])
            self.last_round_seconds.set(row["seconds"])

    def observing(self, on_round: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
        """``on_round`` with every row counted first, so a scrape from ``on_round`` sees the row in."""
        def both(row: dict[str, Any]) -> None:
            self.observe(row)
            on_round(row)
        return both


class _FleetCollector:
    """The devices online by class and site, and percentiles of their latest profiles, at each scrape."""

    def __init__(self, fleet: Callable[[], tuple[Mapping[str, Any], Mapping[str, Mapping[str, Any]]]]) -> None:
        self._fleet = fleet

    def describe(self) -> list[Any]:
        return list(self.collect(empty=True))

    def collect(self, empty: bool = False) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        online, profiles = ({}, {}) if empty else self._fleet()
        groups: dict[tuple[str, str], int] = {}
        for presence in online.values():
            key = device_labels(presence.device)
            if key not in groups and len(groups) >= MAX_GROUPS:
                key = ("other", "other")
            groups[key] = groups.get(key, 0) + 1
        family = GaugeMetricFamily("fedge_devices_online", "Devices whose retained presence says online, by the "
                                   "class and site they announced", labels=["device_class", "site"])
        for (klass, site), count in sorted(groups.items()):
            family.add_metric([klass, site], count)
        yield family
        for name, (field, text) in DEVICE_FIGURES.items():
            family = GaugeMetricFamily(name, f"{text}: quantiles over the devices online", labels=["quantile"])
            values = sorted(v for cid in online if isinstance(v := (profiles.get(cid) or {}).get(field), (int, float))
                            and not isinstance(v, bool) and math.isfinite(v))
            for q in QUANTILES if values else ():
                family.add_metric([str(q)], _quantile(values, q))
            yield family


class _Off:
    """Metrics off: the run's hooks do nothing, and nothing imports prometheus_client."""

    def watch(self, roster: Roster, profiles: ProfileStore) -> None:
        pass

    def observing(self, on_round: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
        return on_round


@contextlib.contextmanager
def run_telemetry(config: RunConfig, run_id: str, say: Callable[[str], None],
                  app: App | None = None) -> Iterator[RunTelemetry | _Off]:
    """The run's metrics served at ``metrics.host``:``metrics.port`` while the block runs (``[metrics]``); a run
    on ``app`` is named by the app and its headline metric has a gauge."""
    m = config.metrics
    if not m.enabled:
        yield _Off()
        return
    if app is None:
        telemetry = RunTelemetry(run_id=run_id, strategy=config.run.strategy, model=str(config.model.get("name")))
    else:
        telemetry = RunTelemetry(run_id=run_id, strategy=config.run.strategy, model=app.name, headline=app.headline,
                                 higher_is_better=app.metrics[app.headline].higher_is_better)
    server = MetricsServer(telemetry.registry, m.host, m.port)
    log.info("serving metrics at %s", server.url, extra={"said": True})
    say(f"serving metrics at {server.url}")
    try:
        yield telemetry
    finally:
        server.close()


class WorkerTelemetry:
    """An aggregation worker's counters, read from its ``stats`` at each scrape."""

    OUTCOMES = {"claimed": "claimed", "folded": "folded", "dropped": "refused", "unusable": "unusable"}

    def __init__(self, worker_id: str, stats: Mapping[str, int]) -> None:
        """``stats``: the worker's live counters (``AggregationWorker.stats``), read at each scrape."""
        prom = _prometheus()
        self.registry = prom.CollectorRegistry(auto_describe=True)
        self._stats = stats
        prom.Gauge("fedge_worker_info", "The aggregation worker serving this endpoint (always 1)", ["worker_id"],
                   registry=self.registry).labels(worker_id).set(1)
        self.registry.register(self)

    def describe(self) -> list[Any]:
        return list(self.collect())

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        stats = dict(self._stats)
        results = CounterMetricFamily("fedge_worker_results", "Results this worker claimed, folded after the "
                                      "coordinator granted them, dropped when it refused them, or could not read",
                                      labels=["outcome"])
        for key, outcome in self.OUTCOMES.items():
            results.add_metric([outcome], stats.get(key, 0))
        yield results
        yield CounterMetricFamily("fedge_worker_partials", "Partial sums this worker sent", value=stats.get("partials", 0))
        yield CounterMetricFamily("fedge_worker_bytes_received", "Bytes that came on the devices' result topics "
                                  "to this worker", value=stats.get("bytes_received", 0))
