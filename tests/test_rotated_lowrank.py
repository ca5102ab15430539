"""The ``eden`` (rotated 1-bit) and ``lowrank:RANK`` (PowerSGD) upload codecs: what they send, how close it
comes back, how error feedback and clipping go with them, what their decoders refuse, and a federated run each."""

from __future__ import annotations

import json
import math

import pytest
import scipy.linalg
import torch

from coordinator.config import ConfigError, load_config
from coordinator.runtime.run import run_federated
from edge_client.privacy import clip_update
from edge_client.wire.chunk_format import split
from edge_client.wire.codec import CodecError, decode_tensors, encode_tensors, layout, parse_codec, wire_bytes
from edge_client.wire.lowrank import state_key
from edge_client.wire.protocol import ResultBody, UploadSettings, decode, encode
from edge_client.wire.reassembly import Reassembler
from edge_client.wire.rotated import CHUNK, _hadamard, padded_chunks
from edge_client.wire.updates import ResidualStore, decode_upload, encode_clipped_upload, encode_upload

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # as a device runs; small matmuls on a busy machine


def _norm(tensors) -> float:
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in tensors.values()))


def _rel(got, want) -> float:
    return _norm({k: got[k] - want[k] for k in want}) / _norm(want)


def _shapes(tensors):
    return {k: tuple(v.shape) for k, v in tensors.items()}


def _round_trip(tensors, text, seed=0, state=None):
    spec = parse_codec(text)
    wire = encode_tensors(tensors, spec, sparse=set(tensors), generator=torch.Generator().manual_seed(seed),
                          state=state)
    return decode_tensors(wire, spec, _shapes(tensors), sparse=set(tensors)), wire


def _update(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"conv.weight": torch.randn(16, 8, 3, 3, generator=g) * 0.01, "conv.bias": torch.randn(16, generator=g),
            "fc.weight": torch.randn(40, 300, generator=g) * 0.01, "fc.bias": torch.randn(10, generator=g)}


# --------------------------------------------------------------------------- specs

@pytest.mark.parametrize("text, canonical", [
    ("eden", "eden"), ("eden:1", "eden"), ("zstd+eden", "eden+zstd"), ("eden+fp16+lz4", "eden+fp16+lz4"),
    ("eden:0.25", "eden:0.25"), ("zstd+eden:0.300", "eden:0.3+zstd"),
    ("lowrank:4", "lowrank:4"), ("int8+lowrank:2+zstd", "lowrank:2+int8+zstd"),
])
def test_specs_parse_to_a_canonical_string(text, canonical):
    spec = parse_codec(text)
    assert spec.text == canonical and parse_codec(spec.text) == spec and spec.lossy
    assert spec.dense().transform is None


@pytest.mark.parametrize("text, reason", [
    ("eden+topk:0.1", "one of topk, eden and lowrank"), ("lowrank:4+eden", "one of topk, eden and lowrank"),
    ("eden:2", "more bits are not built"), ("eden:0", r"in \(0, 1\]"), ("eden:x", "share of rotated entries"), ("lowrank:0", "rank in 1..64"), ("lowrank:x", "rank in"), ("lowrank", "rank in"),
    ("lowrank:65", "rank in"), ("lowrank:2+lowrank:3", "twice"),
])
def test_bad_specs_are_refused_with_the_reason(text, reason):
    with pytest.raises(CodecError, match=reason):
        parse_codec(text)


# --------------------------------------------------------------------------- eden

def test_the_transform_is_the_walsh_hadamard_matrix():
    x = torch.randn(3, 16)
    assert torch.allclose(_hadamard(x), x @ torch.tensor(scipy.linalg.hadamard(16), dtype=torch.float32).T,
                          atol=1e-5)


