"""Attribute skew (``attribute:KIND:DOMAINS[+LABEL_SPEC]``): clients whose images differ in a non-causal
attribute (colour, rotation, contrast) rather than in their labels, for methods that must tell the
two apart; and the normalization and evaluation split a model trained under such a partition needs.

``attribute:colorlabel:DOMAINS:P`` is the Colored-MNIST kind of attribute skew: within each client the
colour predicts the label (a spurious correlation of strength ``P``), the correlation differs between
clients, and the coordinator's test split has none, so a model that learned colour instead of shape
fails there.
"""

from __future__ import annotations

import colorsys
import math
from dataclasses import dataclass

import numpy as np

from edge_client.datasets import Dataset
from edge_client.label_partitions import parse_label_spec
from storage.pixels import DataError, Normalization

__all__ = ["ATTRIBUTE_KINDS", "COLOR_KINDS", "COLOR_NORMALIZATION", "AttributeSkew", "parse_attribute_skew", "domain_palette",
           "model_normalization", "pixel_normalization", "intensity_range", "evaluation_split"]

ATTRIBUTE_KINDS = ("color", "rotate", "invert", "colorlabel")
COLOR_KINDS = ("color", "colorlabel")   # the kinds that paint grayscale images in RGB
# Seeds the colorlabel draws with (seed, client, this) and the test split's colours with (this,): a
# fixed tag keeps them apart from every other stream drawn from the run seed.
_COLORLABEL_STREAM = 0x636F6C
# Colour domains (attribute:color) are RGB centred on 0.5: their own normalization, whatever the data set's.
COLOR_NORMALIZATION = Normalization((0.5,) * 3, (0.5,) * 3)


@dataclass(frozen=True)
class AttributeSkew:
    """``attribute:KIND:DOMAINS[+LABEL_SPEC]``: clients differ in how their images look, not in labels.

    Client ``i`` belongs to domain ``i % DOMAINS``; its domain changes one attribute
    that does not decide the label: ``color`` paints background and foreground of a
    grayscale image with the domain's two colours (3 channels), ``rotate`` turns the
    image by ``360 * domain / DOMAINS`` degrees, ``invert`` shows the odd domains' images
    with inverted contrast (light background, dark ink) and the even domains' as they
    are. ``colorlabel`` (``attribute:colorlabel:DOMAINS:P``) paints each image in one
    of C colours (C = the class count; the palette of ``color`` with C domains) that
    follows its label inside a client: client ``i`` has shift ``s = i % DOMAINS`` and
    paints a class-``c`` image in colour ``(c + s) mod C`` with probability ``correlation``
    (P), else in one of the C - 1 other colours, uniformly; so the colour predicts the
    label within a client, differently in each domain, and P = 1/C is no correlation.
    Who owns which sample is decided by LABEL_SPEC (``iid`` when absent, or e.g.
    ``dirichlet:0.5`` to add label skew).
    """

    kind: str
    domains: int
    labels: str = "iid"
    correlation: float = 0.0      # colorlabel: the share of a client's images in its class's colour

    def domain_of(self, index: int) -> int:
        return index % self.domains

    def looks(self, y: np.ndarray, index: int | None, seed: int, classes: int) -> np.ndarray:
        """What :meth:`apply` takes for images with labels ``y``: of client ``index`` (its partition's
        rows, in partition order), or of the coordinator's test split when ``index`` is None.

        For ``colorlabel`` each image's colour, drawn from (seed, client), so every process paints a
        client's images alike; the test split's colours are uniform and drawn from a fixed seed, the
        same in every run, and independent of the labels. For the other kinds each image's domain
        (the test split shows every domain equally: image ``j`` in domain ``j % DOMAINS``).
        """
        if self.kind != "colorlabel":
            return np.arange(len(y)) % self.domains if index is None else np.full(len(y), self.domain_of(index))
        self._check_classes(classes)
        if index is None:
            return np.random.default_rng([_COLORLABEL_STREAM]).integers(0, classes, len(y))
        rng = np.random.default_rng([seed, index, _COLORLABEL_STREAM])
        follows = rng.random(len(y)) < self.correlation
        other = rng.integers(1, classes, len(y))     # an offset of 1 .. C-1: any other colour, uniformly
        colour = (np.asarray(y, np.int64) + self.domain_of(index)) % classes
        return np.where(follows, colour, (colour + other) % classes)

    def _check_classes(self, classes: int) -> None:
        if classes < 2 or self.domains > classes:
            raise DataError(f"attribute:colorlabel:{self.domains} needs a data set with at least 2 classes and "
                            f"no more domains than classes (each domain shifts the class colours by its own "
                            f"offset), got {classes} classes; use at most {max(classes, 1)} domains")

    def apply(self, x: np.ndarray, domains: np.ndarray, intensity: tuple[float, float],
              classes: int = 0) -> np.ndarray:
        """Images ``x`` [N, C, H, W] as seen in ``domains`` [N] (one domain per image; for ``colorlabel``
        one colour of ``classes`` per image, from :meth:`looks`)."""
        if self.kind == "colorlabel":
            self._check_classes(classes)
            return _colorize(x, domains, classes, intensity)
        if self.kind == "color":
            return _colorize(x, domains, self.domains, intensity)
        if self.kind == "invert":
            lo, hi = intensity
            return np.where((domains % 2 == 1)[:, None, None, None], np.float32(lo + hi) - x, x).astype(np.float32)
        return _rotate(x, domains, self.domains, fill=intensity[0])


