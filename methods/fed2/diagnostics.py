"""Where Fed2's grouped layers start: per-layer variance of the neurons' class preferences.

Fed2 keeps the lower layers of a network shared and splits the upper ones into
groups, one per class (or set of classes). The split should start where neurons
stop being generic and begin to specialize by class. That point is measured on a
briefly trained model:

1. :func:`class_preferences`: every hidden neuron's class-preference vector, for
   class c the sum over class-c samples of activation x d(class-c logit)/d(activation)
   (a first-order estimate of how much the neuron contributes to that class's score);
2. :func:`preference_variance`: how much those vectors differ across the layer's
   neurons, in [0, 1];
3. :func:`suggest_depth`: the lowest layer from which every layer's variance is above
   a threshold.

Layers are numbered as ``model.fed2_from`` numbers them: the weight layers
(``nn.Conv2d``, ``nn.Linear``) of ``model.features`` in forward order are 1, 2, ...,
and ``model.classifier`` is the last number.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from storage.errors import FedgeError

__all__ = ["DEFAULT_THRESHOLD", "Fed2Depth", "LayerPreference", "Fed2DepthError", "weight_layers",
           "class_preferences", "preference_variance", "suggest_depth", "fed2_depth", "plot_variances"]

# From measurements on Fashion-MNIST and digits (10 classes; docs/fed2-depth.md): after brief
# training every convolution stayed at or below 0.24 (random weights give about 0.17) and
# the trained fully connected layers of cnn and vgg9 at or above 0.34 on Fashion-MNIST;
# random weights put fully connected layers at 0.25 to 0.31. 0.3 sits in the gap.
DEFAULT_THRESHOLD = 0.3

_ACTIVATIONS = (nn.ReLU,)   # position-aware ReLUs are ReLUs too


class Fed2DepthError(FedgeError, ValueError):
    """The model or the data cannot be measured; the message says what to change."""


def weight_layers(model: nn.Module) -> dict[int, tuple[nn.Module, nn.Module]]:
    """Hidden layer number -> (its weight layer, its activation module), numbered as ``fed2_from`` is.

    A hidden unit is [Conv2d/Linear, optional norm, activation]: the activation is the
    first ReLU (or position-aware ReLU) after the weight layer in ``model.features``.
    """
    features = getattr(model, "features", None)
    if not isinstance(features, nn.Sequential) or not hasattr(model, "classifier"):
        raise Fed2DepthError(f"{type(model).__name__} has no `features` (nn.Sequential) and `classifier`; "
                             "build the model with edge_client.registry.build_model")
    modules = list(features)
    layers: dict[int, tuple[nn.Module, nn.Module]] = {}
    for i, module in enumerate(modules):
        if not isinstance(module, (nn.Conv2d, nn.Linear)):
            continue
        activation = next((m for m in modules[i + 1:] if isinstance(m, _ACTIVATIONS + (nn.Conv2d, nn.Linear))),
                          None)
        if not isinstance(activation, _ACTIVATIONS):
            raise Fed2DepthError(f"features[{i}] ({type(module).__name__}) has no ReLU after it; class "
                                 "preferences are measured at a hidden layer's activation")
        layers[len(layers) + 1] = (module, activation)
    return layers


def class_preferences(model: nn.Module, layers: list[int] | tuple[int, ...], x: torch.Tensor, y: torch.Tensor,
                      num_classes: int, batch_size: int = 256) -> dict[int, torch.Tensor]:
    """Each requested hidden layer's class-preference matrix, shape (neurons, num_classes).

    Entry (n, c) is the sum over the class-c samples of activation x gradient of the
    class-c logit with respect to that activation; for a convolution the neuron is an
    output channel and the product is summed over its spatial positions too.

    The model runs in eval mode (normalization uses no batch statistics, so each sample's
    logit depends on that sample's activations only); one backward pass per batch then
    gives every sample's gradient of its own class's logit. Gradients are taken with
    ``torch.autograd.grad``, so the parameters' ``.grad`` are left untouched.
    """
    hidden = weight_layers(model)
    unknown = sorted(set(layers) - set(hidden))
    if unknown:
        raise Fed2DepthError(f"layers {unknown} are not hidden layers of this model; valid: 1..{len(hidden)}")
    if len(x) != len(y) or len(y) == 0:
        raise Fed2DepthError(f"{len(x)} images and {len(y)} labels; pass the same number, at least one")
    if int(y.min()) < 0 or int(y.max()) >= num_classes:
        raise Fed2DepthError(f"labels must lie in 0..{num_classes - 1}, got {int(y.min())}..{int(y.max())}; "
                             "is num_classes the model's?")
    captured: dict[int, torch.Tensor] = {}

    def keep(index: int):
        def hook(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
            captured[index] = output
        return hook

    handles = [hidden[i][1].register_forward_hook(keep(i)) for i in layers]
    was_training = model.training
    model.eval()
    sums: dict[int, torch.Tensor] = {}
    try:
        with torch.enable_grad():
            for start in range(0, len(y), batch_size):
                # An input that requires grad keeps the graph even when the parameters are frozen.
                xb = x[start:start + batch_size].detach().clone().requires_grad_(True)
                yb = y[start:start + batch_size]
                captured.clear()
                logits = model(xb)
                score = logits.gather(1, yb[:, None]).sum()
                acts = [captured[i] for i in layers]
                grads = torch.autograd.grad(score, acts)
                for i, a, g in zip(layers, acts, grads):
                    per_sample = (a.detach() * g).flatten(2).sum(2) if a.dim() > 2 else a.detach() * g  # [B, J]
                    total = sums.setdefault(i, torch.zeros(num_classes, per_sample.shape[1], dtype=torch.float64))
                    total.index_add_(0, yb, per_sample.to(torch.float64))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return {i: sums[i].T.contiguous() for i in layers} if sums else {}


def preference_variance(prefs: torch.Tensor) -> float:
    """Total variance of a layer's class-preference vectors, scaled to [0, 1].

    Each neuron's vector is divided by the sum of its absolute values, so that only the
    mix of classes it prefers counts and not how strongly it fires (neurons with an
    all-zero vector, dead ones, are dropped). The layer's value is the sum over classes
    of the population variance across neurons, divided by its largest value for
    non-negative vectors, 1 - 1/C:

        V = sum_c Var_n(p[n, c]) / (1 - 1/C),   p[n] = prefs[n] / sum_c |prefs[n, c]|

    V = 1 when every neuron prefers one class and the classes are spread evenly over the
    neurons; V = 0 when all neurons prefer the same mixture. A layer near 0 is generic
    (every class uses its features alike) and should stay shared; a layer with a high V
    has neurons that specialize by class, and that is where Fed2 starts its groups.
    A neuron can also count against a class (a negative entry); such signed vectors can
    push V slightly above 1, to at most C / (C - 1).

    Random weights do not give 0: their entries have random signs, which puts V near
    pi / (2 (C - 1)) for Gaussian entries (0.17 for 10 classes, as measured in untrained
    convolutions) and at 0.25 to 0.31 in untrained fully connected layers. Read V against
    that floor; with fewer classes the floor is higher.
    """
    if prefs.dim() != 2 or prefs.shape[1] < 2:
        raise Fed2DepthError(f"preferences must be (neurons, classes >= 2), got shape {tuple(prefs.shape)}")
    p = prefs.to(torch.float64)
    mass = p.abs().sum(1)
    p = p[mass > 0] / mass[mass > 0, None]
    if len(p) == 0:
        return 0.0
    classes = p.shape[1]
    return float(p.var(0, unbiased=False).sum() / (1.0 - 1.0 / classes))


def suggest_depth(variances: Mapping[int, float], threshold: float = DEFAULT_THRESHOLD) -> int:
    """The layer Fed2 should start its groups at (``model.fed2_from``).

    ``variances`` holds hidden layers 1..L-1; the classifier is L. The answer is the
    lowest layer whose variance, and that of every layer above it, is above
    ``threshold``: a specialized layer under a generic one is not split, because the
    generic layer above it would have to be shared anyway. If even the last hidden
    layer is not above it, only the classifier is decoupled (L).
    """
    if not variances:
        raise Fed2DepthError("no hidden layer variances given; the model needs at least one hidden layer")
    classifier = max(variances) + 1
    depth = classifier
    for layer in sorted(variances, reverse=True):
        if variances[layer] <= threshold:
            break
        depth = layer
    return depth


@dataclass(frozen=True)
class LayerPreference:
    """One hidden layer's measurement."""

    index: int
    kind: str          # "conv" or "linear"
    neurons: int
    variance: float
    dead: int          # neurons whose preference vector is all zero (left out of the variance)


@dataclass(frozen=True)
class Fed2Depth:
    """What :func:`fed2_depth` measured and what it suggests."""

    spec: dict[str, Any]
    data: str
    layers: list[LayerPreference]
    classifier: int            # the classifier's layer number
    suggested: int             # model.fed2_from
    threshold: float
    train_samples: int
    epochs: int
    eval_samples: int
    accuracy: float            # of the briefly trained model on the held-out images
    seconds: float

    @property
    def variances(self) -> dict[int, float]:
        return {layer.index: layer.variance for layer in self.layers}

    @property
    def barely_trained(self) -> bool:
        """Held-out accuracy under twice chance: the preferences are mostly those of random weights
        (untrained linear layers already reach about 0.3), so the suggestion means little."""
        return self.accuracy < 2.0 / self.spec["num_classes"]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "barely_trained": self.barely_trained}