@pytest.mark.parametrize("numel", [1000, CHUNK + 3000])
def test_eden_is_unbiased_over_rotations(numel):
    """Each decode's projection on the input is the input's squared norm (the unbiased scale), and the mean over
    many rotations comes close to the input, where one decode is 0.76 of its norm away."""
    x = {"w": torch.randn(numel, generator=torch.Generator().manual_seed(5))}
    runs = 300
    total = torch.zeros(numel, dtype=torch.float64)
    errors = []
    for seed in range(runs):
        out, _ = _round_trip(x, "eden", seed)
        assert float((out["w"].double() * x["w"].double()).sum()) == pytest.approx(float((x["w"] ** 2).sum()),
                                                                                    rel=1e-4)
        total += out["w"].double()
        errors.append(_rel(out, x))
    one = sum(errors) / runs
    assert 0.7 < one < 0.8                                   # sqrt(pi/2 - 1) = 0.755 for Gaussian coordinates
    assert _rel({"w": total / runs}, {"w": x["w"].double()}) < 2 * one / math.sqrt(runs)


def test_eden_sends_one_bit_per_padded_entry_a_scale_per_chunk_and_a_seed():
    x = {"big": torch.randn(CHUNK + 3000), "odd": torch.randn(5, 7), "one": torch.tensor(-2.5)}
    out, wire = _round_trip(x, "eden")
    assert padded_chunks(CHUNK + 3000) == [CHUNK, 4096] and padded_chunks(35) == [64] and padded_chunks(0) == []
    assert wire["big:bits"].numel() == (CHUNK + 4096) // 8 and wire["big:scale"].shape == (2,)
    assert wire["odd:bits"].numel() == 8 and wire["one:bits"].numel() == 1
    assert wire_bytes(wire) == (CHUNK + 4096) // 8 + 8 + 1 + 3 * (4 + 8) + 4
    assert float(out["one"]) == pytest.approx(-2.5)            # one entry: its sign and its magnitude
    zero, _ = _round_trip({"z": torch.zeros(100), "e": torch.zeros(0, 3)}, "eden")
    assert not zero["z"].any() and zero["e"].shape == (0, 3)


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_sparsified_eden_stays_unbiased_and_sends_that_share_of_the_bits(fraction):
    """Below one bit per entry: each chunk sends ceil(P d) signs, no index; the projection on the input stays
    exact, one decode is about sqrt(pi / (2P) - 1) of its norm away, and the mean over seeds closes on it."""
    numel = CHUNK + 3000
    x = {"w": torch.randn(numel, generator=torch.Generator().manual_seed(6))}
    runs, total, errors = 200, torch.zeros(numel, dtype=torch.float64), []
    for seed in range(runs):
        out, wire = _round_trip(x, f"eden:{fraction}", seed)
        assert wire["w:bits"].numel() == (math.ceil(fraction * CHUNK) + math.ceil(fraction * 4096) + 7) // 8
        assert float((out["w"].double() * x["w"].double()).sum()) == pytest.approx(float((x["w"] ** 2).sum()),
                                                                                    rel=1e-4)
        total += out["w"].double()
        errors.append(_rel(out, x))
    one = sum(errors) / runs
    assert one == pytest.approx(math.sqrt(math.pi / (2 * fraction) - 1), rel=0.1)
    assert _rel({"w": total / runs}, {"w": x["w"].double()}) < 2 * one / math.sqrt(runs)


def test_sparsified_eden_refuses_bits_it_would_not_send():
    x = {"w": torch.randn(100)}
    spec = parse_codec("eden:0.5")
    wire = encode_tensors(x, spec, sparse={"w"}, generator=torch.Generator().manual_seed(0))
    assert wire["w:bits"].numel() == 8                              # 64 of the 128 padded entries
    tampered = dict(wire, **{"w:bits": torch.full((8,), 255, dtype=torch.uint8)})
    tampered["w:bits"][-1] = 0
    decode_tensors(tampered, spec, {"w": (100,)}, sparse={"w"})     # every bit in range may be anything
    with pytest.raises(CodecError, match="shape"):
        decode_tensors(dict(wire, **{"w:bits": torch.zeros(16, dtype=torch.uint8)}), spec, {"w": (100,)},
                       sparse={"w"})


