"""Checking a run configuration as a whole before anything starts: ranges, combinations that cannot
work together, the broker URL and TLS files, codecs, and each method's own checks.

Each failure is a ConfigError in one line that names the key and what it must be, raised
before the run directory exists, so a mistake costs no cleanup and no retry loop.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.config_sections import (LR_SCHEDULES, MODES, ORDERS, PRIVACY_MODES, RULES, SELECTIONS,
                                         SLOW_POLICIES, SPENT_DEVICES, WEIGHTINGS, CodecSection, TransportSection)
from coordinator.errors import ConfigError
from coordinator.methods import requirements, strategies_that
from coordinator.privacy_account import DEFAULT_SAMPLING, SAMPLINGS
from edge_client.registry import METHODS, model_hooks, optimizers
from edge_client.device_names import LOOKED_FOR, DeviceError, device_kind
from edge_client.privacy_account import ACCOUNTANTS
from edge_client.wire.broker_settings import parse_broker_address
from edge_client.wire.chunk_format import MIN_MESSAGE_BYTES
from edge_client.wire.codec_spec import CodecError, eden_variance, parse_codec
from edge_client.wire.transport_errors import BrokerUrlError

if TYPE_CHECKING:
    from coordinator.run_config import RunConfig

__all__ = ["check_config"]


def check_config(config: RunConfig) -> None:
    """Raise ConfigError for the first thing wrong with ``config``."""
    c, r, t = config.clients, config.run, config.transport
    train, ev, agg = config.train, config.eval, config.aggregate
    checks = [
        (r.rounds >= 1, f"run.rounds must be at least 1, got {r.rounds}"),
        (c.max_attempts >= 1, f"clients.max_attempts must be at least 1, got {c.max_attempts}"),
        (c.max_misses >= 0, f"clients.max_misses must be 0 (never leave a client out) or more, got {c.max_misses}"),
        (train.epochs >= 1, f"train.epochs must be >= 1, got {train.epochs}"),
        (train.batch_size >= 1, f"train.batch_size must be >= 1, got {train.batch_size}"),
        (train.lr > 0, f"train.lr must be > 0, got {train.lr}"),
        (train.momentum >= 0, f"train.momentum must be >= 0, got {train.momentum}"),
        (c.max_rejected >= 0, f"clients.max_rejected must be 0 (never leave a client out) or more, got {c.max_rejected}"),
        (c.max_weight_ratio == 0 or c.max_weight_ratio >= 1,
         "clients.max_weight_ratio must be 0 (no bound relative to the fleet) or at least 1 (the median device's "
         f"own count must pass), got {c.max_weight_ratio}"),
        (c.max_samples >= 0, f"clients.max_samples must be 0 (no fixed bound) or a positive sample count, got {c.max_samples}"),
        (c.presence_interval >= 0,
         f"clients.presence_interval must be >= 0 seconds (0: every presence re-sends), got {c.presence_interval}"),
        (config.schedule.lr in LR_SCHEDULES,
         f"schedule.lr must be one of {', '.join(LR_SCHEDULES)}, got {config.schedule.lr!r}"),
        (config.schedule.warmup_rounds >= 0,
         f"schedule.warmup_rounds must be >= 0 (0: no warm-up), got {config.schedule.warmup_rounds}"),
        (0.0 <= config.data.local_test_fraction < 1.0,
         f"data.local_test_fraction must be in [0, 1), got {config.data.local_test_fraction}"),
        (ev.every >= 1, f"eval.every must be >= 1, got {ev.every}"),
        (ev.finetune_epochs >= 0, f"eval.finetune_epochs must be >= 0, got {ev.finetune_epochs}"),
        (agg.rule in RULES, f"aggregate.rule is one of {', '.join(RULES)}, got {agg.rule!r}"),
        (0 <= agg.trim < 0.5, f"aggregate.trim must be in [0, 0.5), got {agg.trim}"),
        (agg.norm_bound >= 0, f"aggregate.norm_bound must be >= 0 (0 turns the bound off), got {agg.norm_bound}"),
        *_order_checks(config),
        (not ev.personalized or config.data.local_test_fraction > 0 or c.spawn == 0,
         "eval.personalized needs data.local_test_fraction > 0 for spawned clients"),
        (c.expected >= 1, f"clients.expected must be at least 1, got {c.expected}"),
        (0 <= c.per_round <= c.expected,
         f"clients.per_round must be between 0 (all) and clients.expected ({c.expected}), got {c.per_round}"),
        (c.min_results >= 0, f"clients.min_results must be >= 0, got {c.min_results}"),
        (c.round_timeout > 0, f"clients.round_timeout must be a positive number of seconds (how long a round waits "
                              f"for results), got {c.round_timeout}"),
        (c.presence_timeout > 0, f"clients.presence_timeout must be a positive number of seconds (how long the run "
                                 f"waits for enough devices online), got {c.presence_timeout}"),
        (c.spawn >= 0, f"clients.spawn must be >= 0, got {c.spawn}"),
        (config.sim.workers >= -1,
         f"sim.workers must be >= 1, 0 (one per core) or -1 (a thread per client), got {config.sim.workers}"),
        (c.selection in SELECTIONS, f"clients.selection must be one of {', '.join(SELECTIONS)}, got {c.selection!r}"),
        (t.kind in ("mqtt", "inproc"), f"transport.kind must be mqtt or inproc, got {t.kind!r}"),
        (t.kind == "mqtt" or c.spawn > 0, "the inproc transport needs spawned clients (--spawn-clients N)"),
        (t.protocol in ("auto", "5", "3.1.1"), f"transport.protocol must be auto, 5 or 3.1.1, got {t.protocol!r}"),
        (_broker_problem(t) == "", _broker_problem(t)),
        (t.max_message_bytes >= MIN_MESSAGE_BYTES, f"transport.max_message_bytes must be at least "
                                                   f"{MIN_MESSAGE_BYTES}, got {t.max_message_bytes}"),
        (t.max_decoded_bytes >= MIN_MESSAGE_BYTES, f"transport.max_decoded_bytes must be at least "
                                                   f"{MIN_MESSAGE_BYTES}, got {t.max_decoded_bytes}"),
        (t.max_partial_bytes == 0 or t.max_partial_bytes >= t.max_decoded_bytes,
         f"transport.max_partial_bytes must be 0 (sized by the run) or at least transport.max_decoded_bytes "
         f"({t.max_decoded_bytes}), or the largest accepted result could never be reassembled; got "
         f"{t.max_partial_bytes}"),
        (config.checkpoint.keep in ("all", "last"),
         f"checkpoint.keep must be all or last, got {config.checkpoint.keep!r}"),
        *_server_checks(config),
        *_workers_checks(config),
        *_async_checks(config),
        *_selection_checks(config),
        *_over_select_checks(config),
        *_privacy_checks(config),
        *_secagg_checks(config),
        *_metrics_checks(config),
        ("name" in config.model, "model.name is required"),
        *(check for section in config.methods.values() for check in section.checks(config)),
    ]
    model_options, _ = requirements(r.strategy, config.model, config.explicit)   # an unknown strategy fails here
    checks += [(config.model.get(k) == v, f"run.strategy = {r.strategy!r} needs model.{k} = {v!r}")
               for k, v in model_options.items()]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    _check_codecs(config.codec)
    _check_app(config)
    try:
        if device_kind(ev.device) in LOOKED_FOR:
            from edge_client.device import resolve_device   # torch, only to look for the device asked for

            resolve_device(ev.device)
    except DeviceError as exc:
        raise ConfigError(f"eval.device: {exc}") from None
    if config.selected_per_round < config.required_results:
        raise ConfigError(f"clients.min_results={c.min_results} exceeds the {config.selected_per_round} "
                          f"clients selected per round")
    for ok, message in _capability_checks(config):
        if not ok:
            raise ConfigError(message)


def _capability_checks(config: RunConfig) -> list[tuple[bool, str]]:
    """What the strategy, as configured, can run with (its registry entry's declaration, edge_client/registry.py):
    a stage or mode it cannot take is refused naming the key to change and the strategies that take it."""
    can, a, strategy = config.capabilities, config.aggregate, config.run.strategy
    optimizer, privacy = config.server.optimizer, config.privacy.mode
    own_way = can.central_dp or "it combines results its own way"
    return [
        ((a.rule == "mean" and a.norm_bound == 0) or can.robust,
         f"aggregate.rule = {a.rule!r} and aggregate.norm_bound apply to strategies that average updates "
         f"({strategies_that(lambda c: c.robust)}); {strategy!r} as configured combines results its own way: "
         "leave them at mean and 0"),
        (optimizer in ("", strategy) or can.aggregates_deltas,
         f"server.optimizer = {optimizer!r} cannot step run.strategy = {strategy!r}: it does not combine its results "
         "into one model update; leave server.optimizer empty or use a strategy that does "
         f"({strategies_that(lambda c: c.aggregates_deltas)})"),
        (config.run.mode != "async" or not can.sync_only,
         f"run.mode = 'async' cannot run run.strategy = {strategy!r}: {can.sync_only}; use run.mode = 'sync' or a "
         f"strategy that folds every result into one update ({strategies_that(lambda c: c.runs_async)})"),
        # Local DP needs the same of a strategy: one update per device of the model it was sent, which the device
        # can clip and add noise to; layers matched raw or per-device statistics would leave it without noise.
        (privacy not in ("central", "local") or can.one_update_per_device,
         f"privacy.mode = {privacy!r} cannot run run.strategy = {strategy!r}: {own_way}; use privacy.mode = 'off' or "
         "a strategy whose every result is one clipped update per device "
         f"({strategies_that(lambda c: c.one_update_per_device)}; docs/privacy.md)"),
        (not config.secagg.enabled or can.one_update_per_device,
         f"secagg.enabled = true cannot run run.strategy = {strategy!r}: {own_way}; the coordinator sees only the "
         "sum of the round's updates, so use secagg.enabled = false or a strategy that folds one update per device "
         f"into one sum ({strategies_that(lambda c: c.one_update_per_device)}; docs/privacy.md)"),
    ]


def _check_app(config: RunConfig) -> None:
    """A run on an app (not fedge's own networks) takes the methods that need nothing of the network's
    structure, and no model hook (they rebuild fedge's own networks layer by layer)."""
    if config.app.module in ("", "vision"):   # fedge's own networks
        return
    takes = [name for name, entry in METHODS.items() if entry.takes_apps]
    if not METHODS[config.run.strategy].takes_apps:
        raise ConfigError(f"run.strategy = {config.run.strategy!r} does not train apps yet (app.module = "
                          f"{config.app.module!r}): use one of {', '.join(takes)} (docs/apps.md#methods-and-apps)")
    hooked = sorted(key for hook in model_hooks() for key in hook.options if key in config.model)
    if hooked:
        raise ConfigError(f"model options {hooked} change fedge's own networks and cannot apply to app "
                          f"{config.app.module!r}; remove them (docs/apps.md#methods-and-apps)")
    if config.data.partition.startswith("attribute:"):
        raise ConfigError(f"data.partition = {config.data.partition!r} changes fedge's own images; an app's data "
                          "takes 'iid', 'dirichlet:A' or 'shards:K' (the last two need integer class targets)")


def _server_checks(config: RunConfig) -> list[tuple[bool, str]]:
    """``server.optimizer``: a registered optimizer's name, and not a second one beside a strategy named after one."""
    wanted, strategy = config.server.optimizer, config.run.strategy
    names = ["fedavg", *optimizers()]
    return [
        (wanted in ("", *names), f"server.optimizer must be one of {', '.join(names)} (or empty: the strategy's "
                                 f"own), got {wanted!r}"),
        (wanted in ("", strategy) or strategy not in optimizers(),
         f"run.strategy = {strategy!r} is FedAvg with its own server optimizer, and server.optimizer = {wanted!r} "
         f"names another: set run.strategy = 'fedavg' (or the method you want) and server.optimizer = {wanted!r}"),
    ]


def _order_checks(config: RunConfig) -> list[tuple[bool, str]]:
    """``aggregate.order``: a fixed order needs the results of a phase in one process, each in its place;
    aggregation workers fold whichever share the broker hands them, and an asynchronous version holds
    whichever results came first, so neither has an order to fix."""
    order = config.aggregate.order
    if order == "arrival":
        return []
    need = "aggregate.order = 'sorted'"
    return [
        (order in ORDERS, f"aggregate.order must be one of {', '.join(ORDERS)}, got {order!r}"),
        (config.workers.count == 0, f"{need} needs workers.count = 0: each aggregation worker folds the share the "
                                    "broker gives it, in its own order"),
        (config.run.mode == "sync", f"{need} needs run.mode = 'sync': an asynchronous version is made of whichever "
                                    "results come first"),
    ]


def _metrics_checks(config: RunConfig) -> list[tuple[bool, str]]:
    """``[metrics]``: checked only when on, so a coordinator without prometheus-client runs as before."""
    m = config.metrics
    if not m.enabled:
        return []
    missing_library = m.missing_library
    return [(0 <= m.port <= 65535, f"metrics.port must be 0 (a free port) to 65535, got {m.port}"),
            (bool(m.host), "metrics.host must be an address to bind, e.g. 127.0.0.1"),
            (missing_library() == "", missing_library())]


def _workers_checks(config: RunConfig) -> list[tuple[bool, str]]:
    w = config.workers
    if w.count == 0:
        return [(w.flush_timeout > 0, f"workers.flush_timeout must be > 0, got {w.flush_timeout}")]
    need = "aggregation workers (workers.count > 0) need"
    return [
        (w.count >= 0, f"workers.count must be >= 0, got {w.count}"),
        (w.flush_timeout > 0, f"workers.flush_timeout must be > 0, got {w.flush_timeout}"),
        (bool(w.group) and not any(ch in w.group for ch in "/+#"),
         f"workers.group must be a name without / + #, got {w.group!r}"),
        (config.transport.kind == "mqtt" and bool(config.transport.broker),
         f"{need} a broker they can reach too: set transport.broker (mqtt://HOST:PORT)"),
        (config.capabilities.folds_updates,
         f"{need} a strategy whose every result folds into one weighted sum "
         f"({strategies_that(lambda c: c.folds_updates)}), "
         f"not {config.run.strategy!r}"),
        (config.aggregate.rule == "mean" and config.aggregate.norm_bound == 0,
         f"{need} aggregate.rule = 'mean' and aggregate.norm_bound = 0 (the others need every result at once)"),
        (not config.run.diagnostics, f"{need} run.diagnostics = false (it reads every result's tensors)"),
        (config.codec.broadcast, f"{need} codec.broadcast = true: they read the model results are differences from"),
    ]


def _async_checks(config: RunConfig) -> list[tuple[bool, str]]:
    """``run.mode`` and the ``[async]`` section; what asynchronous versions cannot do (each needs every
    result of a round at once, or a worker's partial sum of one) is refused naming the key to change."""
    a, mode = config.asynchronous, config.run.mode
    checks = [(mode in MODES, f"run.mode must be one of {', '.join(MODES)}, got {mode!r}")]
    if mode != "async":
        return checks
    need = "run.mode = 'async' needs"
    return checks + [
        (0 <= a.concurrency <= config.clients.expected,
         f"async.concurrency must be between 0 (clients.per_round) and clients.expected, got {a.concurrency}"),
        (a.buffer_size >= 0, f"async.buffer_size must be >= 0 (0: half of async.concurrency), got {a.buffer_size}"),
        (a.weighting in WEIGHTINGS, f"async.weighting must be one of {', '.join(WEIGHTINGS)} (fedbuff: FedBuff's "
         f"discounted sum over the buffer's count; normalized: the sample-weighted mean), got {a.weighting!r}"),
        (a.max_staleness >= 0, f"async.max_staleness must be >= 0 (0: no limit), got {a.max_staleness}"),
        (a.slow in SLOW_POLICIES, f"async.slow must be one of {', '.join(SLOW_POLICIES)} (what a device predicted "
         f"to answer beyond async.max_staleness gets), got {a.slow!r}"),
        (a.staleness_exponent >= 0, f"async.staleness_exponent must be >= 0, got {a.staleness_exponent}"),
        (a.server_lr > 0, f"async.server_lr must be > 0, got {a.server_lr}"),
        (config.workers.count == 0, f"{need} workers.count = 0: aggregation workers fold one round's results"),
        (config.aggregate.rule == "mean" and config.aggregate.norm_bound == 0,
         f"{need} aggregate.rule = 'mean' and aggregate.norm_bound = 0 (the others need a round's every result)"),
        (not config.run.diagnostics, f"{need} run.diagnostics = false (it compares a round's every client model)"),
        (not config.eval.personalized, f"{need} eval.personalized = false (it asks every client in one phase)"),
    ]


def _privacy_checks(config: RunConfig) -> list[tuple[bool, str]]:
    """``[privacy]``: its values, and what differential privacy cannot run with, naming the key to change
    (each would release something about one device that the noise does not cover, or break what the
    account assumes; docs/privacy.md says why for each mode)."""
    p = config.privacy
    checks = [(p.mode in PRIVACY_MODES, f"privacy.mode must be one of {', '.join(PRIVACY_MODES)}, got {p.mode!r}")]
    if p.mode != "local":
        checks.append((p.spent_devices == "stop", f"privacy.spent_devices applies with privacy.mode = 'local'; got "
                                                  f"{p.spent_devices!r} with privacy.mode = {p.mode!r}"))
    checks.append((p.accountant in ACCOUNTANTS,
                   f"privacy.accountant must be one of {', '.join(ACCOUNTANTS)}, got {p.accountant!r}"))
    if p.mode != "central":
        # "fixed" is what configurations written before central DP had three draws say: harmless without it
        checks.append((p.sampling in ("", "fixed"), f"privacy.sampling applies with privacy.mode = 'central'; got "
                                                    f"{p.sampling!r} with privacy.mode = {p.mode!r}"))
    if p.mode not in ("central", "local"):
        return checks
    need = f"privacy.mode = {p.mode!r} needs"
    checks += [
        (math.isfinite(p.clip_norm) and p.clip_norm > 0,
         f"privacy.clip_norm must be a positive number (the L2 bound on a device's update), got {p.clip_norm}"),
        (math.isfinite(p.noise_multiplier) and p.noise_multiplier >= 0,
         f"privacy.noise_multiplier must be >= 0 (0: no noise, no privacy), got {p.noise_multiplier}"),
        (0 < p.delta < 1, f"privacy.delta must be in (0, 1), well below 1 / clients.expected; got {p.delta}"),
        (math.isfinite(p.target_epsilon) and p.target_epsilon >= 0,
         f"privacy.target_epsilon must be >= 0 (0: no target), got {p.target_epsilon}"),
        (config.run.mode == "sync", f"{need} run.mode = 'sync': asynchronous versions are not accounted yet"),
        (not config.eval.personalized,
         f"{need} eval.personalized = false (it reports the devices' own accuracies, without noise)"),
    ]
    return checks + (_local_privacy_checks(config) if p.mode == "local" else _central_privacy_checks(config))


def _central_privacy_checks(config: RunConfig) -> list[tuple[bool, str]]:
    p, need = config.privacy, "privacy.mode = 'central' needs"
    return [
        (0 < p.target_quantile < 1, f"privacy.target_quantile must be in (0, 1), got {p.target_quantile}"),
        (math.isfinite(p.clip_lr) and p.clip_lr > 0, f"privacy.clip_lr must be > 0, got {p.clip_lr}"),
        (math.isfinite(p.count_noise_multiplier) and p.count_noise_multiplier >= 0,
         f"privacy.count_noise_multiplier must be >= 0 (0: clients per round / 10), got {p.count_noise_multiplier}"),
        (config.aggregate.rule == "mean" and config.aggregate.norm_bound == 0,
         f"{need} aggregate.rule = 'mean' and aggregate.norm_bound = 0: the others look at every update on its "
         "own, and clipping already bounds each device's say"),
        (config.clients.max_attempts == 1,
         f"{need} clients.max_attempts = 1: a retry draws more devices than the sampling rate the account uses"),
        (config.clients.selection == "random",
         f"{need} clients.selection = 'random': the account assumes every device is equally likely to be drawn"),
        (not config.run.diagnostics, f"{need} run.diagnostics = false (it records every device's model)"),
        (p.sampling in ("", *SAMPLINGS), f"privacy.sampling must be one of {', '.join(SAMPLINGS)} (empty: "
                                          f"{DEFAULT_SAMPLING}), got {p.sampling!r}"),
        ((p.sampling or DEFAULT_SAMPLING) != "poisson" or not config.secagg.enabled
         or config.selected_per_round >= config.clients.expected,
         "privacy.sampling = 'poisson' (the default) cannot run with secagg.enabled = true: a Poisson round may "
         "draw fewer devices than secure aggregation needs (3); use privacy.sampling = 'fixed' (a secret draw of "
         "clients.per_round devices, accounted under replace-one)"),
    ]


def _local_privacy_checks(config: RunConfig) -> list[tuple[bool, str]]:
    """Local DP claims no amplification by sampling and the coordinator only sees noisy updates, so retries, any
    selection, coordinate-wise robust rules and diagnostics are allowed; what is refused either releases something
    without the device's noise or re-clips the noisy update (cutting its signal, not its noise)."""
    need = "privacy.mode = 'local' needs"
    agg = config.aggregate
    return [
        (not config.privacy.adaptive_clip,
         f"{need} privacy.adaptive_clip = false: adaptive clipping needs each device's clipped bit, sent without "
         "noise (use privacy.mode = 'central' for it, or set privacy.clip_norm)"),
        (agg.rule != "clipped_mean" and agg.norm_bound == 0,
         f"{need} aggregate.rule other than 'clipped_mean' and aggregate.norm_bound = 0: the norm of a noisy update "
         "is mostly its noise's, so they would cut or reject signal, not noise (mean, median and trimmed_mean work)"),
        (config.privacy.spent_devices in SPENT_DEVICES,
         f"privacy.spent_devices must be one of {', '.join(SPENT_DEVICES)}, got {config.privacy.spent_devices!r}"),
    ]


def _secagg_checks(config: RunConfig) -> list[tuple[bool, str]]:
    """``[secagg]``: its values, and what secure aggregation cannot run with, naming the key to change (each
    needs one device's update on its own, or a vector the masks cannot cover; docs/privacy.md)."""
    s = config.secagg
    if not s.enabled:
        return []
    need = "secagg.enabled = true needs"
    n = config.selected_per_round
    return [
        (n >= 3, f"{need} at least 3 devices a round (clients.per_round, or clients.expected): a sum of two "
                 f"tells each of them the other's update; got {n}"),
        (s.degree >= 0 and (s.degree == 0 or s.degree >= config.drawn_per_round - 1
                            or (s.degree >= 2 and s.degree % 2 == 0)),
         f"secagg.degree must be 0 (about 2 log2 n), even and at least 2, or at least clients per round - 1 "
         f"(the complete graph); got {s.degree}"),
        (s.threshold >= 0, f"secagg.threshold must be 0 (degree // 2 + 1) or more; got {s.threshold}"),
        (math.isfinite(s.clip) and s.clip > 0, f"secagg.clip must be a positive number, got {s.clip}"),
        (8 <= s.bits <= 64, f"secagg.bits must be in 8..64, got {s.bits}"),
        (math.isfinite(s.stage_timeout) and s.stage_timeout > 0,
         f"secagg.stage_timeout must be a positive number of seconds, got {s.stage_timeout}"),
        (config.run.mode == "sync", f"{need} run.mode = 'sync': a buffered asynchronous version has no round "
                                    "whose devices could mask together"),
        (config.aggregate.rule == "mean" and config.aggregate.norm_bound == 0,
         f"{need} aggregate.rule = 'mean' and aggregate.norm_bound = 0: the others look at every update on its "
         "own, which the coordinator no longer sees"),
        (config.workers.count == 0, f"{need} workers.count = 0: the coordinator unmasks the sum itself"),
        (config.privacy.mode != "local",
         f"{need} privacy.mode 'off' or 'central': a device masks its clipped update without local DP's noise "
         "(noise shared out among the devices of a secure sum, distributed DP, is not built)"),
        (not config.run.diagnostics, f"{need} run.diagnostics = false (it compares every device's model)"),
        (not config.eval.personalized,
         f"{need} eval.personalized = false (it reports every device's own accuracy)"),
        (_dense(config.codec.up), f"{need} a dense codec.up (a value format such as fp32, the default, without "
                                  "topk, eden or lowrank): masks cover a dense vector and the coordinator only adds "
                                  "them; top-k would tell it which entries each device changed most, and rotated "
                                  "signs (eden) or low-rank factors (lowrank) do not add up to the sum of updates"),
    ]


def _dense(spec: str) -> bool:
    try:
        return parse_codec(spec).transform is None
    except CodecError:
        return True   # _check_codecs names the problem


def _over_select_checks(config: RunConfig) -> list[tuple[bool, str]]:
    """``clients.over_select``: at least 1, and what cannot close a round at ``clients.per_round`` results: a strategy
    that needs every drawn client's result of a phase (its ``sync_only`` declaration), asynchronous versions (no
    round to close), a secure round whose counted results would not exceed its cohort's threshold, and
    Poisson-sampled central DP (its rounds count every device drawn)."""
    c = config.clients
    checks = [(math.isfinite(c.over_select) and c.over_select >= 1.0,
               f"clients.over_select must be a number >= 1.0 (1: draw clients.per_round devices and wait for all), "
               f"got {c.over_select}")]
    if not checks[0][0] or c.over_select == 1.0:
        return checks
    need = f"clients.over_select = {c.over_select:g} needs"
    wanted = config.over_selected_per_round
    why_not = config.capabilities.sync_only
    central = config.privacy.mode == "central"
    return checks + [
        (config.closes_early, f"clients.over_select = {c.over_select:g} would draw {wanted} devices, but a round draws "
                              f"at most clients.expected = {c.expected}, no more than the clients.per_round = "
                              f"{config.selected_per_round} it counts, so nothing would be over-selected; set "
                              f"clients.expected to at least {wanted} (the run then waits for that many devices "
                              "before round 1)"),
        (not why_not, f"clients.over_select = {c.over_select:g} cannot run run.strategy = {config.run.strategy!r}: "
                      f"{why_not}; set clients.over_select = 1 or use a strategy whose phases fold each result as it "
                      f"comes ({strategies_that(lambda c: c.runs_async)})"),
        (config.run.mode == "sync", f"{need} run.mode = 'sync': asynchronous versions have no round to close "
                                    "(async.concurrency keeps that many devices busy instead)"),
        *_over_select_secagg_checks(config),
        (not central or (config.privacy.sampling or DEFAULT_SAMPLING) != "poisson",
         f"{need} privacy.sampling = 'fixed' or 'seeded' under central DP: a Poisson round counts every device it "
         "draws, and closing it at clients.per_round results would make a device's inclusion depend on the others "
         "(docs/privacy.md#over-selection)"),
    ]


def _over_select_secagg_checks(config: RunConfig) -> list[tuple[bool, str]]:
    """A secure round over-selects its cohort: all drawn devices get the round's parameters, its advertise stage
    closes at ``clients.per_round`` keys and the others count as dropped before sharing; so ``per_round`` must be
    more than the cohort's threshold, or no round could unmask."""
    if not config.secagg.enabled:
        return []
    drawn, counted = config.drawn_per_round, config.selected_per_round
    _, threshold = config.secagg.degree_and_threshold(drawn)
    return [(counted > threshold,
             f"clients.over_select = {config.clients.over_select:g} with secagg.enabled = true draws {drawn} devices "
             f"into a secure round whose shares have a threshold of {threshold}, so more than {threshold} must "
             f"advertise, but the round closes at clients.per_round = {counted}: raise clients.per_round, lower "
             "clients.over_select or set secagg.threshold lower")]


def _selection_checks(config: RunConfig) -> list[tuple[bool, str]]:
    s = config.selection
    return [
        (0.0 <= s.explore <= 1.0,
         f"selection.explore must be in [0, 1] (the share of a draw spent exploring), got {s.explore}"),
        (0 < s.explore_decay <= 1, f"selection.explore_decay must be in (0, 1] (1: no decay), got {s.explore_decay}"),
        (0 <= s.explore_min <= 1, f"selection.explore_min must be in [0, 1], got {s.explore_min}"),
        (0 < s.cutoff <= 1, f"selection.cutoff must be in (0, 1] (1: the highest utilities exactly), got {s.cutoff}"),
        (s.max_share == 0 or s.max_share >= 1,
         f"selection.max_share must be 0 (no bound) or at least 1 (times the mean participation), got {s.max_share}"),
        (s.min_sessions >= 1, f"selection.min_sessions must be at least 1, got {s.min_sessions}"),
        (s.alpha >= 0, f"selection.alpha must be >= 0 (0: no penalty for slow devices), got {s.alpha}"),
        (s.preferred_seconds >= 0,
         f"selection.preferred_seconds must be >= 0 (0: from clients.round_timeout), got {s.preferred_seconds}"),
        (s.staleness >= 0,
         f"selection.staleness must be >= 0 (0: no bonus for devices not selected for a while), got {s.staleness}"),
        (s.memory_margin >= 1.0, f"selection.memory_margin must be at least 1.0, got {s.memory_margin}"),
        (math.isfinite(s.max_temperature_c),
         f"selection.max_temperature_c must be a finite number of °C, got {s.max_temperature_c}"),
        (s.min_battery_percent >= 0 and s.min_battery_percent <= 100,
         f"selection.min_battery_percent must be in [0, 100], got {s.min_battery_percent}"),
        (s.rest_rounds >= 0,
         f"selection.rest_rounds must be >= 0 (0: never rest a hot or low-battery device), got {s.rest_rounds}"),
    ]


def _check_codecs(codec: CodecSection) -> None:
    specs = {}
    for key in ("up", "down"):
        try:
            specs[key] = parse_codec(getattr(codec, key))
        except CodecError as exc:
            raise ConfigError(f"codec.{key}: {exc}") from None
    up = specs["up"]
    if up.eden is not None and codec.error_feedback and eden_variance(up.eden) >= 1:
        raise ConfigError(f"codec.up = {codec.up!r} with codec.error_feedback = true: one decode of eden:{up.eden:g} is "
                          f"off by {math.sqrt(eden_variance(up.eden)):.2f} times the update's norm, so error feedback "
                          "would add back more than each upload sends and its residual would grow without bound; set "
                          "codec.error_feedback = false (the decoded updates stay unbiased, and averaging a round's "
                          "devices takes their error down) or send eden:0.8 or more")
    if specs["down"].transform == "topk":
        raise ConfigError("codec.down cannot use topk: it would zero most weights of the model sent down; "
                          "use topk in codec.up")
    if specs["down"].transform is not None:
        raise ConfigError(f"codec.down cannot use {specs['down'].transform}: it encodes differences, and the model "
                          "goes down as values; use it in codec.up")
    if codec.down_delta:
        try:
            delta = parse_codec(codec.down_delta)
        except CodecError as exc:
            raise ConfigError(f"codec.down_delta: {exc}") from None
        if delta.transform not in (None, "topk"):
            raise ConfigError(f"codec.down_delta cannot use {delta.transform}, an upload codec: the delta broadcast "
                              "takes a value format and optionally topk (e.g. int8+zstd or topk:0.25+int8+zstd)")
        if not codec.broadcast:
            raise ConfigError("codec.down_delta sends the model broadcast as a delta: it needs codec.broadcast = true")
        if specs["down"].values != "fp32":
            raise ConfigError(f"codec.down_delta needs codec.down in fp32 (optionally +zstd or +lz4), not "
                              f"{codec.down!r}: the full broadcast must carry the model devices rebuild from deltas "
                              "bit for bit, so that either way they hold the same one")


def _broker_problem(t: TransportSection) -> str:
    """What is wrong with the broker URL and its TLS and provisioning files ("" when nothing): checked before
    the run directory exists, so a typo costs no cleanup and no retry loop."""
    if t.broker:
        try:
            tls = parse_broker_address(t.broker).tls
        except BrokerUrlError as exc:
            return f"transport.broker: {exc}"
    else:
        tls = False
    tls_keys = [f"transport.{key}" for key in ("ca_file", "cert_file", "key_file") if getattr(t, key)]
    if tls_keys and not tls:
        return (f"{', '.join(tls_keys)} need a TLS broker: set transport.broker = \"mqtts://HOST:8883\" "
                "(the embedded broker and mqtt:// URLs do not use TLS)")
    if t.key_file and not t.cert_file:
        return "transport.key_file needs transport.cert_file (the client certificate it belongs to)"
    for key in ("ca_file", "cert_file", "key_file"):
        path = getattr(t, key)
        if path and not Path(path).is_file():
            return f"transport.{key}: {path} does not exist; give the path of a PEM file"
    if t.provision_dir:
        if not t.broker:
            return ("transport.provision_dir needs transport.broker (the provisioned broker); the embedded broker "
                    "makes its own credentials")
        if not (Path(t.provision_dir) / "devices").is_dir():
            return (f"transport.provision_dir: {t.provision_dir} has no devices/ directory; give the --out "
                    "directory of fedge-coordinator provision")
    return ""
