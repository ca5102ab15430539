"""Secure aggregation's core: Shamir sharing, key agreement and AEAD, modular masking, the neighbour graph,
and whole rounds in memory with dropouts, with real cryptography throughout."""

from __future__ import annotations

import base64
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_client.secagg import (Advertise, ForwardedShares, MaskedInput, MaskedSum, PublicKeys, RefusedError,
                                RoundFailedError, SecAggParams, ShareBundle, UnmaskRequest, UnmaskResponse, advertise, aggregate,
                                collect_keys, graph, keys, masked_input, masking, request_unmask, route_shares,
                                shamir, share, unmask)
from edge_client.secagg.errors import DecryptionError, MessageError, ParamsError, ShareError
from storage.errors import FedgeError


# -- Shamir -----------------------------------------------------------------------------------------------------
def _shares(secret: bytes, n: int, t: int) -> list[tuple[int, int]]:
    points = [shamir.point_of(i) for i in range(n)]
    return list(zip(points, shamir.split(secret, points, t)))


def test_the_field_prime_is_prime_and_holds_every_32_byte_secret():
    p = shamir.PRIME
    assert p > 2**256
    d, r = p - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41):   # Miller-Rabin, each base a witness test
        x = pow(a, d, p)
        assert x in (1, p - 1) or any(pow(x, 2**k, p) == p - 1 for k in range(1, r))


@pytest.mark.parametrize("n,t", [(5, 3), (7, 4), (2, 2), (4, 1)])
def test_any_t_shares_reconstruct_and_t_minus_one_do_not(n, t):
    rng = np.random.default_rng(n * 10 + t)
    secret = os.urandom(32)
    shares = _shares(secret, n, t)
    for _ in range(10):
        pick = [shares[i] for i in rng.choice(n, size=t, replace=False)]
        assert shamir.reconstruct(pick, t) == secret
    assert shamir.reconstruct(shares, t) == secret          # all of them, the extras checked
    if t > 1:
        fewer = [shares[i] for i in rng.choice(n, size=t - 1, replace=False)]
        assert shamir.interpolate(fewer).to_bytes(33, "big")[1:] != secret
        with pytest.raises(ShareError, match="cannot reconstruct"):
            shamir.reconstruct(fewer, t)


def test_extreme_secrets_round_trip():
    for secret in (bytes(32), b"\xff" * 32):
        assert shamir.reconstruct(_shares(secret, 5, 3)[2:], 3) == secret


def test_duplicate_and_out_of_field_shares_are_refused():
    shares = _shares(os.urandom(32), 5, 3)
    with pytest.raises(ShareError, match="duplicate share points"):
        shamir.reconstruct([shares[0], shares[1], shares[1]], 3)
    with pytest.raises(ShareError, match="outside the field"):
        shamir.reconstruct([shares[0], shares[1], (0, 5)], 3)
    with pytest.raises(ShareError, match="outside the field"):
        shamir.reconstruct([shares[0], shares[1], (3, shamir.PRIME)], 3)
    with pytest.raises(ShareError, match="not below the field prime"):
        shamir.share_from_bytes(shamir.PRIME.to_bytes(33, "big"))
    with pytest.raises(ShareError, match="33 bytes"):
        shamir.share_from_bytes(b"\x00" * 32)
    with pytest.raises(ShareError, match="distinct"):
        shamir.split(os.urandom(32), [1, 2, 2], 2)


def test_an_altered_share_is_caught_when_there_are_spare_ones():
    shares = _shares(os.urandom(32), 5, 3)
    x, y = shares[4]
    with pytest.raises(ShareError, match="was altered"):
        shamir.reconstruct(shares[:4] + [(x, (y + 1) % shamir.PRIME)], 3)