def test_eden_leaves_raw_values_dense_in_the_value_format():
    x = _update()
    spec = parse_codec("eden+int8")
    wire = encode_tensors(x, spec, sparse={"fc.weight"})
    assert "fc.weight:bits" in wire and wire["conv.weight"].dtype == torch.int8 and "conv.weight:scale" in wire
    assert layout(spec, False, (4, 4)) == "dense" and layout(spec, True, (4,)) == "eden"


# --------------------------------------------------------------------------- lowrank

def test_lowrank_is_exact_for_a_matrix_of_lower_rank():
    g = torch.Generator().manual_seed(2)
    m = torch.randn(40, 3, generator=g) @ torch.randn(3, 300, generator=g)
    conv = (torch.randn(16, 2, generator=g) @ torch.randn(2, 72, generator=g)).reshape(16, 8, 3, 3)
    out, _ = _round_trip({"fc": m, "conv": conv}, "lowrank:4")
    assert torch.allclose(out["fc"], m, atol=1e-4) and torch.allclose(out["conv"], conv, atol=1e-4)


@pytest.mark.parametrize("text, per_entry, scales", [("lowrank:4", 4, 0), ("lowrank:4+fp16", 2, 0),
                                                     ("lowrank:4+int8", 1, 4 * 4 * 4)])
def test_lowrank_sends_the_factors_of_matrices_and_the_rest_dense(text, per_entry, scales):
    x = _update()
    _, wire = _round_trip(x, text)
    assert wire["fc.weight:p"].shape == (4, 40) and wire["fc.weight:q"].shape == (4, 300)
    assert wire["conv.weight:q"].shape == (4, 72)
    factors = sum(wire_bytes({k: wire[k]}) for k in ("fc.weight:p", "fc.weight:q"))
    assert factors == (40 + 300) * 4 * per_entry
    assert "conv.bias" in wire and "fc.bias" in wire                  # 1-D: dense, in the value format
    int8_biases = (16 + 4) + (10 + 4) if per_entry == 1 else (16 + 10) * per_entry
    assert wire_bytes(wire) == (40 + 300 + 16 + 72) * 4 * per_entry + scales + int8_biases
    small = parse_codec(text)
    assert layout(small, True, (4, 3)) == "dense" and layout(small, True, (16, 8, 3, 3)) == "lowrank"


def test_the_warm_start_converges_to_the_best_rank_r_approximation():
    g = torch.Generator().manual_seed(4)
    m = torch.randn(40, 300, generator=g) * torch.logspace(0, -2, 300)[None, :]
    s = torch.linalg.svdvals(m)
    best = float(s[4:].norm() / s.norm())
    state: dict[str, torch.Tensor] = {}
    errors = [_rel(_round_trip({"fc": m}, "lowrank:4", seed, state)[0], {"fc": m}) for seed in range(12)]
    assert set(state) == {state_key("fc")} and state[state_key("fc")].shape == (300, 4)
    assert errors[-1] < 1.02 * best < errors[0]
    cold = _rel(_round_trip({"fc": m}, "lowrank:4", 11)[0], {"fc": m})   # a fresh Q every time
    assert errors[-1] < cold


def test_the_warm_start_lives_with_the_residuals_and_survives_a_restart(tmp_path):
    """Q is kept even without error feedback, follows the run, and a task sent again after a restart starts
    from the Q the task first started from, so it sends the same factors."""
    x = _update()
    zero = {k: torch.zeros_like(v) for k, v in x.items()}
    settings = UploadSettings(parse_codec("lowrank:2+int8"), "delta", False)

    def send(store, task, run="run-1"):
        return encode_clipped_upload(x, zero, settings, store, run, task=task,
                                     generator=torch.Generator().manual_seed(7))[0]

    send(ResidualStore(tmp_path), "1:11")
    stored = ResidualStore(tmp_path).for_run("run-1")
    assert set(stored) == {state_key("conv.weight"), state_key("fc.weight")}
    first = send(ResidualStore(tmp_path), "2:12")
    again = send(ResidualStore(tmp_path), "2:12")                  # restarted, then round 2 sent again
    cold = send(ResidualStore(tmp_path), "2:12", run="run-2")      # another run starts from a random Q
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["fc.weight:q"], cold["fc.weight:q"])


