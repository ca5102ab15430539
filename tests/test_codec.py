"""Codecs, compression and update encoding: error bounds, exact top-k, hostile inputs, error feedback."""

from __future__ import annotations

import math

import pytest
import torch

from edge_client.wire.codec import CodecError, decode_tensors, encode_tensors, parse_codec, wire_bytes
from edge_client.wire.compression import CompressionError, compress, decompress
from edge_client.wire.protocol import ProtocolError, ResultBody, UploadSettings, decode, encode
from edge_client.wire.updates import ResidualStore, decode_download, decode_upload, encode_download, encode_upload


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Shapes of a small CNN: conv, bias, norm, linear; channels of very different magnitudes."""
    g = torch.Generator().manual_seed(seed)
    conv = torch.randn(8, 3, 3, 3, generator=g) * torch.logspace(-4, 0, 8)[:, None, None, None]
    return {"conv.weight": conv, "conv.bias": torch.randn(8, generator=g) * 0.01,
            "fc.weight": torch.randn(10, 300, generator=g) * 0.05, "fc.bias": torch.randn(10, generator=g)}


def _shapes(tensors):
    return {k: tuple(v.shape) for k, v in tensors.items()}


def _round_trip(tensors, text, sparse=None):
    spec = parse_codec(text)
    sparse = set(tensors) if sparse is None else sparse
    wire = encode_tensors(tensors, spec, sparse=sparse)
    return decode_tensors(wire, spec, _shapes(tensors), sparse=sparse), wire


# --------------------------------------------------------------------------- specs


@pytest.mark.parametrize("text, canonical", [
    ("fp32", "fp32"), ("fp16", "fp16"), ("bf16", "bf16"), ("int8", "int8"),
    ("int8:stochastic", "int8:stochastic"), ("topk:0.1", "topk:0.1"), ("int8+topk:0.1", "topk:0.1+int8"),
    ("topk:0.01+int8+zstd", "topk:0.01+int8+zstd"), ("fp16+lz4:4", "fp16+lz4:4"), ("zstd:19", "fp32+zstd:19"),
])
def test_spec_parses_to_a_canonical_string(text, canonical):
    spec = parse_codec(text)
    assert spec.text == canonical and parse_codec(spec.text) == spec
    assert spec.lossy == (text not in ("fp32", "zstd:19"))


@pytest.mark.parametrize("text, reason", [
    ("", "non-empty"), ("fp8", "unknown codec part"), ("topk:0", "fraction in"), ("topk:1.5", "fraction in"),
    ("topk:x", "fraction in"), ("int8+fp16", "twice"), ("topk:0.1+topk:0.2", "twice"), ("zstd:99", "level"),
    ("lz4:-1", "level"), ("int8:foo", "unknown codec part"), ("zstd+lz4", "twice"),
])
def test_bad_specs_are_refused_with_the_reason(text, reason):
    with pytest.raises(CodecError, match=reason):
        parse_codec(text)


# --------------------------------------------------------------------------- round-trip error bounds


def test_fp32_is_exact():
    x = _tensors()
    out, wire = _round_trip(x, "fp32")
    assert all(torch.equal(out[k], x[k]) for k in x)
    assert wire_bytes(wire) == sum(v.numel() * 4 for v in x.values())


@pytest.mark.parametrize("text, rel, floor", [("fp16", 2.0**-11, 2.0**-25), ("bf16", 2.0**-8, 0.0)])
def test_half_formats_have_bounded_relative_error(text, rel, floor):
    x = _tensors()
    out, wire = _round_trip(x, text)
    for k in x:
        assert bool(((out[k] - x[k]).abs() <= rel * x[k].abs() + floor).all()), k
    assert wire_bytes(wire) == sum(v.numel() * 2 for v in x.values())


def test_fp16_refuses_values_it_cannot_hold():
    with pytest.raises(CodecError, match="bf16"):
        encode_tensors({"w": torch.tensor([1e6])}, parse_codec("fp16"))


def test_int8_error_is_bounded_per_output_channel():
    x = _tensors()
    out, wire = _round_trip(x, "int8")
    for k, v in x.items():
        rows = v.reshape(v.shape[0], -1) if v.dim() >= 2 else v.reshape(1, -1)
        err = (out[k] - v).reshape(rows.shape).abs()
        bound = rows.abs().amax(dim=1, keepdim=True) / 254 * (1 + 1e-5)
        assert bool((err <= bound).all()), k
    # per channel: the conv's smallest channel (1e-4 scale) keeps its relative precision
    small = x["conv.weight"][0]
    assert float((out["conv.weight"][0] - small).abs().max()) <= float(small.abs().max()) / 254 * 1.0001
    assert wire["conv.weight:scale"].shape == (8,) and wire["fc.bias:scale"].shape == (1,)
    assert wire["conv.weight"].dtype == torch.int8


def test_stochastic_int8_is_unbiased_and_bounded():
    x = {"w": torch.linspace(-1, 1, 201).reshape(1, -1) * 0.37}
    spec = parse_codec("int8:stochastic")
    draws = []
    for seed in range(300):
        wire = encode_tensors(x, spec, generator=torch.Generator().manual_seed(seed))
        draws.append(decode_tensors(wire, spec, _shapes(x))["w"])
    scale = 0.37 / 127
    stacked = torch.stack(draws)
    assert float((stacked - x["w"]).abs().max()) < scale * (1 + 1e-5)
    # deterministic rounding is off by up to scale/2 at some entries; the mean of 300 draws is far closer
    assert float((stacked.mean(0) - x["w"]).abs().max()) < scale * 0.2


@pytest.mark.parametrize("fraction", [0.01, 0.1, 0.5, 1.0])
def test_topk_keeps_exactly_the_largest_entries(fraction):
    x = _tensors()
    out, wire = _round_trip(x, f"topk:{fraction}")
    for k, v in x.items():
        keep = min(v.numel(), math.ceil(fraction * v.numel()))
        kept = out[k].reshape(-1) != 0
        assert int(kept.sum()) == keep
        flat = v.reshape(-1)
        assert torch.equal(out[k].reshape(-1)[kept], flat[kept])                 # kept values are exact
        dropped = flat[~kept].abs()
        assert not len(dropped) or float(dropped.max()) <= float(flat[kept].abs().min())   # and the largest


def test_topk_positions_use_the_smaller_of_mask_and_narrow_gaps():
    g = torch.Generator().manual_seed(1)
    x = {"dense": torch.randn(100, 40, generator=g), "spread": torch.randn(4000, 10, generator=g),
         "far": torch.zeros(200_000)}
    x["far"][[5, 70_000, 199_999]] = torch.tensor([3.0, -2.0, 1.0])
    _, wire = _round_trip({"dense": x["dense"]}, "topk:0.5")
    assert "dense:mask" in wire and wire["dense:mask"].numel() == 4000 // 8
    _, wire = _round_trip({"spread": x["spread"]}, "topk:0.01")
    assert wire["spread:idx"].dtype in (torch.uint8, torch.int16) and wire["spread:idx"].numel() == 400
    out, wire = _round_trip({"far": x["far"]}, "topk:0.000015")   # k = 3
    assert wire["far:idx"].dtype == torch.int32 and torch.equal(out["far"], x["far"])


def test_topk_with_int8_keeps_positions_and_bounds_values():
    x = _tensors()
    out, wire = _round_trip(x, "topk:0.1+int8")
    for k, v in x.items():
        kept = out[k] != 0
        assert int(kept.sum()) == math.ceil(0.1 * v.numel())
        assert bool(((out[k] - v)[kept].abs() <= v.abs().max() / 254 * 1.0001).all())
    assert wire["fc.weight:val"].dtype == torch.int8
    assert wire_bytes(wire) < sum(v.numel() for v in x.values()) * 4 / 12


def test_raw_names_are_never_sparsified():
    x = _tensors()
    out, wire = _round_trip(x, "topk:0.01+int8", sparse={"fc.weight"})
    assert "conv.weight" in wire and "conv.weight:val" not in wire and "fc.weight:val" in wire
    assert wire["conv.bias"].shape == (8,) and wire["conv.bias:scale"].shape == (1,)
    assert int((out["fc.weight"] != 0).sum()) == 30


# --------------------------------------------------------------------------- hostile wire tensors


def _wire(text="topk:0.1+int8", names=("fc.weight",)):
    x = _tensors()
    x = {k: x[k] for k in names}
    spec = parse_codec(text)
    return dict(encode_tensors(x, spec, sparse=set(x))), spec, _shapes(x)


def _rejects(wire, spec, shapes, match, sparse=None):
    with pytest.raises(CodecError, match=match):
        decode_tensors(wire, spec, shapes, sparse=set(shapes) if sparse is None else sparse)


def test_index_past_the_end_is_rejected():
    wire, spec, shapes = _wire()
    gaps = wire["fc.weight:idx"].to(torch.int32)
    gaps[-1] += 3000
    wire["fc.weight:idx"] = gaps
    _rejects(wire, spec, shapes, "points past")


def test_negative_gap_is_rejected():
    wire, spec, shapes = _wire()
    gaps = wire["fc.weight:idx"].to(torch.int16)
    gaps[3] = -2
    wire["fc.weight:idx"] = gaps
    _rejects(wire, spec, shapes, "negative gaps")


def test_mask_with_stray_bits_or_wrong_count_is_rejected():
    wire, spec, shapes = _wire("topk:0.5+int8", names=("fc.bias",))   # 10 entries: a 2-byte mask
    mask = wire["fc.bias:mask"].clone()
    mask[1] |= 0b1000_0000                     # bit 15, past the 10 entries
    _rejects({**wire, "fc.bias:mask": mask}, spec, shapes, "past the tensor")
    mask = wire["fc.bias:mask"].clone()
    mask[0] ^= 0xFF
    _rejects({**wire, "fc.bias:mask": mask}, spec, shapes, "marks")


@pytest.mark.parametrize("key, bad, match", [
    ("fc.weight:val", lambda t: t.to(torch.int16), "expected torch.int8"),
    ("fc.weight:val", lambda t: t[:-1].contiguous(), "shape|gaps|points|marks"),
    ("fc.weight:scale", lambda t: t.double(), "expected torch.float32"),
    ("fc.weight:scale", lambda t: -t, "negative or non-finite"),
    ("fc.weight:scale", lambda t: t.fill_(float("inf")), "negative or non-finite"),
])
def test_wrong_dtypes_shapes_and_scales_are_rejected(key, bad, match):
    wire, spec, shapes = _wire()
    wire[key] = bad(wire[key].clone())
    _rejects(wire, spec, shapes, match)


def test_missing_extra_and_mixed_entries_are_rejected():
    wire, spec, shapes = _wire()
    _rejects({k: v for k, v in wire.items() if k != "fc.weight:scale"}, spec, shapes, "arrived as")
    _rejects({**wire, "fc.weight:mask": torch.zeros(375, dtype=torch.uint8)}, spec, shapes, "arrived as")
    _rejects({**wire, "other:val": torch.zeros(1)}, spec, shapes, "unexpected \\['other'\\]")
    dense, dspec, dshapes = _wire("fp32")
    _rejects({k: v.half() for k, v in dense.items()}, parse_codec("fp32"), dshapes, "expected torch.float32", set())
    _rejects({k: v[:5] for k, v in dense.items()}, parse_codec("fp32"), dshapes, "shape", set())
    _rejects({}, parse_codec("fp32"), dshapes, "missing \\['fc.weight'\\]", set())


# --------------------------------------------------------------------------- error feedback


def _feedback_error(rounds: int, feedback: bool, store: ResidualStore) -> float:
    """Relative distance between the sum of decoded uploads and the sum of true updates."""
    g = torch.Generator().manual_seed(3)
    drift = {k: torch.randn(v.shape, generator=g) * 0.01 for k, v in _tensors().items()}
    zero = {k: torch.zeros_like(v) for k, v in drift.items()}
    settings = UploadSettings(parse_codec("topk:0.01+int8"), "delta", feedback)
    sent_sum = {k: torch.zeros_like(v) for k, v in drift.items()}
    true_sum = {k: torch.zeros_like(v) for k, v in drift.items()}
    for _ in range(rounds):
        update = {k: d + torch.randn(d.shape, generator=g) * 0.01 for k, d in drift.items()}
        wire, delta = encode_upload(update, zero, settings, store, "run-1")
        got = decode_upload(wire, ResultBody(1, codec=settings.codec, delta=tuple(delta)), _shapes(update), zero)
        for k in update:
            sent_sum[k] += got[k]
            true_sum[k] += update[k]
    num = math.sqrt(sum(float(((sent_sum[k] - true_sum[k]) ** 2).sum()) for k in drift))
    return num / math.sqrt(sum(float((t ** 2).sum()) for t in true_sum.values()))


def test_error_feedback_makes_the_sum_of_sent_updates_converge():
    short = _feedback_error(50, True, ResidualStore(None))
    long = _feedback_error(400, True, ResidualStore(None))
    without = _feedback_error(400, False, ResidualStore(None))
    assert long < 0.15 and long < short / 3      # the unsent remainder stays bounded while the sum grows
    assert without > 0.8                         # without feedback, what top-k drops is lost for good


def test_residuals_survive_a_restart_and_reset_for_another_run(tmp_path):
    x = _tensors()
    zero = {k: torch.zeros_like(v) for k, v in x.items()}
    settings = UploadSettings(parse_codec("topk:0.1+int8"), "delta", True)
    store = ResidualStore(tmp_path)
    encode_upload(x, zero, settings, store, "run-1")
    residual = {k: v.clone() for k, v in store.tensors.items()}
    assert set(residual) == set(x) and all(float(v.abs().sum()) > 0 for v in residual.values())
    reloaded = ResidualStore(tmp_path)                       # the device restarted
    assert all(torch.equal(reloaded.for_run("run-1")[k], residual[k]) for k in x)
    assert ResidualStore(tmp_path).for_run("run-2") == {}    # another run starts clean
    assert not list(tmp_path.glob("*.tmp"))


def test_a_task_sent_again_after_a_resume_adds_the_residuals_from_before_it(tmp_path):
    """A resumed coordinator sends the round in flight again: the device adds what it dropped before that round,
    so the upload is the one it sent the first time (and a resumed run computes what an unbroken one does),
    across a restart of the device too."""
    from edge_client.wire.updates import encode_clipped_upload

    x = _tensors()
    zero = {k: torch.zeros_like(v) for k, v in x.items()}
    settings = UploadSettings(parse_codec("topk:0.1+int8"), "delta", True)

    def send(store, task, update):
        wire, _, _ = encode_clipped_upload(update, zero, settings, store, "run-1", task=task,
                                           generator=torch.Generator().manual_seed(1))
        return wire

    store = ResidualStore(tmp_path)
    send(store, "1:11", x)
    second = {k: v * 0.5 for k, v in x.items()}
    first_try = send(store, "2:12", second)
    after = {k: v.clone() for k, v in store.tensors.items()}
    again = send(ResidualStore(tmp_path), "2:12", second)    # restarted, then round 2 sent again
    assert all(torch.equal(again[k], first_try[k]) for k in first_try)
    reloaded = ResidualStore(tmp_path)
    assert all(torch.equal(reloaded.for_run("run-1", "3:13")[k], after[k]) for k in after)   # round 3 goes on once


def test_lossless_or_raw_uploads_keep_no_residual(tmp_path):
    x = _tensors()
    zero = {k: torch.zeros_like(v) for k, v in x.items()}
    store = ResidualStore(tmp_path)
    encode_upload(x, zero, UploadSettings(parse_codec("fp32"), "delta", True), store, "r")
    encode_upload(x, zero, UploadSettings(parse_codec("int8"), "raw", True), store, "r")
    encode_upload(x, zero, UploadSettings(parse_codec("int8"), "delta", True), store, "r", raw_only=True)
    assert store.tensors == {} and not (tmp_path / "residual.safetensors").exists()


def test_differences_are_added_back_to_what_was_sent():
    x = _tensors()
    sent = {k: torch.full_like(v, 0.5) for k, v in x.items() if k != "fc.bias"}
    wire, delta = encode_upload(x, sent, UploadSettings(parse_codec("fp32"), "delta", False), ResidualStore(None), "r")
    assert delta == sorted(sent)
    out = decode_upload(wire, ResultBody(1, delta=tuple(delta)), _shapes(x), sent)
    assert all(torch.allclose(out[k], x[k], atol=1e-6) for k in x)
    with pytest.raises(CodecError, match="did not send"):
        decode_upload(wire, ResultBody(1, delta=(*delta, "fc.bias")), _shapes(x), sent)


def test_an_upload_travels_in_a_result_and_back():
    """encode_upload, the typed body, the envelope compressed in the codec, and decode_upload: what the wire does."""
    x = _tensors()
    sent = {k: torch.zeros_like(v) for k, v in x.items()}
    settings = UploadSettings(parse_codec("topk:0.5+int8+zstd"), "delta", False)
    wire, delta = encode_upload(x, sent, settings, ResidualStore(None), "r")
    body = ResultBody(num_samples=7, metrics={"train_loss": 0.5}, codec=settings.codec, delta=tuple(delta))
    payload = encode("result", run_id="r", round=1, task_id="t", sender="c", body=body.to_body(), tensors=wire,
                     compression=body.codec)
    assert payload[:4] == b"FDZ1"                                        # compressed by encode itself
    parsed = ResultBody.from_body(decode(payload).body)
    assert parsed == body
    out = decode_upload(decode(payload).tensors, parsed, _shapes(x), sent)
    assert all(float((out[k] - x[k]).abs().max()) <= float(x[k].abs().max()) for k in x)


def test_a_download_decodes_in_the_codec_its_body_names():
    x = _tensors()
    spec = parse_codec("topk:0.1+fp16")                                 # downloads are always dense
    wire = encode_download(x, spec)
    assert set(wire) == set(x) and all(t.dtype == torch.float16 for t in wire.values())
    out = decode_download(wire, spec, _shapes(x))
    assert all(torch.allclose(out[k], x[k], rtol=1e-3, atol=1e-4) for k in x)
    with pytest.raises(CodecError):
        decode_download(wire, parse_codec("fp32"), _shapes(x))


# --------------------------------------------------------------------------- compression


@pytest.mark.parametrize("name", ["zstd", "lz4"])
def test_compression_round_trips_and_is_used_only_when_it_shrinks(name):
    payload = encode("result", run_id="r", round=1, task_id="t", sender="c", body={"num_samples": 3},
                     tensors={"w": torch.zeros(10_000)})
    packed = compress(payload, name)
    assert len(packed) < len(payload) / 10
    assert decompress(packed, len(payload)) == payload
    msg = decode(packed)
    assert msg.size == len(packed) and torch.equal(msg.tensors["w"], torch.zeros(10_000))
    noise = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    random_payload = bytes(noise.numpy())
    assert compress(random_payload, name) == random_payload


@pytest.mark.parametrize("name", ["zstd", "lz4"])
def test_decompression_is_bounded_and_checked(name):
    payload = encode("status", run_id="r", round=1, task_id="", sender="c", body={"pad": "x" * 100_000})
    packed = compress(payload, name)
    with pytest.raises(CompressionError, match="limit"):
        decompress(packed, len(payload) - 1)
    with pytest.raises(ProtocolError, match="limit"):
        decode(packed, max_bytes=50_000)     # a small frame that would expand past the receiver's limit
    with pytest.raises(ProtocolError, match="corrupt|truncated"):
        decode(packed[:len(packed) // 2])
