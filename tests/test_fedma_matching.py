"""FedMA's matching core: permutations recovered, growth and its cap, function-preserving re-indexing,
the class-weighted classifier, and the errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from methods.fedma.matching import (
    FedMAError,
    Matching,
    client_slice,
    combine_classifier,
    layer_from_vectors,
    match_layer,
    neuron_vectors,
    prior_mean_vector,
    reindex_next_layer,
)

NOISE = 0.01


def permuted_clients(base: torch.Tensor, clients: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Row-permuted noisy copies of ``base``: client k's row r is base row perms[k][r]."""
    gen = torch.Generator().manual_seed(seed)
    perms = [torch.randperm(len(base), generator=gen) for _ in range(clients)]
    return [base[perm] + NOISE * torch.randn(base.shape, generator=gen, dtype=base.dtype) for perm in perms], perms


def base_to_global(assignment: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """For each base neuron, the global neuron the client's copy of it was matched to."""
    out = torch.empty_like(assignment)
    out[perm] = assignment
    return out


# --- matching ------------------------------------------------------------------------------------


def test_matching_recovers_a_known_permutation() -> None:
    base = torch.randn(16, 30, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    vectors, perms = permuted_clients(base, 4, seed=2)
    # sigma (the clients' variance around their global neuron) well above the noise's 1e-4,
    # and small enough that the prior barely shrinks the averages
    matching = match_layer(vectors, sigma=0.01, seed=3)
    assert isinstance(matching, Matching)
    assert matching.width == 16 and matching.global_vectors.shape == (16, 30)
    assert matching.counts.tolist() == [4] * 16
    mapped = [base_to_global(a, perm) for a, perm in zip(matching.assignments, perms)]
    for other in mapped[1:]:
        assert torch.equal(other, mapped[0])
    assert sorted(mapped[0].tolist()) == list(range(16))
    error = (matching.global_vectors[mapped[0]] - base).abs().max().item()
    assert error < 4 * NOISE


def test_global_neurons_are_the_posterior_means_of_their_members() -> None:
    base = torch.randn(10, 12, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    vectors, _ = permuted_clients(base, 3, seed=5)
    sigma, sigma0 = 0.5, 2.0
    mu0 = prior_mean_vector(12)
    matching = match_layer(vectors, sigma=sigma, sigma0=sigma0, seed=0)
    totals = mu0 / sigma0 + sum(torch.zeros(matching.width, 12, dtype=torch.float64).index_add(0, a, v / sigma)
                                for a, v in zip(matching.assignments, vectors))
    counts = sum(torch.bincount(a, minlength=matching.width) for a in matching.assignments)
    assert torch.equal(matching.counts, counts)
    expected = totals / (1 / sigma0 + counts[:, None] / sigma)
    torch.testing.assert_close(matching.global_vectors, expected, rtol=1e-12, atol=1e-12)


def test_default_matching_keeps_the_width_of_matching_clients_and_is_seeded() -> None:
    base = torch.randn(16, 30, generator=torch.Generator().manual_seed(6))
    vectors, perms = permuted_clients(base, 5, seed=7)
    first = match_layer(vectors, seed=11)
    again = match_layer(vectors, seed=11)
    assert first.width == 16
    assert first.global_vectors.dtype == torch.float32
    assert torch.equal(first.global_vectors, again.global_vectors)
    assert all(torch.equal(a, b) for a, b in zip(first.assignments, again.assignments))
    mapped = [base_to_global(a, perm) for a, perm in zip(first.assignments, perms)]
    assert all(torch.equal(m, mapped[0]) for m in mapped)


def clients_with_private_neurons(clients: int, shared: int = 12, private: int = 4) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(8)
    common = torch.randn(shared, 30, generator=gen, dtype=torch.float64)
    vectors = []
    for _ in range(clients):
        own = 6.0 * torch.randn(private, 30, generator=gen, dtype=torch.float64)   # far from all else
        rows = torch.cat([common + NOISE * torch.randn(common.shape, generator=gen, dtype=torch.float64), own])
        vectors.append(rows[torch.randperm(len(rows), generator=gen)])
    return vectors


def test_new_neurons_grow_the_global_layer() -> None:
    vectors = clients_with_private_neurons(4)
    matching = match_layer(vectors, seed=0)
    assert matching.width == 12 + 4 * 4
    assert sorted(matching.counts.tolist()) == [1] * 16 + [4] * 12
    for assignment in matching.assignments:
        assert assignment.unique().numel() == assignment.numel() == 16


def test_the_cap_stops_growth_at_exactly_max_width() -> None:
    vectors = clients_with_private_neurons(4)
    matching = match_layer(vectors, seed=0, max_width=20)
    assert matching.width == 20
    assert int(matching.counts.sum()) == 4 * 16
    for assignment in matching.assignments:
        assert assignment.unique().numel() == 16 and int(assignment.max()) < 20
    assert match_layer(vectors, seed=0, max_width=16).width == 16


def test_one_client_and_unequal_widths() -> None:
    base = torch.randn(8, 6, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    alone = match_layer([base], sweeps=2)
    assert alone.width == 8 and alone.assignments[0].tolist() == list(range(8))
    torch.testing.assert_close(alone.global_vectors, (base + prior_mean_vector(6)) / 2)
    narrow = base[:5] + 1e-3
    matching = match_layer([narrow, base], seed=1)       # the wider client starts the global layer
    assert matching.width == 8
    assert matching.assignments[0].numel() == 5 and matching.assignments[1].numel() == 8


# --- neuron vectors ------------------------------------------------------------------------------


@pytest.mark.parametrize("layer", [nn.Linear(5, 4), nn.Conv2d(3, 4, 3)])
def test_neuron_vectors_round_trip(layer: nn.Module) -> None:
    vectors = neuron_vectors(layer.weight, layer.bias)
    assert vectors.shape == (4, layer.weight[0].numel() + 1)
    assert torch.equal(vectors[2, :-1], layer.weight[2].flatten())     # input channel, kh, kw order
    assert torch.equal(vectors[:, -1], layer.bias)
    weight, bias = layer_from_vectors(vectors, layer.weight.shape[1:])
    assert torch.equal(weight, layer.weight) and torch.equal(bias, layer.bias)


def test_prior_mean_vector() -> None:
    assert prior_mean_vector(4).tolist() == [0.0, 0.0, 0.0, 0.1]
    assert prior_mean_vector(3, None).tolist() == [0.0, 0.0, 0.0]
    assert prior_mean_vector(3, 0, weight_mean=1.0, bias_mean=2.0).tolist() == [2.0, 1.0, 1.0]


# --- re-indexing ---------------------------------------------------------------------------------


def scattered(layer: nn.Module, assignment: torch.Tensor, global_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer l at the global width: the client's neurons at their global rows, zero neurons elsewhere."""
    own = neuron_vectors(layer.weight, layer.bias)
    vectors = torch.zeros(global_width, own.shape[1]).index_copy(0, assignment, own)
    return layer_from_vectors(vectors, layer.weight.shape[1:])


def assignment_into(width: int, global_width: int, seed: int) -> torch.Tensor:
    return torch.randperm(global_width, generator=torch.Generator().manual_seed(seed))[:width]


def test_reindexing_keeps_an_mlp_function() -> None:
    torch.manual_seed(0)
    first, second = nn.Linear(8, 16), nn.Linear(16, 5)
    x = torch.randn(20, 8)
    assignment = assignment_into(16, 24, seed=1)
    w1, b1 = scattered(first, assignment, 24)
    w2 = reindex_next_layer(second.weight, assignment, 24)
    with torch.no_grad():
        expected = second(F.relu(first(x)))
        got = F.linear(F.relu(F.linear(x, w1, b1)), w2, second.bias)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert torch.equal(client_slice(w2, assignment), second.weight)


def test_reindexing_keeps_a_conv_function() -> None:
    torch.manual_seed(1)
    first, second = nn.Conv2d(3, 6, 3), nn.Conv2d(6, 7, 3)
    x = torch.randn(4, 3, 9, 9)
    assignment = assignment_into(6, 10, seed=2)
    w1, b1 = scattered(first, assignment, 10)
    w2 = reindex_next_layer(second.weight, assignment, 10)
    assert w2.shape == (7, 10, 3, 3)
    with torch.no_grad():
        expected = second(F.relu(first(x)))
        got = F.conv2d(F.relu(F.conv2d(x, w1, b1)), w2, second.bias)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert torch.equal(client_slice(w2, assignment), second.weight)


def test_reindexing_through_a_flatten_moves_each_channel_block() -> None:
    torch.manual_seed(2)
    conv, linear = nn.Conv2d(3, 6, 3), nn.Linear(6 * 4 * 4, 5)       # 6x6 input: 4x4 per channel
    x = torch.randn(4, 3, 6, 6)
    assignment = assignment_into(6, 9, seed=3)
    w1, b1 = scattered(conv, assignment, 9)
    w2 = reindex_next_layer(linear.weight, assignment, 9, per_channel=16)
    assert w2.shape == (5, 9 * 16)
    with torch.no_grad():
        expected = linear(F.relu(conv(x)).flatten(1))
        got = F.linear(F.relu(F.conv2d(x, w1, b1)).flatten(1), w2, linear.bias)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert torch.equal(client_slice(w2, assignment, per_channel=16), linear.weight)


def test_matched_layer_and_reindexed_next_layer_keep_each_client_close() -> None:
    """End to end: a client's MLP at the global width computes nearly what it did."""
    torch.manual_seed(3)
    first, second = nn.Linear(8, 16), nn.Linear(16, 5)
    with torch.no_grad():
        first.weight.mul_(3.0)          # neurons of magnitude ~1, as a trained layer's
    base = neuron_vectors(first.weight, first.bias).double()
    vectors, perms = permuted_clients(base, 3, seed=4)
    matching = match_layer(vectors, sigma=0.01, seed=5)
    x = torch.randn(20, 8, dtype=torch.float64)
    w1, b1 = layer_from_vectors(matching.global_vectors, (8,))
    for vec, perm, assignment in zip(vectors, perms, matching.assignments):
        own_w, own_b = layer_from_vectors(vec, (8,))
        next_w = second.weight.double()[:, perm]         # the client's next layer reads its own order
        expected = F.linear(F.relu(F.linear(x, own_w, own_b)), next_w)
        got = F.linear(F.relu(F.linear(x, w1, b1)), reindex_next_layer(next_w, assignment, matching.width))
        torch.testing.assert_close(got, expected, rtol=0, atol=0.1)


# --- classifier ----------------------------------------------------------------------------------


def test_combine_classifier_by_hand() -> None:
    weights = [torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]),
               torch.tensor([[3.0, 0.0], [1.0, 1.0], [7.0, 8.0]])]
    biases = [torch.tensor([1.0, 1.0, 1.0]), torch.tensor([5.0, 3.0, -1.0])]
    counts = [torch.tensor([1, 0, 0]), torch.tensor([3, 2, 0])]
    weight, bias = combine_classifier(weights, biases, counts)
    # class 0: 1/4 and 3/4; class 1: only client 1; class 2: nobody, plain mean
    assert weight.tolist() == [[2.5, 0.5], [1.0, 1.0], [6.0, 7.0]]
    assert bias.tolist() == [4.0, 3.0, 0.0]


def test_combine_classifier_three_clients() -> None:
    weights = [torch.tensor([[2.0]]), torch.tensor([[4.0]]), torch.tensor([[10.0]])]
    biases = [torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([2.0])]
    counts = [torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([2.0])]
    weight, bias = combine_classifier(weights, biases, counts)
    assert weight.tolist() == [[6.5]] and bias.tolist() == [1.25]


# --- errors --------------------------------------------------------------------------------------


def test_match_layer_input_errors() -> None:
    with pytest.raises(FedMAError, match="at least one client"):
        match_layer([])
    with pytest.raises(FedMAError, match=r"client 1's neurons have D = 7 but client 0's have D = 6.*same layer"):
        match_layer([torch.randn(4, 6), torch.randn(4, 7)])
    with pytest.raises(FedMAError, match="non-empty"):
        match_layer([torch.randn(4, 6), torch.randn(0, 6)])
    with pytest.raises(FedMAError, match="NaN"):
        match_layer([torch.full((2, 3), float("nan"))])
    with pytest.raises(FedMAError, match=r"max_width 3 .*set max_width >= 4"):
        match_layer([torch.randn(4, 6)], max_width=3)
    with pytest.raises(FedMAError, match="sigma must be a positive"):
        match_layer([torch.randn(4, 6)], sigma=0.0)
    with pytest.raises(FedMAError, match="prior_mean_vector"):
        match_layer([torch.randn(4, 6)], prior_mean=torch.zeros(5))


def test_layer_and_reindex_errors() -> None:
    with pytest.raises(FedMAError, match="nn.Linear weight"):
        neuron_vectors(torch.randn(4), torch.randn(4))
    with pytest.raises(FedMAError, match="same layer's bias"):
        neuron_vectors(torch.randn(4, 3), torch.randn(5))
    with pytest.raises(FedMAError, match="D = 5"):
        layer_from_vectors(torch.randn(2, 5), (3, 2))
    with pytest.raises(FedMAError, match="per_channel"):
        reindex_next_layer(torch.randn(5, 32), torch.arange(4), 6)
    with pytest.raises(FedMAError, match="outside 0..5"):
        reindex_next_layer(torch.randn(5, 4), torch.tensor([0, 1, 2, 6]), 6)
    with pytest.raises(FedMAError, match="same global neuron"):
        reindex_next_layer(torch.randn(5, 4), torch.tensor([0, 1, 1, 2]), 6)
    with pytest.raises(FedMAError, match="multiple of per_channel"):
        client_slice(torch.randn(5, 30), torch.arange(2), per_channel=4)
    with pytest.raises(FedMAError, match="reindex_next_layer first"):
        combine_classifier([torch.randn(3, 4), torch.randn(3, 5)], [torch.randn(3)] * 2, [torch.ones(3)] * 2)
    with pytest.raises(FedMAError, match=">= 0"):
        combine_classifier([torch.randn(3, 4)], [torch.randn(3)], [torch.tensor([1.0, -1.0, 0.0])])
    with pytest.raises(FedMAError, match="one weight, bias and class-count"):
        combine_classifier([], [], [])