def parse_attribute_skew(spec: str) -> AttributeSkew | None:
    """The attribute skew a partition spec asks for; None for a plain label partition."""
    if not spec.startswith("attribute:"):
        return None
    head, plus, labels = spec.partition("+")
    parts = head.split(":")
    arity = 4 if len(parts) > 1 and parts[1] == "colorlabel" else 3
    valid = (len(parts) == arity and parts[1] in ATTRIBUTE_KINDS and parts[2].isdigit() and int(parts[2]) >= 1
             and (not plus or (labels != "" and not labels.startswith("attribute:"))))
    if not valid:
        raise DataError(f"bad partition spec {spec!r}; attribute skew is attribute:KIND:DOMAINS[+LABEL_SPEC] "
                        f"with KIND one of {', '.join(k for k in ATTRIBUTE_KINDS if k != 'colorlabel')}, or "
                        f"attribute:colorlabel:DOMAINS:P[+LABEL_SPEC] (P: the colour-label correlation in [0, 1]); "
                        f"DOMAINS >= 1 and LABEL_SPEC a plain spec (iid, dirichlet:ALPHA, shards:K), e.g. "
                        f"attribute:color:5+dirichlet:0.5 or attribute:colorlabel:10:0.9")
    correlation = 0.0
    if arity == 4:
        try:
            correlation = float(parts[3])
        except ValueError:
            correlation = math.nan
        if not 0.0 <= correlation <= 1.0:   # also refuses nan
            raise DataError(f"bad partition spec {spec!r}: attribute:colorlabel:DOMAINS:P needs P, the share of a "
                            f"client's images painted in their class's colour, a number in [0, 1] (1/classes: no "
                            f"correlation), got {parts[3]!r}")
    if plus:
        parse_label_spec(labels)
    return AttributeSkew(parts[1], int(parts[2]), labels or "iid", correlation)


def domain_palette(domain: int, domains: int) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """(foreground, background) RGB in [0, 1] of a colour domain.

    Backgrounds are dark and evenly spread around the hue circle; each foreground
    is a light colour of the opposite hue, so every domain stays readable.
    """
    hue = (domain % domains) / domains
    return colorsys.hsv_to_rgb((hue + 0.5) % 1.0, 0.5, 1.0), colorsys.hsv_to_rgb(hue, 0.8, 0.5)


def model_normalization(dataset: Dataset, partition_spec: str) -> Normalization | None:
    """The normalization of the inputs a model trained on ``dataset`` under ``partition_spec`` gets, for its
    spec: the data set's, except colour domains, which are RGB with their own. Rotation and inverted
    contrast keep the data set's (they move and mirror intensities within its range)."""
    skew = parse_attribute_skew(partition_spec)
    if skew is not None and skew.kind in COLOR_KINDS:
        return COLOR_NORMALIZATION
    return dataset.normalization