# --------------------------------------------------------------------------- error feedback and clipping

def _feedback_error(text: str, rounds: int, feedback: bool) -> float:
    """Relative distance between the sum of decoded uploads and the sum of true updates."""
    g = torch.Generator().manual_seed(3)
    drift = {k: torch.randn(v.shape, generator=g) * 0.01 for k, v in _update().items()}
    zero = {k: torch.zeros_like(v) for k, v in drift.items()}
    settings, store = UploadSettings(parse_codec(text), "delta", feedback), ResidualStore(None)
    sent_sum = {k: torch.zeros_like(v) for k, v in drift.items()}
    true_sum = {k: torch.zeros_like(v) for k, v in drift.items()}
    for r in range(rounds):
        update = {k: d + torch.randn(d.shape, generator=g) * 0.01 for k, d in drift.items()}
        wire, delta = encode_upload(update, zero, settings, store, "run-1", generator=torch.Generator().manual_seed(r))
        got = decode_upload(wire, ResultBody(1, codec=settings.codec, delta=tuple(delta)), _shapes(update), zero)
        for k in update:
            sent_sum[k] += got[k]
            true_sum[k] += update[k]
    return _rel(sent_sum, true_sum)


@pytest.mark.parametrize("text", ["eden", "lowrank:2+int8"])
def test_error_feedback_makes_the_sum_of_sent_updates_converge(text):
    short, long = _feedback_error(text, 15, True), _feedback_error(text, 90, True)
    without = _feedback_error(text, 90, False)
    assert long < short / 3 and long < without / 3       # what is carried over stays bounded while the sum grows


@pytest.mark.parametrize("text", ["eden", "lowrank:2", "lowrank:2+int8"])
def test_clipping_before_the_new_codecs(text):
    """Clipping runs before encoding: lowrank's projection keeps the clipped norm, eden's decode is the clipped
    update on average (the coordinator clips again under central DP, whatever a codec's single decode does)."""
    x = _update()
    zero = {k: torch.zeros_like(v) for k, v in x.items()}
    clip = 0.1 * _norm(x)
    clipped_x = clip_update(x, clip)[0]
    settings = UploadSettings(parse_codec(text), "delta", False, clip_norm=clip)
    total = {k: torch.zeros_like(v) for k, v in x.items()}
    runs = 200 if text == "eden" else 1
    for seed in range(runs):
        wire, delta, clipped = encode_clipped_upload(x, zero, settings, ResidualStore(None), "r",
                                                     generator=torch.Generator().manual_seed(seed))
        got = decode_upload(wire, ResultBody(1, codec=settings.codec, delta=tuple(delta)), _shapes(x), zero)
        assert clipped
        for k in got:
            total[k] += got[k] / runs
    if text == "eden":
        assert _rel(total, clipped_x) < 0.15
    else:
        assert _norm(total) <= clip * (1 + 0.02)


# --------------------------------------------------------------------------- hostile wire tensors

def _wire(text):
    x = {"fc.weight": _update()["fc.weight"]}
    spec = parse_codec(text)
    return dict(encode_tensors(x, spec, sparse=set(x), generator=torch.Generator().manual_seed(0))), spec, _shapes(x)


def _rejects(wire, spec, shapes, match):
    with pytest.raises(CodecError, match=match):
        decode_tensors(wire, spec, shapes, sparse=set(shapes))