# -- keys and AEAD ----------------------------------------------------------------------------------------------
def test_both_sides_derive_the_same_key_and_other_infos_give_other_keys():
    a, b, c = keys.generate_keypair(), keys.generate_keypair(), keys.generate_keypair()
    info = keys.pair_info("mask", 3, 1, 2)
    assert info == keys.pair_info("mask", 3, 2, 1)
    k_ab = keys.agree(a.private, b.public, info)
    assert k_ab == keys.agree(b.private, a.public, info) and len(k_ab) == 32
    assert k_ab != keys.agree(a.private, c.public, info)
    assert k_ab != keys.agree(a.private, b.public, keys.pair_info("mask", 4, 1, 2))
    assert k_ab != keys.agree(a.private, b.public, keys.pair_info("encrypt", 3, 1, 2))
    assert keys.public_key_of(a.private) == a.public
    assert a.private.hex() not in repr(a)


def test_bad_public_keys_are_refused():
    a = keys.generate_keypair()
    with pytest.raises(MessageError, match="low-order"):
        keys.agree(a.private, bytes(32), b"i")
    with pytest.raises(MessageError, match="32 raw bytes"):
        keys.agree(a.private, a.public[:31], b"i")


def test_aead_rejects_tampering_and_other_associated_data():
    key = keys.agree(keys.generate_keypair().private, keys.generate_keypair().public, b"enc")
    sealed = keys.encrypt(key, b"share bytes", b"round 1, 2 -> 3")
    assert keys.decrypt(key, sealed, b"round 1, 2 -> 3") == b"share bytes"
    tampered = bytearray(sealed)
    tampered[-20] ^= 1
    with pytest.raises(DecryptionError, match="altered"):
        keys.decrypt(key, bytes(tampered), b"round 1, 2 -> 3")
    with pytest.raises(DecryptionError):
        keys.decrypt(key, sealed, b"round 1, 3 -> 2")
    with pytest.raises(DecryptionError):
        keys.decrypt(key, sealed[:10], b"round 1, 2 -> 3")
    with pytest.raises(DecryptionError):
        keys.decrypt(os.urandom(32), sealed, b"round 1, 2 -> 3")


