"""The app interface: a user's model, data, loss and metrics, declared once, served by every part of fedge.

An app is a Python package its owner writes and installs, outside fedge's tree. It declares
one :class:`App` object, named by an import path (``"kws_app:app"``) in the run's ``[app]``
section on the coordinator and registered on a device by installing the package (an entry
point in the ``fedge.apps`` group, name -> import path). Code never travels over MQTT: a task
names an app by its name, version and the digest of its installed files (:func:`app_identity`),
and each party imports the app only from what is installed on it (:func:`installed_apps`), never
from a path a message names.

fedge's own networks and data sets are the first app, ``vision`` (:mod:`edge_client.apps.vision`),
declared through this same interface.

Everything an app returns is checked here before the runtime uses it (:func:`check_app`,
:func:`check_samples`), and every refusal names the field to fix, because an app is the one part
of a run fedge did not write.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch import nn

from storage.errors import FedgeError

__all__ = ["App", "AppError", "ExampleInput", "Metric", "Samples", "AppIdentity", "check_app", "check_samples",
           "load_app", "installed_apps", "app_identity", "weights_path", "example_input", "trainable_names", "evaluate_metrics",
           "ENTRY_POINT_GROUP", "BUILT_IN_APPS", "APP_KEY", "spec_app", "app_options", "run_app", "accuracy",
           "AppMismatch", "files_digest", "app_package"]

ENTRY_POINT_GROUP = "fedge.apps"
APP_KEY = "app"   # the model spec's key holding the app's identity; a spec without it is the built-in vision app's
# The apps fedge ships, by name: found without an entry point, so a checkout that was not reinstalled has them.
BUILT_IN_APPS: Mapping[str, str] = {"vision": "edge_client.apps.vision:APP"}


class AppError(FedgeError, ValueError):
    """An app that cannot be loaded or used as declared; the message names the field to fix."""


class AppMismatch(AppError):
    """This machine's app is not the one a task was made with (another version, other files, or none installed):
    every task of the run is refused alike until the run's app is installed, so a device says so in its refusal
    (the result's ``refusal``: ``app``) and the coordinator stops giving it tasks."""


@dataclass(frozen=True)
class ExampleInput:
    """One sample as the model takes it, without the batch dimension: what profiling, memory estimates,
    the export's graph and ``fedge-profile infer`` feed the model when they have no data of their own."""

    shape: tuple[int, ...]                 # e.g. (3, 96, 96) for an RGB image, (40, 101) for audio features
    dtype: torch.dtype = torch.float32

    def tensor(self, batch: int = 1) -> torch.Tensor:
        """A batch of zeros of this shape and dtype."""
        return torch.zeros((batch, *self.shape), dtype=self.dtype)


@dataclass(frozen=True)
class Samples:
    """Data as tensors: ``x`` the model's inputs, ``y`` the targets the loss compares its outputs with.

    Both have the samples along their first dimension; any shapes and dtypes beyond it (images, feature
    sequences, table rows; integer classes, multi-label 0/1 rows, real-valued targets)."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return int(self.x.shape[0])


@dataclass(frozen=True)
class Metric:
    """One figure a run reports on evaluation data.

    ``fn(outputs, targets)`` is called once on the model's outputs over the whole evaluation set (in
    eval mode, without gradients) and the matching targets, and returns a float."""

    fn: Callable[[torch.Tensor, torch.Tensor], float]
    higher_is_better: bool = True   # False for an error (MSE, MAE): "best" then means the lowest


@dataclass(frozen=True)
class App:
    """What a run trains and how it is judged; one object per app, declared in the app's package.

    Every callable is a plain function of its arguments: the runtime calls it on the coordinator, on
    each device and in exports, and it must give the same result for the same inputs everywhere."""

    name: str
    """The app's name: letters, digits, ``_`` and ``-``; devices find the app installed under it."""
    version: str
    """The app's version (its package's), carried in every task: a device whose installed app has another
    version or other files refuses the task, naming both."""
    model: Callable[[Mapping[str, Any]], nn.Module]
    """A factory from the run's ``[model]`` options to a new network. Called on every party with the same
    options; its initial weights come from the coordinator's, so any initialization will do."""
    example_input: ExampleInput | Callable[[Mapping[str, Any]], ExampleInput]
    """One sample's shape and dtype, or a function of the model options giving it."""
    device_data: Callable[[str], Samples]
    """A loader from a device's data location (``--data`` on ``fedge-client run``: a path, a directory, a URL
    the function understands) to all of the device's samples. The runtime holds out the run's
    ``data.local_test_fraction`` of them for personalized evaluation."""
    eval_data: Callable[[str], Samples]
    """A loader from the coordinator's data location (``--data`` on ``fedge-coordinator run``) to the
    samples the global model is evaluated on after each round, and the export's parity check runs on."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """``loss(outputs, targets)``: the mean loss of a batch as a scalar tensor with a gradient."""
    metrics: Mapping[str, Metric]
    """The figures reported on evaluation data, by name; their names become row columns (``test_NAME``)."""
    headline: str
    """The metric that ranks models: reports, checkpoints' "best", selection and the export card use it."""
    preprocessing: Mapping[str, Any] = field(default_factory=dict)
    """What a served model's inputs need before the graph (JSON values), written on the export's model
    card; preprocessing inside the model is carried by the graph itself."""
    trainable: Sequence[str] = ()
    """Patterns (``fnmatch``, over the names in the model's state dict) of what trains and travels; empty:
    everything. The rest is frozen: it keeps the values ``weights`` gives it for the whole run and is never
    sent, aggregated or counted, so codecs, clipping and secure aggregation see only the trainable part."""
    weights: str = ""
    """A safetensors file of starting weights (a pretrained feature extractor, say), loaded into every new
    model on every party before anything else: a path relative to the directory of the package that
    declares the app (ship it as package data) or absolute. Its sha256 is part of the app's identity, so a
    device holding another file refuses the run's tasks. With ``trainable``, it must hold every frozen
    tensor: the frozen part comes from this file and nowhere else."""
    hooks: Mapping[str, str] = field(default_factory=dict)
    """Submodule names methods that need structure ask for: ``features`` (the feature extractor) and
    ``head`` (the last layer on its output), for methods that replace or calibrate a classifier's head."""

    def require_hook(self, hook: str, method: str) -> str:
        """The submodule name ``hook`` names, or AppError saying what ``method`` needs declared."""
        name = self.hooks.get(hook)
        if not name:
            raise AppError(f"{method} needs the app to name its {hook!r} submodule: add hooks={{{hook!r}: "
                           f"'MODULE.NAME'}} to app {self.name!r}")
        return name