def fed2_depth(spec: Mapping[str, Any], data: str = "fashion-mnist", samples: int = 5000, epochs: int = 1,
               seed: int = 0, threshold: float = DEFAULT_THRESHOLD, eval_samples: int = 2000,
               lr: float = 0.01, threads: int = 1) -> Fed2Depth:
    """Train ``spec``'s model briefly and centrally, measure its class preferences and suggest a depth.

    Training: SGD with momentum 0.9, batch 32, ``epochs`` passes over ``samples`` training
    images drawn by ``seed``. Preferences: on the first ``eval_samples`` test images, which
    the model never trained on. The spec's ``num_classes``, ``in_channels`` and
    ``image_size`` default to the dataset's. Seeded: the same arguments give the same numbers.

    ``threads``: torch's intra-op threads while it runs (restored after). One by default:
    these small models gain little from a second thread, and on a 2-core machine that is
    busy with anything else, two threads waiting on each other made training about 28 times
    slower (65 s against 2.3 s for cnn). Results are deterministic for a given thread count.
    """
    if samples < 1 or epochs < 1 or eval_samples < 1:
        raise Fed2DepthError(f"samples, epochs and eval_samples must be >= 1, got {samples}, {epochs}, {eval_samples}")
    if threads < 1:
        raise Fed2DepthError(f"threads must be >= 1, got {threads}")
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _measure(spec, data, samples, epochs, seed, threshold, eval_samples, lr)
    finally:
        torch.set_num_threads(threads_before)