@pytest.mark.parametrize("text, key, bad, match", [
    ("eden", "fc.weight:bits", lambda t: t.to(torch.int16), "'fc.weight:bits' is torch.int16"),
    ("eden", "fc.weight:bits", lambda t: t[:-1].contiguous(), "'fc.weight:bits' has shape"),
    ("eden", "fc.weight:scale", lambda t: -t, "negative or non-finite"),
    ("eden", "fc.weight:scale", lambda t: t.fill_(float("nan")), "negative or non-finite"),
    ("eden", "fc.weight:scale", lambda t: torch.cat([t, t]), "'fc.weight:scale' has shape"),
    ("eden", "fc.weight:scale", lambda t: t.fill_(3e38), "'fc.weight' decodes to non-finite"),
    ("eden", "fc.weight:seed", lambda t: t.to(torch.int32), "'fc.weight:seed' is torch.int32"),
    ("eden", "fc.weight:seed", lambda t: -t - 1, "negative seed"),
    ("lowrank:4", "fc.weight:p", lambda t: t[:3].contiguous(), "'fc.weight:p' has shape"),
    ("lowrank:4", "fc.weight:q", lambda t: t.half(), "'fc.weight:q' is torch.float16"),
    ("lowrank:4", "fc.weight:q", lambda t: t.fill_(float("inf")), "'fc.weight:q' holds non-finite"),
    ("lowrank:4+int8", "fc.weight:p:scale", lambda t: -t, "'fc.weight:p:scale' holds negative"),
    ("lowrank:4+int8", "fc.weight:q", lambda t: t.to(torch.uint8), "expected torch.int8"),
])
def test_wrong_dtypes_shapes_and_values_are_rejected_naming_the_tensor(text, key, bad, match):
    wire, spec, shapes = _wire(text)
    wire[key] = bad(wire[key].clone())
    _rejects(wire, spec, shapes, match)


def test_stray_bits_missing_and_extra_entries_are_rejected():
    wire, spec, shapes = _wire("eden")
    small = {"b": torch.randn(3)}
    swire = dict(encode_tensors(small, spec, sparse={"b"}))
    bits = swire["b:bits"].clone()
    bits[0] |= 0b1000_0000                          # bit 7, past the 4 padded entries
    _rejects({**swire, "b:bits": bits}, spec, _shapes(small), "past the 4 rotated entries of 'b'")
    _rejects({k: v for k, v in wire.items() if k != "fc.weight:seed"}, spec, shapes, "'fc.weight' arrived as")
    _rejects({**wire, "fc.weight:val": torch.zeros(1)}, spec, shapes, "'fc.weight' arrived as")
    lwire, lspec, _ = _wire("lowrank:4")
    _rejects(lwire, spec, shapes, "'fc.weight' arrived as")              # factors where rotated bits belong
    dense = parse_codec("fp32")
    _rejects(lwire, dense, shapes, "'fc.weight' arrived as")
    huge = {k: torch.full_like(v, 1e20) for k, v in lwire.items()}   # finite factors, an infinite product
    _rejects(huge, lspec, shapes, "'fc.weight' decodes to non-finite")


@pytest.mark.parametrize("text", ["eden+zstd", "lowrank:8"])
def test_a_large_update_travels_in_chunks_and_decodes(text):
    """A model-sized result (a 1M-entry weight) goes through the envelope, 64 KB chunks and reassembly."""
    g = torch.Generator().manual_seed(9)
    x = {"big.weight": torch.randn(1024, 1000, generator=g) * 0.01, "big.bias": torch.randn(1024, generator=g)}
    zero = {k: torch.zeros_like(v) for k, v in x.items()}
    settings = UploadSettings(parse_codec(text), "delta", True)
    wire, delta = encode_upload(x, zero, settings, ResidualStore(None), "r", generator=g)
    body = ResultBody(num_samples=1, codec=settings.codec, delta=tuple(delta))
    payload = encode("result", run_id="r", round=1, task_id="t", sender="pi-01", body=body.to_body(),
                     tensors=wire, compression=settings.codec)
    chunks = split(payload, 65536)
    reassembler = Reassembler(max_message_bytes=1 << 24)
    whole = [a.payload for c in reversed(chunks) for a in reassembler.feed("pi-01", c) if a.payload]
    assert len(chunks) > 1 and len(whole) == 1
    msg = decode(whole[0])
    got = decode_upload(msg.tensors, ResultBody.from_body(msg.body), _shapes(x), zero)
    assert _rel(got, x) < 0.8 and got["big.weight"].shape == (1024, 1000)