@dataclass(frozen=True)
class AppIdentity:
    """What a task says about the app it was made with, and a device checks against its own."""

    name: str
    version: str
    digest: str   # sha256 of the app package's installed files
    weights: str = ""   # sha256 of its starting weights' file (App.weights); "" when it declares none

    def to_spec(self) -> dict[str, str]:
        return {"name": self.name, "version": self.version, "digest": self.digest,
                **({"weights": self.weights} if self.weights else {})}

    def line(self) -> str:
        """``NAME VERSION DIGEST``, then ``weights=SHA256`` for an app with starting weights: how ``fedge-client
        apps`` lists it (a flash kit checks the line it expects)."""
        return f"{self.name} {self.version} {self.digest}" + (f" weights={self.weights}" if self.weights else "")

    def mismatch(self, other: AppIdentity) -> str | None:
        """None when the two are the same app; else one line naming both."""
        if self == other:
            return None
        if (self.name, self.version, self.digest) == (other.name, other.version, other.digest):
            return (f"the task was made with app {self.name} {self.version} whose weights file has sha256 "
                    f"{self.weights[:12] or 'none'}, but this device's has {other.weights[:12] or 'none'}: install "
                    "the run's app (fedge-coordinator kit --app)")
        return (f"the task was made with app {self.name} {self.version} (digest {self.digest[:12]}) but this "
                f"device has {other.name} {other.version} (digest {other.digest[:12]}): install the run's app "
                "(fedge-coordinator kit --app)")


