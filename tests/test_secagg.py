"""Secure aggregation's core: Shamir sharing, key agreement and AEAD, modular masking, the neighbour graph,
and whole rounds in memory with dropouts, with real cryptography throughout."""

from __future__ import annotations

import os

import numpy as np
import pytest

from edge_client.secagg import graph, keys, masking, shamir
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