# -- quantization and masks -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 16, 31, 32, 40, 64])
def test_quantized_sums_wrap_and_decode_with_their_sign(bits):
    rng = np.random.default_rng(bits)
    clip, n = 1.0, 4
    scale = float(((1 << (bits - 1)) - 1) // (n * 2))   # room for n clipped vectors
    assert masking.capacity_ok(n, clip, scale, bits)
    xs = rng.uniform(-1.5, 1.5, size=(n, 50))
    total = np.zeros(50, dtype=masking.word_dtype(bits))
    for x in xs:
        total = masking.add_mod(total, masking.quantize(x, clip, scale, bits), bits)
    assert int(total.max()) < 1 << bits
    expected = np.clip(xs, -clip, clip).sum(axis=0)
    assert np.abs(masking.dequantize(total, scale, bits) - expected).max() <= n * 0.5 / scale + 1e-12


def test_capacity_bound():
    assert masking.capacity_ok(100, 1.0, 2**24, 32) and not masking.capacity_ok(200, 1.0, 2**24, 32)
    with pytest.raises(ParamsError, match="in 8..64"):
        masking.capacity_ok(2, 1.0, 1.0, 65)


def test_stochastic_rounding_is_unbiased():
    q = masking.quantize(np.full(20000, 0.25), 1.0, 1.0, 16, rng=np.random.default_rng(0))
    assert set(masking.dequantize(q, 1.0, 16).tolist()) == {0.0, 1.0}
    assert abs(masking.dequantize(q, 1.0, 16).mean() - 0.25) < 0.02


def test_masks_cancel_and_the_prg_is_deterministic():
    a, b = os.urandom(32), os.urandom(32)
    assert np.array_equal(masking.prg(a, 100, 20), masking.prg(a, 100, 20))
    assert not np.array_equal(masking.prg(a, 100, 20), masking.prg(b, 100, 20))
    assert int(masking.prg(a, 1000, 20).max()) < 1 << 20
    zero = masking.add_mod(masking.combined_mask(100, 20, [a], [b]), masking.combined_mask(100, 20, [b], [a]), 20)
    assert not zero.any()


def test_wire_words_are_checked():
    v = masking.quantize(np.linspace(-1, 1, 10), 1.0, 100.0, 12)
    assert np.array_equal(masking.from_bytes(masking.to_bytes(v, 12), 10, 12), v)
    with pytest.raises(MessageError, match="must be 40 bytes"):
        masking.from_bytes(masking.to_bytes(v, 12)[:-4], 10, 12)
    with pytest.raises(MessageError, match="at or above 2"):
        masking.from_bytes(np.full(10, 1 << 12, dtype="<u4").tobytes(), 10, 12)


def _chi_square(values: np.ndarray, bits: int, buckets: int = 64) -> float:
    counts = np.bincount((values.astype(np.uint64) >> np.uint64(bits - 6)).astype(np.int64), minlength=buckets)
    expected = values.size / buckets
    return float(((counts - expected) ** 2 / expected).sum())


def test_a_masked_vector_looks_uniform_and_the_plain_one_does_not():
    bits, length = 32, 64_000
    x = np.random.default_rng(5).normal(0, 0.1, size=length)
    plain = masking.quantize(x, 1.0, 2.0**20, bits)
    masked = masking.add_mod(plain, masking.combined_mask(length, bits, [os.urandom(32)], [os.urandom(32)]), bits)
    # 63 degrees of freedom: the 99.99th percentile of chi-square is about 123
    assert _chi_square(masked, bits) < 130
    assert _chi_square(plain, bits) > 10_000


# -- the neighbour graph ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,k", [(10, 4), (11, 6), (100, 14), (7, 6), (6, 9)])
def test_the_graph_is_symmetric_regular_and_the_same_from_the_same_seed(n, k):
    g = graph.neighbours(n, k, b"round seed")
    assert g == graph.neighbours(n, k, b"round seed")
    assert g != graph.neighbours(n, k, b"other seed") or k >= n - 1
    degree = min(k, n - 1)
    for i, ns in enumerate(g):
        assert len(ns) == degree and i not in ns
        assert all(i in g[j] for j in ns)


def test_graph_degrees_are_checked_and_suggested():
    with pytest.raises(ParamsError, match="must be even"):
        graph.neighbours(10, 3, b"s")
    with pytest.raises(ParamsError, match="at least 2 clients"):
        graph.neighbours(1, 2, b"s")
    assert graph.suggested_degree(100) == 14 and graph.suggested_degree(5) == 4
    assert issubclass(ParamsError, FedgeError)


# -- whole rounds in memory -------------------------------------------------------------------------------------
def _wire(message):
    """The message as the next party reads it: through its JSON body and back."""
    return type(message).from_body(json.loads(json.dumps(message.to_body())))


def _params(n=10, degree=6, threshold=4, length=40, bits=32, clip=1.0, round_id=7):
    return SecAggParams(round_id, n, degree, threshold, length, clip, masking.largest_scale(n, clip, bits), bits,
                        os.urandom(32))


def _inputs(params, seed=0):
    return np.random.default_rng(seed).uniform(-1.2, 1.2, size=(params.num_clients, params.length))


def _run(params, xs, *, no_share=(), no_input=(), no_answer=(), wire=_wire):
    """One round; clients in ``no_share`` drop after advertising, ``no_input`` after sharing, ``no_answer``
    after sending their masked input."""
    states, adverts = {}, []
    for i in range(params.num_clients):
        states[i], advert = advertise(params, i)
        adverts.append(wire(advert))
    keys = collect_keys(params, adverts)
    bundles = []
    for i in states:
        if i not in no_share:
            states[i], bundle = share(states[i], wire(keys))
            bundles.append(wire(bundle))
    forwarded = route_shares(params, keys, bundles)
    masked = []
    for i, fw in forwarded.items():
        if i not in no_input:
            states[i], m = masked_input(states[i], wire(fw), xs[i])
            masked.append(wire(m))
    request = request_unmask(params, forwarded, masked)
    responses = []
    for i in request.survivors:
        if i not in no_answer:
            states[i], response = unmask(states[i], wire(request))
            responses.append(wire(response))
    return aggregate(params, keys, request, masked, responses), states


def _check_sum(params, xs, result, survivors):
    assert result.survivors == tuple(survivors)
    expected = np.zeros(params.length, dtype=masking.word_dtype(params.bits))
    for i in survivors:
        expected = masking.add_mod(expected, masking.quantize(xs[i], params.clip, params.scale, params.bits),
                                   params.bits)
    assert np.array_equal(result.residues, expected)
    plain = np.clip(xs[list(survivors)], -params.clip, params.clip).sum(axis=0)
    assert np.abs(result.values - plain).max() <= len(survivors) * 0.5 / params.scale + 1e-9


def test_a_round_without_dropouts_sums_exactly():
    params = _params()
    xs = _inputs(params)
    result, _ = _run(params, xs)
    _check_sum(params, xs, result, range(10))


@pytest.mark.parametrize("bits", [16, 64])
def test_other_moduli_sum_exactly(bits):
    params = _params(bits=bits, n=7, degree=4, threshold=3)
    xs = _inputs(params, bits)
    _check_sum(params, xs, _run(params, xs, no_input={2})[0], [0, 1, 3, 4, 5, 6])


@pytest.mark.parametrize("drops", [
    dict(no_input={3}),                      # one client drops after sharing: its mask key is reconstructed
    dict(no_answer={3}),                     # one drops after its masked input: it is still in the sum
    dict(no_share={5}),                      # one drops after advertising: nobody masks with it
    dict(no_input={1, 6}),                   # degree - threshold = 2 dropouts are always tolerated
    dict(no_answer={1, 6}),
    dict(no_input={2}, no_answer={8}),
    dict(no_share={0}, no_input={4}),
])
def test_dropouts_up_to_degree_minus_threshold_keep_the_sum_exact(drops):
    params = _params()
    xs = _inputs(params, 1)
    gone = drops.get("no_share", set()) | drops.get("no_input", set())
    result, _ = _run(params, xs, **drops)
    _check_sum(params, xs, result, [i for i in range(10) if i not in gone])


def test_too_many_silent_neighbours_fail_the_round_with_no_output():
    params = _params()
    xs = _inputs(params, 2)
    silent = set(params.neighbours[0][:3])       # 3 of client 0's 6 neighbours: 3 shares left, 4 needed
    with pytest.raises(RoundFailedError, match="neighbours of client 0 returned a share of its self-mask seed"):
        _run(params, xs, no_answer=silent)


def test_too_many_dropped_neighbours_make_the_client_refuse_and_the_round_fail():
    params = _params()
    xs = _inputs(params, 3)
    with pytest.raises(RefusedError, match="only 3 neighbours shared with client 0"):
        _run(params, xs, no_share=set(params.neighbours[0][:3]))


def test_too_few_survivors_fail_the_round():
    params = _params(n=5, degree=4, threshold=3)
    with pytest.raises(RoundFailedError, match="only 2 clients sent masked inputs"):
        _run(params, _inputs(params), no_input={0, 1, 2})


def _to_unmask(params, xs):
    """Every client's state after masked input, and the messages the server holds."""
    states, adverts = zip(*(advertise(params, i) for i in range(params.num_clients)))
    keys = collect_keys(params, adverts)
    states, bundles = map(list, zip(*(share(s, keys) for s in states)))
    forwarded = route_shares(params, keys, bundles)
    states, masked = map(list, zip(*(masked_input(s, forwarded[i], xs[i]) for i, s in enumerate(states))))
    return states, keys, forwarded, masked


def test_masked_inputs_added_as_they_come_give_the_same_sum_and_refuse_a_second_one():
    params = _params()
    xs = _inputs(params)
    states, keys, forwarded, masked = _to_unmask(params, xs)
    summed = MaskedSum(params, forwarded)
    for m in masked[:-1]:
        summed.add(m)
    with pytest.raises(MessageError, match="sent two masked inputs"):
        summed.add(masked[0])
    request = request_unmask(params, forwarded, summed)           # the last client dropped after sharing
    assert request.survivors == tuple(range(9)) and request.dropped == (9,)
    responses = [unmask(states[i], request)[1] for i in request.survivors]
    held = aggregate(params, keys, request, masked[:-1], responses)
    added = aggregate(params, keys, request, summed, responses)
    assert np.array_equal(added.residues, held.residues)
    _check_sum(params, xs, added, range(9))


def test_a_client_refuses_to_reveal_both_secrets_of_one_neighbour():
    params = _params()
    states, _, _, _ = _to_unmask(params, _inputs(params))
    j = params.neighbours[0][0]
    everyone = tuple(range(10))
    with pytest.raises(RefusedError, match=rf"both the self-mask share and the mask-key share of clients \[{j}\]"):
        unmask(states[0], UnmaskRequest(params.round_id, everyone, (j,)))
    state, first = unmask(states[0], UnmaskRequest(params.round_id, everyone, ()))
    assert j in first.self_shares and not first.key_shares
    assert unmask(state, UnmaskRequest(params.round_id, everyone, ()))[1] == first    # asked again: same answer
    others = tuple(i for i in everyone if i != j)
    with pytest.raises(RefusedError, match="with an earlier one"):
        unmask(state, UnmaskRequest(params.round_id, others, (j,)))


def test_a_client_refuses_when_not_a_survivor_or_too_few_survive():
    params = _params()
    states, _, _, _ = _to_unmask(params, _inputs(params))
    with pytest.raises(RefusedError, match="does not list it as a survivor"):
        unmask(states[0], UnmaskRequest(params.round_id, tuple(range(1, 10)), (0,)))
    with pytest.raises(RefusedError, match="fewer than the threshold"):
        unmask(states[0], UnmaskRequest(params.round_id, (0, 1, 2), tuple(range(3, 10))))


def test_steps_run_once_and_in_order():
    params = _params()
    states, keys, forwarded, _ = _to_unmask(params, _inputs(params))
    with pytest.raises(RefusedError, match="runs after the 'shared' step"):
        masked_input(states[0], forwarded[0], _inputs(params)[0])      # a second input would leak a difference
    fresh, _ = advertise(params, 0)
    with pytest.raises(RefusedError, match="runs after the 'masked' step"):
        unmask(fresh, UnmaskRequest(params.round_id, tuple(range(10)), ()))


def test_sealed_shares_only_open_for_their_receiver_and_round():
    params = _params()
    states, adverts = zip(*(advertise(params, i) for i in range(10)))
    keys = collect_keys(params, adverts)
    states, bundles = map(list, zip(*(share(s, keys) for s in states)))
    forwarded = route_shares(params, keys, bundles)
    j, k = list(forwarded[0].sealed)[:2]
    swapped = dict(forwarded[0].sealed)
    swapped[j], swapped[k] = swapped[k], swapped[j]                  # the server swaps two senders' shares
    with pytest.raises(DecryptionError):
        masked_input(states[0], ForwardedShares(params.round_id, 0, swapped), _inputs(params)[0])
    with pytest.raises(MessageError, match="misrouted"):
        masked_input(states[0], ForwardedShares(params.round_id, 1, forwarded[0].sealed), _inputs(params)[0])
    with pytest.raises(MessageError, match="for round 8, this is round 7"):
        masked_input(states[0], ForwardedShares(8, 0, forwarded[0].sealed), _inputs(params)[0])
    stranger = next(i for i in range(1, 10) if i not in params.neighbours[0])
    with pytest.raises(MessageError, match="not neighbours of client 0"):
        masked_input(states[0], ForwardedShares(params.round_id, 0, {**forwarded[0].sealed, stranger: b"x" * 94}),
                     _inputs(params)[0])
    with pytest.raises(ParamsError, match="finite float vector of shape \\(40,\\)"):
        masked_input(states[0], forwarded[0], np.zeros(39))


def test_the_server_checks_what_clients_send():
    params = _params()
    xs = _inputs(params)
    states, keys, forwarded, masked = _to_unmask(params, xs)
    members = set(forwarded)
    bad_round = MaskedInput(8, 0, masked[0].masked_with, masked[0].vector)
    with pytest.raises(MessageError, match="for round 8"):
        request_unmask(params, members, [bad_round, *masked[1:]])
    short = MaskedInput(params.round_id, 0, masked[0].masked_with, masked[0].vector[:-4])
    with pytest.raises(MessageError, match="must be 160 bytes"):
        request_unmask(params, members, [short, *masked[1:]])
    skewed = MaskedInput(params.round_id, 0, masked[0].masked_with[1:], masked[0].vector)
    with pytest.raises(MessageError, match="could not be unmasked"):
        request_unmask(params, members, [skewed, *masked[1:]])
    with pytest.raises(MessageError, match="sent two masked inputs"):
        request_unmask(params, members, [*masked, masked[0]])
    with pytest.raises(MessageError, match="advertised twice"):
        collect_keys(params, [Advertise(params.round_id, 0, bytes(32), bytes(32))] * 2)
    with pytest.raises(MessageError, match=r"outside this round's ids 0..9"):
        collect_keys(params, [Advertise(params.round_id, 10, bytes(32), bytes(32))])
    fewer = ShareBundle(params.round_id, 0, dict(list(forwarded[1].sealed.items())[:2]))
    with pytest.raises(MessageError, match="but its neighbours that advertised are"):
        route_shares(params, keys, [fewer])
    request = request_unmask(params, members, masked)
    states[0], response = unmask(states[0], request)
    stray = UnmaskResponse(params.round_id, 0, {**response.self_shares, 0: 1}, {})
    with pytest.raises(MessageError, match="which it was not asked for"):
        aggregate(params, keys, request, masked, [stray])


def test_an_altered_share_fails_the_round_instead_of_a_wrong_sum():
    params = _params()
    xs = _inputs(params)
    states, keys, forwarded, masked = _to_unmask(params, xs)
    request = request_unmask(params, set(forwarded), masked[:9])     # client 9 dropped after sharing
    responses = [unmask(states[i], request)[1] for i in request.survivors]
    r = responses[params.neighbours[9][0]]
    altered = UnmaskResponse(r.round_id, r.sender, r.self_shares, {9: (r.key_shares[9] + 1) % shamir.PRIME})
    responses[params.neighbours[9][0]] = altered
    with pytest.raises(RoundFailedError, match="client 9's mask key"):
        aggregate(params, keys, request, masked[:9], responses)


def test_a_masked_input_on_the_wire_looks_uniform():
    params = SecAggParams(1, 3, 2, 2, 64_000, 1.0, 2.0**20, 32, os.urandom(32))
    xs = np.random.default_rng(9).normal(0, 0.1, size=(3, params.length))
    _, _, _, masked = _to_unmask(params, xs)
    vector = masking.from_bytes(masked[0].vector, params.length, params.bits)
    assert _chi_square(vector, 32) < 130
    assert _chi_square(masking.quantize(xs[0], 1.0, 2.0**20, 32), 32) > 10_000


# -- parameters and bodies --------------------------------------------------------------------------------------
@pytest.mark.parametrize("change,match", [
    (dict(threshold=3), "more than half the degree 6"),
    (dict(threshold=7), "at most 6"),
    (dict(degree=5), "must be even"),
    (dict(num_clients=2), "in 3.."),
    (dict(scale=2.0**31), "can sum past 2\\^31; use more bits or a scale of at most"),
    (dict(scale=0.1), "clip \\* scale >= 1"),
    (dict(bits=65), "in 8..64"),
    (dict(graph_seed=b"short"), "32 bytes"),
    (dict(round_id=-1), "0..2\\^63-1"),
    (dict(length=0), "length 0"),
])
def test_bad_parameters_are_refused_with_the_bound(change, match):
    fields = dict(round_id=1, num_clients=10, degree=6, threshold=4, length=10, clip=1.0, scale=100.0, bits=32,
                  graph_seed=os.urandom(32)) | change
    with pytest.raises(ParamsError, match=match):
        SecAggParams(**fields)


def test_every_body_round_trips_and_bad_bodies_are_refused():
    params = _params()
    assert _wire(params) == params
    states, keys, forwarded, masked = _to_unmask(params, _inputs(params))
    request = request_unmask(params, set(forwarded), masked)
    response = unmask(states[0], request)[1]
    for message in (keys, forwarded[0], masked[0], request, response,
                    ShareBundle(params.round_id, 0, dict(forwarded[1].sealed)),
                    Advertise(params.round_id, 0, *keys.keys[0])):
        assert _wire(message) == message
    body = keys.to_body()
    body["keys"][0]["c_pk"] = body["keys"][0]["c_pk"][:-4]
    with pytest.raises(MessageError, match=r"'keys\[0\].c_pk' must be base64 of 32 bytes, got 30 bytes"):
        PublicKeys.from_body(body)
    with pytest.raises(MessageError, match="not valid base64"):
        MaskedInput.from_body({**masked[0].to_body(), "vector": "not base64!"})
    with pytest.raises(MessageError, match="lists client 0 twice"):
        sealed = base64.b64encode(bytes(94)).decode()
        ShareBundle.from_body({"round_id": 1, "sender": 2, "shares": [{"id": 0, "sealed": sealed}] * 2})
    with pytest.raises(MessageError, match="'survivors' must be a list of distinct client ids"):
        UnmaskRequest.from_body({"round_id": 1, "survivors": [1, 1], "dropped": []})
    with pytest.raises(MessageError, match="not below the field prime"):
        UnmaskResponse.from_body({"round_id": 1, "sender": 0, "key_shares": [],
                                  "self_shares": [{"id": 3, "share": base64.b64encode(b"\xff" * 33).decode()}]})
    with pytest.raises(MessageError, match="more than half the degree"):
        SecAggParams.from_body({**params.to_body(), "threshold": 2})
    with pytest.raises(MessageError, match="'round_id' must be"):
        Advertise.from_body({"round_id": "7", "sender": 0, "c_pk": "", "s_pk": ""})


# -- scale -------------------------------------------------------------------------------------------------------
def test_a_hundred_clients_with_a_hundred_thousand_entries_finish():
    n, length = 100, 100_000
    params = SecAggParams(3, n, graph.suggested_degree(n), graph.suggested_degree(n) // 2 + 1, length, 1.0,
                          masking.largest_scale(n, 1.0, 32), 32, os.urandom(32))
    xs = np.random.default_rng(4).normal(0, 0.3, size=(n, length)).astype(np.float32)
    dropped = {params.neighbours[0][0], 50}
    result, _ = _run(params, xs, no_input=dropped, wire=lambda m: m)
    survivors = [i for i in range(n) if i not in dropped]
    plain = np.clip(xs[survivors].astype(np.float64), -1, 1).sum(axis=0)
    assert np.abs(result.values - plain).max() <= n * 0.5 / params.scale + 1e-6


def test_a_round_needs_more_advertisers_than_the_threshold():
    params = _params(n=5, degree=4, threshold=3)
    adverts = [advertise(params, i)[1] for i in range(3)]
    with pytest.raises(RoundFailedError, match="at least 4 must"):
        collect_keys(params, adverts)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 12).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n), st.randoms())),
       st.binary(min_size=32, max_size=32))
def test_shamir_reconstructs_from_any_threshold_subset(case, secret):
    n, t, rand = case
    shares = _shares(secret, n, t)
    rand.shuffle(shares)
    assert shamir.reconstruct(shares[:t], t) == secret