def check_app(app: object, where: str = "the app") -> App:
    """``app`` when it is a usable App; AppError naming the field to fix otherwise."""
    if not isinstance(app, App):
        raise AppError(f"{where} is a {type(app).__name__}, not an edge_client.app.App: declare it as App(...)")
    if not app.name or not all(c.isalnum() or c in "_-" for c in app.name):
        raise AppError(f"{where}: name {app.name!r} must be letters, digits, '_' and '-'")
    if not isinstance(app.version, str) or not app.version:
        raise AppError(f"{where}: version must be a non-empty string, got {app.version!r}")
    for name in ("model", "device_data", "eval_data", "loss"):
        if not callable(getattr(app, name)):
            raise AppError(f"{where}: {name} must be a function, got {type(getattr(app, name)).__name__}")
    if not isinstance(app.example_input, ExampleInput) and not callable(app.example_input):
        raise AppError(f"{where}: example_input must be an ExampleInput or a function of the model options")
    if not app.metrics:
        raise AppError(f"{where}: metrics is empty; declare at least one, e.g. {{'mae': Metric(mae, False)}}")
    bad = [n for n, m in app.metrics.items() if not isinstance(m, Metric) or not callable(m.fn)]
    if bad:
        raise AppError(f"{where}: metrics {bad} must be Metric(fn, higher_is_better)")
    if app.headline not in app.metrics:
        raise AppError(f"{where}: headline {app.headline!r} is not one of its metrics {sorted(app.metrics)}")
    if isinstance(app.trainable, str):
        raise AppError(f"{where}: trainable must be a list of patterns, not the string {app.trainable!r}")
    if not isinstance(app.weights, str):
        raise AppError(f"{where}: weights must be a path (a string), got {type(app.weights).__name__}")
    return app


def example_input(app: App, options: Mapping[str, Any]) -> ExampleInput:
    """The app's example input under the run's model options, checked."""
    found = app.example_input(options) if callable(app.example_input) else app.example_input
    if not isinstance(found, ExampleInput) or not all(isinstance(d, int) and d > 0 for d in found.shape):
        raise AppError(f"app {app.name!r}: example_input must give an ExampleInput with positive int dimensions, "
                       f"got {found!r}")
    return found


def check_samples(samples: object, app: App, what: str) -> Samples:
    """``samples`` when they are finite tensors with as many targets as inputs; AppError otherwise."""
    if not isinstance(samples, Samples):
        raise AppError(f"app {app.name!r}: {what} must return Samples(x, y), got {type(samples).__name__}")
    x, y = samples.x, samples.y
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise AppError(f"app {app.name!r}: {what} must give tensors, got {type(x).__name__} and {type(y).__name__}")
    if x.ndim == 0 or y.ndim == 0 or x.shape[0] != y.shape[0]:
        raise AppError(f"app {app.name!r}: {what} gave {tuple(x.shape)} inputs and {tuple(y.shape)} targets; both "
                       "need the samples along their first dimension, as many of each")
    if x.shape[0] == 0:
        raise AppError(f"app {app.name!r}: {what} gave no samples")
    for name, t in (("inputs", x), ("targets", y)):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise AppError(f"app {app.name!r}: {what} gave {name} that are not all finite (NaN or infinite)")
    return samples


def trainable_names(app: App, names: Sequence[str]) -> list[str]:
    """The parameter ``names`` the app's ``trainable`` patterns select (all of them when it declares none);
    AppError when a pattern selects nothing, which is a typo more often than a wish."""
    if not app.trainable:
        return list(names)
    unmatched = [p for p in app.trainable if not fnmatch.filter(names, p)]
    if unmatched:
        raise AppError(f"app {app.name!r}: trainable patterns {unmatched} match no parameter of the model; its "
                       f"parameters start {list(names)[:5]}")
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in app.trainable)]


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """The share of samples whose largest score is their label's: the metric of any classifier app (counted, then
    divided once, as the runtime's own evaluation does)."""
    return int((outputs.argmax(1) == targets).sum()) / max(len(targets), 1)


