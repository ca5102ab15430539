"""``fedge-profile infer``: how fast an ONNX model runs on this device, with ONNX Runtime.

Needs only onnxruntime, numpy and psutil (no torch), because the devices that
will serve a model often have no torch. After a warm-up, the model runs ``runs``
times at batch 1 and at a larger batch, each run timed on its own; the result is
the p50/p95/p99 latency, throughput, and the process's peak memory, appended to
the device's profile history as an ``infer`` line.

Only the input's shape matters for latency, so the default input is seeded random
data; ``--data npz:PATH`` uses real samples (array ``x_test``, else ``x``: uint8
images or float pixels in [0, 1], a missing channel axis is added), and when the file
also holds their labels (``y_test`` or ``y``) the model's top-1 accuracy on them. The
pixels become the model's input as the model was trained: normalized by the
``fedge.normalization`` its file carries (the model spec's, written by ``fedge-export``),
with the same function the training data went through, so the accuracy is the one the
model card reports for the same samples.

An app's export (its card beside the model names the app: ``model.card.json`` beside
``model.onnx``) is fed as its card says: the input's shape and dtype from the card (random
floats, or zeros for integer inputs, as the app's example input is), and ``--data`` samples as
they are, without pixel scaling or normalization (an app's ``preprocessing`` is its own).
Its metrics are the app's code, which needs torch, so labels are not scored; the report
quotes the card's headline as ONNX Runtime served it at export.

``--provider`` picks ONNX Runtime's execution provider: the CPU on a Raspberry Pi,
CUDA or TensorRT on a Jetson with NVIDIA's onnxruntime-gpu build; ``auto`` takes the
first of TensorRT, CUDA and CPU that the installed onnxruntime offers. The report
names the provider the session really ran on.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import psutil

from profiling.device import device_facts
from profiling.errors import ProfileError
from profiling.history import append_history
from profiling.profiler import peak_rss_since_reset, percentile, reset_peak_rss
from storage.cards import CardError, card_path, read_card
from storage.pixels import DataError, Normalization, npz_pixels, read_npz

__all__ = ["InferError", "InferSettings", "PROVIDERS", "benchmark", "choose_provider", "format_result",
           "model_normalization", "app_card"]

# --provider names and the ONNX Runtime execution providers they stand for, in auto's order of preference
PROVIDERS = {"tensorrt": "TensorrtExecutionProvider", "cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}

# ONNX tensor element types this benchmark can feed
_DTYPES = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
           "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(uint8)": np.uint8,
           "tensor(int8)": np.int8}
_RSS_EVERY_RUNS = 10


class InferError(ProfileError):
    """The model or data cannot be benchmarked; the message says what to change."""


@dataclass(frozen=True)
class InferSettings:
    runs: int = 200
    warmup: int = 20
    batch: int = 32                 # the larger batch, measured after batch 1
    threads: int = 1                # ONNX Runtime intra-op threads; 1 on a shared small device
    data: str | None = None         # None: seeded random input; "npz:PATH": real samples
    seed: int = 0
    provider: str = "auto"          # auto | cpu | cuda | tensorrt (PROVIDERS)


def choose_provider(name: str, available: list[str]) -> str:
    """The ONNX Runtime provider for ``--provider name``, given the installed build's ``available`` ones."""
    if name == "auto":
        return next(p for p in PROVIDERS.values() if p in available or p == PROVIDERS["cpu"])
    if name not in PROVIDERS:
        raise InferError(f"unknown provider {name!r}; choose auto, {', '.join(PROVIDERS)}")
    wanted = PROVIDERS[name]
    if wanted not in available:
        offered = ", ".join(k for k, v in PROVIDERS.items() if v in available) or "none"
        raise InferError(f"this onnxruntime ({ort.__version__}) has no {wanted} (it offers: {offered}); on a Jetson "
                         "install NVIDIA's onnxruntime-gpu build for its JetPack release, or use --provider cpu")
    return wanted