def pixel_normalization(model: Normalization | None, partition_spec: str) -> Normalization | None:
    """What to normalize a data set's pixels with so that, under ``partition_spec``, they become the inputs
    of a model whose spec says ``model``: ``model`` itself, except under colour domains, which set their
    own (None: the data set's own, as the run loaded it)."""
    skew = parse_attribute_skew(partition_spec)
    return None if skew is not None and skew.kind in COLOR_KINDS else model


def intensity_range(dataset: Dataset) -> tuple[float, float]:
    """Darkest and brightest value of the dataset's train split (its test split when the train split was
    not loaded; Fashion-MNIST's have the same): background and full ink."""
    x = dataset.x_train if len(dataset.x_train) else dataset.x_test
    return float(x.min()), float(x.max())


def _colorize(x: np.ndarray, domains: np.ndarray, count: int, intensity: tuple[float, float]) -> np.ndarray:
    if x.shape[1] != 1:
        raise DataError(f"attribute:color needs grayscale images (1 channel), got {x.shape[1]} channels; "
                        "use attribute:rotate for colour images")
    lo, hi = intensity
    ink = np.clip((x - lo) / max(hi - lo, 1e-12), 0.0, 1.0)            # [N, 1, H, W] in [0, 1]
    palettes = [domain_palette(d, count) for d in range(count)]
    fg = np.array([p[0] for p in palettes], np.float32)[domains][:, :, None, None]   # [N, 3, 1, 1]
    bg = np.array([p[1] for p in palettes], np.float32)[domains][:, :, None, None]
    rgb = bg + (fg - bg) * ink
    return COLOR_NORMALIZATION.apply(rgb, 1.0)                         # centred, in [-1, 1]


def _rotate(x: np.ndarray, domains: np.ndarray, count: int, fill: float) -> np.ndarray:
    """Each image turned counter-clockwise by its domain's angle about its centre (bilinear)."""
    out = x.copy()
    size = x.shape[2]
    centre = (size - 1) / 2.0
    rows, cols = np.meshgrid(np.arange(size) - centre, np.arange(size) - centre, indexing="ij")
    for d in np.unique(domains):
        angle = 2 * math.pi * int(d) / count
        if angle == 0:
            continue
        cos, sin = round(math.cos(angle), 12), round(math.sin(angle), 12)
        # Where each output pixel comes from: the inverse rotation of its position.
        src_r = cos * rows + sin * cols + centre
        src_c = -sin * rows + cos * cols + centre
        r0, c0 = np.floor(src_r).astype(int), np.floor(src_c).astype(int)
        fr, fc = (src_r - r0).astype(np.float32), (src_c - c0).astype(np.float32)
        pick = domains == d
        images = x[pick]
        acc = np.zeros_like(images)
        for dr, dc, w in ((0, 0, (1 - fr) * (1 - fc)), (0, 1, (1 - fr) * fc), (1, 0, fr * (1 - fc)), (1, 1, fr * fc)):
            rr, cc = r0 + dr, c0 + dc
            inside = (rr >= 0) & (rr < size) & (cc >= 0) & (cc < size)
            values = images[:, :, np.clip(rr, 0, size - 1), np.clip(cc, 0, size - 1)]
            acc += w * np.where(inside, values, np.float32(fill))
        out[pick] = acc
    return out


def evaluation_split(dataset: Dataset, partition_spec: str) -> tuple[np.ndarray, np.ndarray]:
    """The coordinator's test split, as the clients' data looks under ``partition_spec``.

    With attribute skew every domain is equally present (test image ``i`` is shown in
    domain ``i % DOMAINS``), so the global model is judged on all domains, and the
    images have the clients' channel count; with ``colorlabel`` each test image has a
    random colour, whatever its label (:meth:`AttributeSkew.looks`): the clients'
    correlation is broken, so only a model that reads the shape scores well.
    Otherwise the test split as it is.
    """
    skew = parse_attribute_skew(partition_spec)
    if skew is None:
        return dataset.x_test, dataset.y_test
    looks = skew.looks(dataset.y_test, None, 0, dataset.num_classes)
    return skew.apply(dataset.x_test, looks, intensity_range(dataset), dataset.num_classes), dataset.y_test