@torch.no_grad()
def evaluate_metrics(app: App, model: nn.Module, samples: Samples, batch_size: int = 1024) -> dict[str, float]:
    """The app's loss (``loss``) and each of its metrics on ``samples``, with the model in eval mode.

    The loss is summed batch by batch in double precision and divided once, as the runtime's own
    evaluation does, so the built-in app's figures are the runtime's to the bit; a loss that takes no
    ``reduction`` argument is taken as a batch mean and weighted by the batch's size."""
    model.eval()
    summed = _takes_reduction(app.loss)
    parts, loss_sum = [], 0.0
    for start in range(0, len(samples), batch_size):
        out, yb = model(samples.x[start:start + batch_size]), samples.y[start:start + batch_size]
        loss_sum += float(app.loss(out, yb, reduction="sum")) if summed else float(app.loss(out, yb)) * len(yb)
        parts.append(out)
    outputs = torch.cat(parts)
    figures = {"loss": loss_sum / max(len(samples), 1)}
    for name, metric in app.metrics.items():
        value = float(metric.fn(outputs, samples.y))
        if not math.isfinite(value):
            raise AppError(f"app {app.name!r}: metric {name!r} gave {value}; a metric must be finite")
        figures[name] = value
    return figures


def _takes_reduction(loss: Callable[..., torch.Tensor]) -> bool:
    try:
        return "reduction" in inspect.signature(loss).parameters
    except (TypeError, ValueError):   # a builtin without a signature
        return False


def installed_apps() -> dict[str, str]:
    """Every app installed here: name -> import path; fedge's own, then those registered by packages in the
    ``fedge.apps`` entry-point group (a package's own name wins over nothing: a clash is an error)."""
    found = dict(BUILT_IN_APPS)
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry.name in found and found[entry.name] != entry.value:
            raise AppError(f"two installed packages register an app named {entry.name!r} ({found[entry.name]} and "
                           f"{entry.value}); uninstall one")
        found[entry.name] = entry.value
    return found


_LOADED: dict[str, App] = {}   # apps this process loaded (by a run's [app] or a device's --app), by name


def load_app(reference: str) -> App:
    """The App an import path (``"package.module:attribute"``) or an installed app's name names, checked.

    A loaded app is what a model spec naming it resolves to in this process (:func:`spec_app`): the person
    running the coordinator or the device chose it, a message never does."""
    path = installed_apps().get(reference, reference)
    app = _load(path)
    known = _LOADED.setdefault(app.name, app)
    if known is not app:
        raise AppError(f"two apps named {app.name!r} in one process ({path} and an earlier one); give each its own name")
    return app


@functools.cache
def _load(path: str) -> App:
    module, sep, attribute = path.partition(":")
    if not sep or not module or not attribute:
        raise AppError(f"app {path!r} is neither an installed app ({', '.join(sorted(installed_apps()))}) nor an "
                       "import path 'package.module:attribute'")
    try:
        found = getattr(importlib.import_module(module), attribute)
    except ImportError as exc:
        raise AppError(f"app {path!r} does not import ({exc}); install its package (pip install ...) on this "
                       "machine") from exc
    except AttributeError:
        raise AppError(f"app {path!r}: module {module} has no attribute {attribute!r}") from None
    return check_app(found, f"app {path!r}")


def app_identity(app: App) -> AppIdentity:
    """The app's name, version, the sha256 of the Python files of the package that declares it, and that of
    its starting weights' file."""
    path = weights_path(app)
    return AppIdentity(app.name, app.version, _package_digest(app_package(app)),
                       _file_digest(path, *_stamp(path)) if path is not None else "")


