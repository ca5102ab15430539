"""The colour-label attribute skew (``attribute:colorlabel:DOMAINS:P``): each client's colour follows its
labels with its own shift, the coordinator's test split breaks the correlation, bad specs are refused."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.data import (COLOR_NORMALIZATION, DataError, arrange_clients, client_split, domain_palette,
                              evaluation_split, holdout_split, load_dataset, model_normalization,
                              parse_attribute_skew)

SPEC = "attribute:colorlabel:5:0.8"


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def colours_of(x: np.ndarray, classes: int = 10) -> np.ndarray:
    """Each image's colour index, read off its corner pixel (blank in digits: the background colour)."""
    backgrounds = 2 * np.array([domain_palette(c, classes)[1] for c in range(classes)]) - 1   # stored centred
    corner = x[:, :, 0, 0]
    return np.abs(corner[:, None, :] - backgrounds[None]).sum(2).argmin(1)


def test_parse_reads_domains_and_correlation():
    skew = parse_attribute_skew("attribute:colorlabel:10:0.9+dirichlet:0.5")
    assert (skew.kind, skew.domains, skew.correlation, skew.labels) == ("colorlabel", 10, 0.9, "dirichlet:0.5")
    assert parse_attribute_skew("attribute:color:5").correlation == 0.0


@pytest.mark.parametrize("bad", ["attribute:colorlabel:5", "attribute:colorlabel:5:1.5", "attribute:colorlabel:5:-0.1",
                                 "attribute:colorlabel:5:nan", "attribute:colorlabel:5:high", "attribute:colorlabel:0:0.5",
                                 "attribute:colorlabel:5:0.9+", "attribute:color:5:0.9", "attribute:colorlabel:5:0.9:1"])
def test_bad_specs_are_refused(bad):
    with pytest.raises(DataError, match="colorlabel"):
        parse_attribute_skew(bad)


def test_more_domains_than_classes_is_refused(digits):
    with pytest.raises(DataError, match="no more domains than classes"):
        client_split(digits, "attribute:colorlabel:11:0.9", 0, 11, 0)


def test_deterministic_in_spec_seed_and_client(digits):
    a = client_split(digits, SPEC, 3, 5, seed=7)
    b = client_split(digits, SPEC, 3, 5, seed=7)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert a[0].shape[1] == 3 and a[0].dtype == np.float32
    other_seed = client_split(digits, SPEC, 3, 5, seed=8)[0]
    assert not np.array_equal(colours_of(a[0]), colours_of(other_seed[: len(a[0])]))
    assert model_normalization(digits, SPEC) == COLOR_NORMALIZATION


def test_arranged_clients_see_what_each_device_sees(digits):
    """A simulation's shared arrangement paints every client's rows as that client's device would."""
    rows = arrange_clients(digits, SPEC, 5, 2, 0.25, [11, 12, 13, 14, 15])
    for index, holdout_seed in enumerate([11, 12, 13, 14, 15]):
        x, y = client_split(digits, SPEC, index, 5, 2)
        expected = holdout_split(x, y, 0.25, holdout_seed)
        for got, want in zip(rows.client(index), expected):
            assert np.array_equal(got, want)


def test_within_client_the_colour_follows_the_label_as_configured():
    labels = np.random.default_rng(0).integers(0, 10, 40_000)
    skew = parse_attribute_skew(SPEC)
    for index in (0, 1, 7):
        colour = skew.looks(labels, index, 0, 10)
        shift = index % 5
        follows = colour == (labels + shift) % 10
        assert abs(follows.mean() - 0.8) < 0.01
        # the rest are spread over the 9 other colours
        offsets = (colour[~follows] - labels[~follows] - shift) % 10
        assert set(np.unique(offsets)) == set(range(1, 10))
        assert np.abs(np.bincount(offsets, minlength=10)[1:] / (~follows).sum() - 1 / 9).max() < 0.01
    assert (parse_attribute_skew("attribute:colorlabel:5:1").looks(labels, 2, 0, 10) == (labels + 2) % 10).all()


def test_client_images_carry_their_domains_correlation(digits):
    for index in range(5):
        x, y = client_split(digits, "attribute:colorlabel:5:0.9", index, 5, 0)
        share = (colours_of(x) == (y + index) % 10).mean()
        assert 0.84 < share < 0.96, (index, share)
        # another domain's mapping is as rare as chance: the correlations differ between clients
        assert (colours_of(x) == (y + index + 1) % 10).mean() < 0.05


def test_test_split_carries_no_correlation(digits):
    x, y = evaluation_split(digits, SPEC)
    assert x.shape[1] == 3 and np.array_equal(y, digits.y_test)
    colours = colours_of(x)
    assert set(np.unique(colours)) == set(range(10))
    assert np.array_equal(x, evaluation_split(digits, SPEC)[0])   # the same test images in every run
    # on many labels: every shift's mapping holds for about 1/C of the images, and colour is independent of label
    labels = np.random.default_rng(1).integers(0, 10, 50_000)
    drawn = parse_attribute_skew(SPEC).looks(labels, None, 0, 10)
    for shift in range(10):
        assert abs((drawn == (labels + shift) % 10).mean() - 0.1) < 0.01
    table = np.histogram2d(labels, drawn, bins=10)[0] / len(labels)
    assert np.abs(table - np.outer(table.sum(1), table.sum(0))).max() < 0.003


def test_model_card_names_the_colours_and_their_normalization():
    from export.card import input_normalization

    card = input_normalization("fashion-mnist", "attribute:colorlabel:10:0.9", 3)
    assert card["mean"] == [0.5] * 3 and card["std"] == [0.5] * 3
    assert "probability 0.9" in card["note"] and "random colours" in card["note"]