# --------------------------------------------------------------------------- configuration

@pytest.mark.parametrize("up", ["eden", "lowrank:4+int8"])
def test_secure_aggregation_and_the_download_refuse_them(tmp_path, up):
    def load(**sets):
        base = {"run.out": str(tmp_path), "model.name": "cnn", "data.eval": "digits", **sets}
        return load_config(None, [(*k.split(".", 1), v) for k, v in base.items()])

    with pytest.raises(ConfigError, match="dense codec.up"):
        load(**{"secagg.enabled": True, "clients.expected": 4, "codec.up": up})
    with pytest.raises(ConfigError, match="codec.down cannot use"):
        load(**{"codec.down": up})


def test_sparsified_eden_below_pi_over_4_refuses_error_feedback(tmp_path):
    """Its error is then larger than the update: a residual carried forward would grow each round."""
    def load(**sets):
        base = {"run.out": str(tmp_path), "model.name": "cnn", "data.eval": "digits", **sets}
        return load_config(None, [(*k.split(".", 1), v) for k, v in base.items()])

    with pytest.raises(ConfigError, match="set codec.error_feedback = false"):
        load(**{"codec.up": "eden:0.25"})
    load(**{"codec.up": "eden:0.25", "codec.error_feedback": False})
    load(**{"codec.up": "eden:0.8"})


# --------------------------------------------------------------------------- federated runs

# eden: 1 bit of 32 per entry, and headers that weigh on a 53k-parameter model (19x measured)
@pytest.mark.parametrize("up, smaller", [("eden", 16), ("lowrank:2+int8+zstd", 20)])
def test_a_federated_run_learns_with_the_codec(tmp_path, up, smaller):
    sets = {"run.rounds": 4, "run.out": str(tmp_path), "model.name": "cnn", "data.eval": "digits",
            "clients.expected": 3, "clients.spawn": 3, "clients.round_timeout": 60.0,
            "clients.presence_timeout": 60.0, "transport.kind": "inproc", "codec.up": up}
    result = run_federated(load_config(None, [(*k.split(".", 1), v) for k, v in sets.items()]), say=lambda s: None)
    rows = [json.loads(line) for line in (result.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert all((r["returned"], r["rejected"], r["failed"]) == (3, 0, 0) for r in rows[1:])
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"] + 0.2 and rows[-1]["test_accuracy"] > 0.6
    assert result.summary["ratio_up_vs_fp32"] < 1 / smaller


@pytest.mark.parametrize("numel, fraction, digest, scales", [
    (40000, 1.0, "8773789e0b05eed64278d48108b966a9b3849817ceb46ba73303e70f1ea3adba", [1.24486, 1.25120, 1.17509]),
    (16384 * 17 + 9000, 0.25, "09cbadc9b06d1398bc30961001975be1190559ad375a7bedd73890b3bb41357b",
     [5.03282, 4.98936, 5.06600]),
])
def test_eden_sends_the_bits_it_always_sent_whatever_block_it_rotates_in(numel, fraction, digest, scales):
    """The wire format is a contract with devices already deployed: rotating a tensor a block of chunks at a time
    (a bounded working space) must send the signs and seed the whole-tensor rotation sent."""
    import hashlib

    from edge_client.wire.rotated import decode_rotated, encode_rotated

    x = torch.randn(numel, generator=torch.Generator().manual_seed(7))
    wire = encode_rotated("w", x, torch.Generator().manual_seed(11), fraction)
    assert hashlib.sha256(wire["w:bits"].numpy().tobytes() + wire["w:seed"].numpy().tobytes()).hexdigest() == digest
    assert wire["w:scale"][:3].tolist() == pytest.approx(scales, rel=1e-5)
    decoded = decode_rotated(wire, "w", (numel,), fraction)
    assert float(decoded @ x) == pytest.approx(float(x @ x), rel=1e-4)   # the projection on x stays exact