def weights_path(app: App) -> Path | None:
    """The file ``App.weights`` names, resolved against its package's directory; None when it names none."""
    if not app.weights:
        return None
    path = Path(app.weights)
    if not path.is_absolute():
        spec = importlib.util.find_spec(app_package(app))
        root = (Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations
                else Path(str(spec.origin)).parent if spec and spec.origin else Path.cwd())
        path = root / path
    if not path.is_file():
        raise AppError(f"app {app.name!r}: its weights file {path} does not exist; install the app's package with "
                       "the file (package data) or fix App.weights")
    return path


def _stamp(path: Path) -> tuple[int, int]:
    info = path.stat()
    return info.st_size, info.st_mtime_ns


@functools.cache
def _file_digest(path: Path, _size: int, _mtime_ns: int) -> str:
    """sha256 of a file, once per version of it (its size and time are part of the cache's key)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def app_package(app: App) -> str:
    """The top-level package (or module) that declares ``app``: its ``model`` function's."""
    module = getattr(app.model, "__module__", None) or ""
    return module.partition(".")[0]


@functools.cache
def _package_digest(package: str) -> str:
    spec = importlib.util.find_spec(package) if package else None
    if spec is None:
        raise AppError(f"cannot find the installed files of package {package!r} to identify the app")
    if spec.submodule_search_locations:
        root = Path(next(iter(spec.submodule_search_locations)))
        files = [p for p in root.rglob("*.py") if "__pycache__" not in p.parts]
    else:
        root = Path(str(spec.origin)).parent
        files = [Path(str(spec.origin))]
    return files_digest((path.relative_to(root).as_posix(), path.read_bytes()) for path in files)


def files_digest(files: Iterable[tuple[str, bytes]]) -> str:
    """The digest of an app's identity over its package's Python files, each given as (its path relative to the
    package's directory, or the module's file name; its bytes): the installed files here, a wheel's for a kit."""
    digest = hashlib.sha256()
    for name, data in sorted(files, key=lambda item: PurePosixPath(item[0]).parts):
        digest.update(name.encode() + b"\0")
        digest.update(hashlib.sha256(data).digest())
    return digest.hexdigest()


def spec_app(spec: Mapping[str, Any]) -> App | None:
    """The installed app a model spec names, after checking that it is the one the spec was made with;
    None for a spec that names none (fedge's own networks). AppError names both when they differ."""
    named = spec.get(APP_KEY) if isinstance(spec, Mapping) else None
    if named is None:   # no app, or not a spec at all (the built-in path says what is wrong with it)
        return None
    if not isinstance(named, Mapping) or not all(isinstance(named.get(k), str)
                                                 for k in ("name", "version", "digest")) \
            or not isinstance(named.get("weights", ""), str):
        raise AppError(f"the model spec's app must be {{name, version, digest[, weights]}} strings, got {named!r}")
    wanted = AppIdentity(named["name"], named["version"], named["digest"], named.get("weights", ""))
    app = _LOADED.get(wanted.name)
    if app is None:
        if wanted.name not in installed_apps():
            raise AppMismatch(f"the task needs app {wanted.name} {wanted.version}, which is neither installed "
                              f"here (installed: {', '.join(sorted(installed_apps()))}) nor given with --app; install "
                              "it (fedge-coordinator kit --app)")
        app = load_app(wanted.name)
    mismatch = wanted.mismatch(app_identity(app))
    if mismatch:
        raise AppMismatch(mismatch)
    return app


def app_options(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The model options an app's factory takes: the spec without the app's identity."""
    return {k: v for k, v in spec.items() if k != APP_KEY}


def run_app(module: str) -> App | None:
    """The app a run's ``app.module`` (or a device's ``--app``) names; None for fedge's own networks (``""`` or
    the built-in ``vision``), which keep their own path: their specs name no app."""
    if module in ("", "vision"):
        return None
    app = load_app(module)
    return None if app is load_app("vision") else app