def _session(model: Path, threads: int, provider: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # the CPU after an accelerator: operators the accelerator lacks still run
    providers = [provider] + ([PROVIDERS["cpu"]] if provider != PROVIDERS["cpu"] else [])
    try:
        return ort.InferenceSession(str(model), sess_options=options, providers=providers)
    except Exception as exc:   # onnxruntime raises its own exception types for unreadable models
        raise InferError(f"ONNX Runtime cannot load {model}: {exc}; check that it is an ONNX file "
                         "(a model exported with external data needs its .data file next to it)") from None


def model_normalization(session: ort.InferenceSession) -> Normalization | None:
    """The normalization in the model file's ``fedge.normalization`` metadata; None when it has none (a model
    not exported by fedge, or one whose run did not record its data)."""
    text = session.get_modelmeta().custom_metadata_map.get("fedge.normalization")
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        raise InferError("the model's fedge.normalization metadata is not JSON; export the model again with "
                         "fedge-export") from None
    if not isinstance(value, dict) or "mean" not in value or "std" not in value:
        return None   # the card's "unknown" entry: no normalization was recorded
    try:
        return Normalization.from_spec({"mean": value["mean"], "std": value["std"]})
    except DataError as exc:
        raise InferError(f"the model's fedge.normalization metadata is unusable: {exc}") from None


def app_card(model: Path, sha256: str) -> dict[str, Any] | None:
    """The card beside ``model`` when it is an app's export (it names the app); None for any other model.
    InferError when that card describes another file (its SHA-256 differs) or is unreadable."""
    try:
        card = read_card(model)
    except CardError as exc:
        raise InferError(str(exc)) from None
    if card is None or not isinstance(card.get("app"), dict):
        return None
    if card.get("sha256") != sha256:
        raise InferError(f"{card_path(model)} describes another file (sha256 {str(card.get('sha256'))[:12]}, this "
                         f"model's is {sha256[:12]}): export the model again, or move the stale card away")
    return card


def _card_input(card: dict[str, Any], spec: Any) -> tuple[list[Any], type]:
    """The input shape (``["batch", ...]``) and NumPy dtype an app's card gives, checked against the model's
    input ``spec`` (ONNX Runtime's NodeArg)."""
    entry = card.get("input") if isinstance(card.get("input"), dict) else {}
    shape, name = entry.get("shape"), entry.get("dtype")
    if not isinstance(shape, list) or not shape or not all(isinstance(d, int) and d > 0 for d in shape[1:]):
        raise InferError(f"the card's input shape {shape!r} is not [\"batch\", positive sizes...]; export the "
                         "model again with fedge-export")
    try:
        dtype = np.dtype(str(name)).type
    except TypeError:
        raise InferError(f"the card's input dtype {name!r} has no NumPy type to feed") from None
    if _DTYPES.get(spec.type) is not dtype:
        raise InferError(f"the card says the input is {name} but the model takes {spec.type}: the card does not "
                         "describe this model; export it again with fedge-export")
    fixed = [(i, d) for i, d in enumerate(spec.shape) if isinstance(d, int) and i > 0]
    if len(spec.shape) != len(shape) or any(shape[i] != d for i, d in fixed):
        raise InferError(f"the card says the input is {shape} but the model takes {list(spec.shape)}: the card "
                         "does not describe this model; export it again with fedge-export")
    return shape, dtype


def _samples(settings: InferSettings, shape: list[Any], dtype: type, normalization: Normalization | None, *,
             app: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """Samples shaped like the model's input (first axis: the samples), and their labels if the file has them.

    Float inputs are the pixels normalized by ``normalization`` (None: the [0, 1] pixels as they are). An
    ``app``'s inputs are taken as they are (cast to ``dtype``), its random integer inputs are zeros (any
    index an embedding takes), and labels are not read: its metrics are its own code."""
    sample_shape = shape[1:]
    if settings.data is None:
        if not all(isinstance(d, int) and d > 0 for d in sample_shape):
            raise InferError(f"the model's input {shape} has dynamic dimensions besides the batch; "
                             "pass --data npz:PATH with real samples")
        if app and not np.issubdtype(dtype, np.floating):
            return np.zeros((64, *sample_shape), dtype), None
        rng = np.random.default_rng(settings.seed)
        return rng.standard_normal((64, *sample_shape)).astype(dtype), None
    kind, _, path = settings.data.partition(":")
    if kind != "npz" or not path:
        raise InferError(f"--data must be npz:PATH, got {settings.data!r}")
    try:
        archive = read_npz(Path(path))
    except DataError as exc:
        raise InferError(str(exc)) from None
    key = "x_test" if "x_test" in archive else "x"
    if key not in archive:
        raise InferError(f"{path} has no array x or x_test (it has {sorted(archive)})")
    x = archive[key]
    label_key = {"x_test": "y_test", "x": "y"}[key]
    y = None if app else archive.get(label_key)
    if not app and np.issubdtype(dtype, np.floating) and len(shape) == 4:   # images: pixels -> the model's inputs
        try:
            pixels = npz_pixels(Path(path), key, x)
            x = pixels.normalized(normalization or Normalization.identity(pixels.channels))
        except DataError as exc:
            raise InferError(f"{exc}; the model takes {sample_shape}") from None
    elif not app:   # an app's samples go in as its loader made them
        if x.dtype == np.uint8 and dtype != np.uint8:
            x = x.astype(np.float32) / 255.0
        if x.ndim == len(shape) - 1:
            x = x[:, None]
    fixed = [(i, d) for i, d in enumerate(sample_shape) if isinstance(d, int)]
    if x.ndim != len(shape) or any(x.shape[i + 1] != d for i, d in fixed) or len(x) == 0:
        raise InferError(f"samples in {path} are {list(x.shape[1:])}, the model takes {sample_shape}")
    if y is not None and (y.ndim != 1 or len(y) != len(x) or y.dtype.kind not in "iu"):
        raise InferError(f"the labels in {path} must be integers, one per sample ({len(x)}); got {y.dtype} "
                         f"{list(y.shape)}")
    return x.astype(dtype), y


def _accuracy(session: ort.InferenceSession, name: str, x: np.ndarray, y: np.ndarray, batch: int,
              fixed_batch: int | None) -> float:
    """Top-1 accuracy of the first output on (x, y), in batches the model accepts."""
    size = fixed_batch or batch
    correct = 0
    for start in range(0, len(x), size):
        chunk = x[start:start + size]
        n = len(chunk)
        if fixed_batch and n < fixed_batch:   # a fixed batch axis: pad the last chunk, score only its samples
            chunk = chunk[np.arange(fixed_batch) % n]
        scores = session.run(None, {name: chunk})[0][:n]
        correct += int((scores.reshape(n, -1).argmax(1) == y[start:start + n]).sum())
    return correct / len(x)


def _time_runs(session: ort.InferenceSession, name: str, batch: np.ndarray, settings: InferSettings,
               process: psutil.Process) -> tuple[list[float], int]:
    """Latency of each timed run, and the largest RSS sampled between runs (outside the timing)."""
    feed = {name: batch}
    for _ in range(settings.warmup):
        session.run(None, feed)
    times, peak = [], 0
    for i in range(settings.runs):
        start = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - start)
        if i % _RSS_EVERY_RUNS == 0:
            peak = max(peak, process.memory_info().rss)
    return times, peak


def benchmark(model: Path, settings: InferSettings, *, state_dir: Path | None = None) -> dict[str, Any]:
    """Run the benchmark; with ``state_dir``, append it to that device's profile history."""
    if settings.runs < 1 or settings.warmup < 0 or settings.batch < 1 or settings.threads < 0:
        raise InferError("--runs and --batch must be at least 1, --warmup and --threads at least 0")
    if not model.is_file():
        raise InferError(f"{model} does not exist; pass the path of an .onnx file")
    process = psutil.Process()
    rss_before = process.memory_info().rss
    reset_peak_rss()
    provider = choose_provider(settings.provider, ort.get_available_providers())
    session = _session(model, settings.threads, provider)
    rss_loaded = process.memory_info().rss
    inputs = session.get_inputs()
    if len(inputs) != 1:
        raise InferError(f"the model has {len(inputs)} inputs; this benchmark feeds models with one input")
    spec = inputs[0]
    dtype = _DTYPES.get(spec.type)
    if dtype is None:
        raise InferError(f"input {spec.name!r} is {spec.type}; supported: {', '.join(_DTYPES)}")
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    card = app_card(model, digest)
    if card is None:
        shape, normalization = list(spec.shape), model_normalization(session)
    else:   # an app's export: its card gives the input; its preprocessing is the app's own
        (shape, dtype), normalization = _card_input(card, spec), None
    samples, labels = _samples(settings, shape, dtype, normalization, app=card is not None)
    batch_dim = spec.shape[0] if spec.shape else None
    results, skipped, peak = [], [], rss_loaded
    for size in dict.fromkeys((1, settings.batch)):
        if isinstance(batch_dim, int) and batch_dim != size:
            skipped.append({"batch": size, "reason": f"the model's batch dimension is fixed at {batch_dim}"})
            continue
        batch = samples[np.arange(size) % len(samples)]
        times, rss = _time_runs(session, spec.name, batch, settings, process)
        peak = max(peak, rss)
        results.append({"batch": size, "runs": len(times), "warmup": settings.warmup,
                        "p50": percentile(times, 50), "p95": percentile(times, 95), "p99": percentile(times, 99),
                        "mean": sum(times) / len(times), "samples_per_second": size * len(times) / sum(times)})
    record = {
        "model": str(model.resolve()), "model_name": model.name, "model_bytes": model.stat().st_size,
        "model_sha256": digest,
        "input": {"name": spec.name, "type": spec.type, "shape": [d if isinstance(d, int) else str(d) for d in shape]},
        "data": settings.data or "random",
        "normalization": None if normalization is None or settings.data is None else normalization.to_spec(),
        "threads": settings.threads, "onnxruntime": ort.__version__,
        "provider": session.get_providers()[0], "provider_asked": settings.provider,
        "results": results, "skipped": skipped,
        "session_rss_bytes": rss_loaded - rss_before,
        "peak_rss_bytes": max(peak, peak_rss_since_reset() or 0),
        "device": device_facts(),
    }
    if card is not None:
        headline = card.get("headline")
        record["app"] = {k: card["app"].get(k) for k in ("name", "version")}
        record["card"] = {"file": card_path(model).name, "precision": card.get("precision"), "headline": headline,
                          f"test_{headline}": card.get(f"test_{headline}")}
    if labels is not None:
        record["accuracy"] = _accuracy(session, spec.name, samples, labels, settings.batch,
                                       batch_dim if isinstance(batch_dim, int) else None)
        record["accuracy_samples"] = len(labels)
    if state_dir is not None:
        record["history"] = str(append_history(state_dir, "infer", record))
    return record


def format_result(record: dict[str, Any]) -> str:
    """Plain text (no rich: a device may have nothing but onnxruntime and numpy)."""
    from profiling.units import human_bytes

    i = record["input"]
    lines = [f"{record['model_name']} ({human_bytes(record['model_bytes'])}, sha256 {record['model_sha256'][:12]}), "
             f"ONNX Runtime {record['onnxruntime']} on {record.get('provider', PROVIDERS['cpu'])}"
             f"{' (auto)' if record.get('provider_asked') == 'auto' else ''}, {record['threads']} intra-op thread(s)",
             f"input {i['name']!r} {i['type']} {i['shape']}, data {record['data']}",
             f"{'batch':>6} {'runs':>6} {'p50 ms':>9} {'p95 ms':>9} {'p99 ms':>9} {'samples/s':>11}"]
    for r in record["results"]:
        lines.append(f"{r['batch']:>6} {r['runs']:>6} {r['p50'] * 1e3:>9.3f} {r['p95'] * 1e3:>9.3f} "
                     f"{r['p99'] * 1e3:>9.3f} {r['samples_per_second']:>11.0f}")
    for s in record["skipped"]:
        lines.append(f"batch {s['batch']} skipped: {s['reason']}")
    if record.get("normalization"):
        n = record["normalization"]
        lines.append(f"pixels normalized as the model's metadata says: mean {n['mean']}, std {n['std']}")
    if record.get("app"):
        app, card = record["app"], record["card"]
        name, value = card["headline"], card.get(f"test_{card['headline']}")
        served = f"{value:.4f}" if isinstance(value, (int, float)) else "not recorded"
        lines.append(f"app {app['name']} {app['version']}: input as its card {card['file']} says; test {name} "
                     f"{served} as ONNX Runtime served it at export (the app's metrics run in its own code: not "
                     "measured here)")
    if "accuracy" in record:
        lines.append(f"accuracy {100 * record['accuracy']:.2f}% on the {record['accuracy_samples']} labelled samples "
                     f"of {record['data']}")
    lines.append(f"peak RSS {human_bytes(record['peak_rss_bytes'])} "
                 f"(loading the model added {human_bytes(record['session_rss_bytes'])})")
    if record.get("history"):
        lines.append(f"appended to {record['history']}")
    return "\n".join(lines)