def _measure(spec: Mapping[str, Any], data: str, samples: int, epochs: int, seed: int, threshold: float,
             eval_samples: int, lr: float) -> Fed2Depth:
    from edge_client.data import load_dataset
    from edge_client.objectives import LocalData, TaskContext, evaluate, train
    from edge_client.registry import build_model
    from profiling.profiler import NullProfiler

    started = time.perf_counter()
    dataset = load_dataset(data)
    full_spec = {"num_classes": dataset.num_classes, "in_channels": dataset.in_channels,
                 "image_size": dataset.image_size, **spec}
    torch.manual_seed(seed)
    model = build_model(full_spec)
    hidden = weight_layers(model)

    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(len(dataset.y_train), generator=gen)[:samples]
    x_train = torch.from_numpy(dataset.x_train)[rows]
    y_train = torch.from_numpy(dataset.y_train)[rows]
    ctx = TaskContext(seed=seed, round=0, client_id="fed2-depth", state_dir=None, profiler=NullProfiler())
    train(model, LocalData(x_train, y_train), {"epochs": epochs, "batch_size": 32, "lr": lr, "momentum": 0.9}, ctx)

    x_eval = torch.from_numpy(dataset.x_test[:eval_samples])
    y_eval = torch.from_numpy(dataset.y_test[:eval_samples])
    _, accuracy = evaluate(model, x_eval, y_eval)
    prefs = class_preferences(model, list(hidden), x_eval, y_eval, full_spec["num_classes"])
    layers = [LayerPreference(index=i, kind="conv" if isinstance(hidden[i][0], nn.Conv2d) else "linear",
                              neurons=int(prefs[i].shape[0]), variance=preference_variance(prefs[i]),
                              dead=int((prefs[i].abs().sum(1) == 0).sum()))
              for i in sorted(prefs)]
    variances = {layer.index: layer.variance for layer in layers}
    return Fed2Depth(spec=full_spec, data=data, layers=layers, classifier=len(hidden) + 1,
                     suggested=suggest_depth(variances, threshold), threshold=threshold,
                     train_samples=len(rows), epochs=epochs, eval_samples=len(y_eval), accuracy=accuracy,
                     seconds=time.perf_counter() - started)


def plot_variances(result: Fed2Depth, path: Path) -> None:
    """A PNG bar plot of the variance per hidden layer, the threshold line and the suggested layer."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    index = [layer.index for layer in result.layers]
    colors = ["tab:orange" if i >= result.suggested else "tab:blue" for i in index]
    ax.bar(index, [layer.variance for layer in result.layers], color=colors)
    ax.axhline(result.threshold, color="tab:red", linestyle="--", label=f"threshold {result.threshold:g}")
    ax.set_xticks(index, [f"{layer.index}\n{layer.kind}" for layer in result.layers])
    ax.set_xlabel("hidden layer (orange: grouped)")
    ax.set_ylabel("preference variance")
    ax.set_ylim(0, max(1.0, *(layer.variance for layer in result.layers)))
    ax.set_title(f"{result.spec.get('name', 'model')} on {result.data}: fed2_from = {result.suggested}")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
