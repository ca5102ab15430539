"""Tests for edge_client.wire.protocol: the envelope, its checks, the typed bodies and the topic layout."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from edge_client.wire.codec import CodecError, parse_codec
from edge_client.wire.compression import COMPRESSORS
from edge_client.wire.protocol import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_RESEND_EVERY,
    DEFAULT_TASK_TIMEOUT,
    KINDS,
    PROTOCOL_VERSION,
    Message,
    ModelBody,
    PresenceBody,
    ProtocolError,
    ResultBody,
    StatusBody,
    TaskBody,
    Topics,
    UploadSettings,
    check_tensors,
    decode,
    encode,
    valid_client_id,
)

# --------------------------------------------------------------------------- helpers


def _meta(**overrides):
    """A valid fedge header (as a dict), with some fields replaced or removed (value ...)."""
    meta = {"v": PROTOCOL_VERSION, "kind": "result", "run_id": "run-1", "round": 3,
            "task_id": "t-7", "sender": "client_01", "body": {"num_samples": 5}}
    for key, value in overrides.items():
        if value is ...:
            meta.pop(key)
        else:
            meta[key] = value
    return meta


def _envelope(meta, tensors=None) -> bytes:
    """A real safetensors buffer carrying ``meta`` (already a dict or raw text) as its fedge header."""
    text = meta if isinstance(meta, str) else json.dumps(meta)
    return st_save(dict(tensors or {}), metadata={"fedge": text})


def _raw(st_header: dict, data: bytes = b"") -> bytes:
    """A hand-built safetensors-shaped buffer: 8-byte length, JSON header, data."""
    header = json.dumps(st_header).encode()
    return struct.pack("<Q", len(header)) + header + data


def _raw_with_meta(entries: dict, data: bytes) -> bytes:
    return _raw({"__metadata__": {"fedge": json.dumps(_meta())}, **entries}, data)


def _rejects(payload, match: str | None, **kwargs) -> ProtocolError:
    with pytest.raises(ProtocolError, match=match) as info:
        decode(payload, **kwargs)
    assert str(info.value), "the reason must not be empty"
    return info.value


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"features.0.weight": torch.randn(4, 3, generator=g), "features.0.bias": torch.randn(4, generator=g),
            "classifier.weight": torch.randn(2, 4, generator=g)}


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_without_tensors(kind):
    body = {"state": "online", "num_samples": 12, "nested": {"a": [1, 2.5, None, True], "s": "héllo"}}
    payload = encode(kind, run_id="run-42", round=7, task_id="task-9", sender="dev.1_a-b", body=body)
    assert isinstance(payload, bytes)
    msg = decode(payload)
    assert isinstance(msg, Message)
    assert (msg.kind, msg.run_id, msg.round, msg.task_id, msg.sender) == (kind, "run-42", 7, "task-9", "dev.1_a-b")
    assert msg.body == body
    assert msg.tensors == {}
    assert msg.size == len(payload)


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_with_float32_tensors(kind):
    tensors = _tensors()
    payload = encode(kind, run_id="r", round=1, task_id="t", sender="c1", body={"k": 1}, tensors=tensors)
    msg = decode(payload)
    assert msg.body == {"k": 1}
    assert msg.size == len(payload)
    assert set(msg.tensors) == set(tensors)
    for name, t in tensors.items():
        assert msg.tensors[name].dtype == torch.float32
        assert torch.equal(msg.tensors[name], t)


def test_empty_body_defaults_to_dict_and_round_is_int():
    msg = decode(encode("presence", run_id="r", round=0, task_id="", sender="c"))
    assert msg.body == {}
    assert msg.round == 0 and type(msg.round) is int


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
                                   torch.int16, torch.int32, torch.int64])
def test_round_trip_other_allowed_dtypes(dtype):
    values = torch.arange(-3, 9).reshape(3, 4)
    if dtype == torch.uint8:
        values = values + 3
    t = values.to(dtype) / (4 if dtype.is_floating_point else 1)
    t = t.to(dtype)
    msg = decode(encode("result", run_id="r", round=1, task_id="t", sender="c", tensors={"x": t}))
    assert msg.tensors["x"].dtype == dtype
    assert torch.equal(msg.tensors["x"], t)


def test_encode_copies_noncontiguous_and_grad_tensors():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    leaf = torch.ones(2, requires_grad=True)
    msg = decode(encode("task", run_id="r", round=1, task_id="t", sender="coordinator",
                        tensors={"t": base.t(), "g": leaf * 2}))
    assert torch.equal(msg.tensors["t"], base.t())
    assert torch.equal(msg.tensors["g"], torch.full((2,), 2.0))
    assert not msg.tensors["g"].requires_grad


def test_payload_is_plain_safetensors_with_fedge_header():
    payload = encode("task", run_id="r", round=2, task_id="t", sender="coordinator",
                     body={"objective": "train"}, tensors={"w": torch.ones(2)})
    assert torch.equal(st_load(payload)["w"], torch.ones(2))
    (n,) = struct.unpack("<Q", payload[:8])
    header = json.loads(payload[8:8 + n])
    meta = json.loads(header["__metadata__"]["fedge"])
    assert meta == {"v": PROTOCOL_VERSION, "kind": "task", "run_id": "r", "round": 2, "task_id": "t",
                    "sender": "coordinator", "body": {"objective": "train"}}


def test_decode_accepts_bytearray_and_memoryview():
    payload = encode("status", run_id="r", round=1, task_id="t", sender="c", tensors={"w": torch.ones(3)})
    for view in (bytearray(payload), memoryview(payload)):
        msg = decode(view)
        assert torch.equal(msg.tensors["w"], torch.ones(3))
        assert msg.size == len(payload)


def test_max_bytes_is_inclusive():
    payload = encode("presence", run_id="r", round=0, task_id="", sender="c", body={"pad": "x" * 100})
    assert decode(payload, max_bytes=len(payload)).size == len(payload)
    assert DEFAULT_MAX_MESSAGE_BYTES == 64 * 1024 * 1024


def test_encode_rejects_unknown_kind():
    with pytest.raises(ProtocolError, match="unknown message kind 'hello'"):
        encode("hello", run_id="r", round=0, task_id="", sender="c")


# --------------------------------------------------------------------------- rejections: framing


def test_rejects_oversize():
    payload = encode("result", run_id="r", round=1, task_id="t", sender="c", tensors={"w": torch.zeros(100)})
    err = _rejects(payload, "exceeds the limit", max_bytes=len(payload) - 1)
    assert str(len(payload)) in str(err) and str(len(payload) - 1) in str(err)


def test_rejects_non_bytes():
    _rejects("not bytes", "not bytes")


@pytest.mark.parametrize("payload", [b"", b"\x01", b"1234567"])
def test_rejects_too_short(payload):
    _rejects(payload, "too short")


def test_rejects_header_length_past_end():
    _rejects(struct.pack("<Q", 1000) + b"{}", "header length 1000 does not fit")


def test_rejects_huge_header_length():
    _rejects(struct.pack("<Q", 2**63) + b"{}" * 10, "header length")


@pytest.mark.parametrize("payload", [
    struct.pack("<Q", 5) + b"abcde",                      # not JSON
    struct.pack("<Q", 4) + b"\xff\xfe\xfd\xfc",            # not UTF-8
    bytes(range(256)) * 4,                                # random-looking bytes: huge length
    struct.pack("<Q", 2) + b"[]",                          # JSON, but not an object
])
def test_rejects_garbage(payload):
    with pytest.raises(ProtocolError):
        decode(payload)


def test_rejects_garbage_not_json_message():
    _rejects(struct.pack("<Q", 5) + b"abcde", "not a fedge envelope")


def test_rejects_safetensors_without_fedge_metadata():
    _rejects(st_save({"w": torch.ones(2)}), "not a fedge envelope")
    _rejects(st_save({"w": torch.ones(2)}, metadata={"other": "x"}), "not a fedge envelope")


def test_rejects_metadata_that_is_not_json():
    _rejects(_envelope("{not json"), "not a fedge envelope")


@pytest.mark.parametrize("text", ["[1, 2]", "\"a string\"", "42", "null"])
def test_rejects_metadata_that_is_not_an_object(text):
    _rejects(_envelope(text), "not a JSON object")


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_rejects_non_json_constants_in_header(constant):
    text = json.dumps(_meta(body={"num_samples": 5}))
    text = text.replace('"num_samples": 5', f'"num_samples": 5, "metrics": {{"train_loss": {constant}}}')
    assert constant in text
    _rejects(_envelope(text), None)


# --------------------------------------------------------------------------- rejections: header fields


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, str(PROTOCOL_VERSION), None, ...])
def test_rejects_wrong_version(version):
    err = _rejects(_envelope(_meta(v=version)), "protocol version")
    assert "not supported" in str(err)


def test_accepts_edited_header_when_still_valid():
    # Guard for the crafting helper: an untouched re-serialized header decodes.
    msg = decode(_envelope(_meta(), {"w": torch.ones(2)}))
    assert (msg.kind, msg.round, msg.sender, msg.body) == ("result", 3, "client_01", {"num_samples": 5})


@pytest.mark.parametrize("kind", ["hello", "RESULT", "", None, 1, ...])
def test_rejects_unknown_kind(kind):
    _rejects(_envelope(_meta(kind=kind)), "unknown message kind")


@pytest.mark.parametrize("key,value", [
    ("run_id", ...), ("run_id", 5), ("run_id", None), ("run_id", ["r"]),
    ("task_id", ...), ("task_id", 7),
    ("sender", ...), ("sender", 3),
    ("round", ...), ("round", True), ("round", False), ("round", "1"), ("round", 1.0), ("round", None),
    ("body", ...), ("body", []), ("body", "text"), ("body", None), ("body", 1),
])
def test_rejects_missing_or_ill_typed_fields(key, value):
    err = _rejects(_envelope(_meta(**{key: value})), f"field '{key}'")
    assert "missing or not a" in str(err)


@pytest.mark.parametrize("sender", ["a/b", "a+", "#", "", "x" * 65, "with space", "é"])
def test_rejects_invalid_sender(sender):
    payload = encode("presence", run_id="r", round=0, task_id="", sender=sender)
    _rejects(payload, "is not a valid id")


def test_sender_of_64_chars_is_fine():
    assert decode(encode("presence", run_id="r", round=0, task_id="", sender="x" * 64)).sender == "x" * 64


# --------------------------------------------------------------------------- rejections: tensor entries


@pytest.mark.parametrize("tag,nbytes", [("BOOL", 4), ("U16", 8), ("C64", 32), ("F8_E4M3", 4), ("f32", 16),
                                        ("", 4), (None, 4)])
def test_rejects_bad_dtype_tag(tag, nbytes):
    entries = {"w": {"dtype": tag, "shape": [4], "data_offsets": [0, nbytes]}}
    _rejects(_raw_with_meta(entries, b"\x00" * nbytes), "tensor 'w' has an invalid entry")


@pytest.mark.parametrize("offsets", [[0, 16], [4, 20], [-4, 12], [8, 4]])
def test_rejects_offsets_out_of_range(offsets):
    entries = {"w": {"dtype": "F32", "shape": [4], "data_offsets": offsets}}
    _rejects(_raw_with_meta(entries, b"\x00" * 12), "tensor 'w' has an invalid entry")


@pytest.mark.parametrize("shape", [[3], [2, 3], [5], [-4], [4.0], ["4"]])
def test_rejects_shape_offset_mismatch(shape):
    entries = {"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 16]}}
    _rejects(_raw_with_meta(entries, b"\x00" * 16), "tensor 'w' has an invalid entry")


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": [4]},                                  # no offsets
    {"shape": [4], "data_offsets": [0, 16]},                         # no dtype
    {"dtype": "F32", "data_offsets": [0, 16]},                       # no shape
    {"dtype": "F32", "shape": [4], "data_offsets": [0, 8, 16]},      # three offsets
    {"dtype": "F32", "shape": None, "data_offsets": [0, 16]},
    "F32",
])
def test_rejects_malformed_tensor_entry(entry):
    _rejects(_raw_with_meta({"w": entry}, b"\x00" * 16), "tensor 'w' has an invalid entry")


def test_rejects_overlapping_tensors_as_corrupt():
    # Each entry on its own fits the buffer, but two tensors claiming the same bytes is not safetensors.
    entries = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
               "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    _rejects(_raw_with_meta(entries, b"\x00" * 4), "corrupt")


def test_hand_built_envelope_is_accepted():
    # Guard for the hand-built buffers above: a correct entry decodes.
    data = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)
    msg = decode(_raw_with_meta({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, data))
    assert torch.equal(msg.tensors["w"], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_rejects_non_finite_tensors(dtype, bad):
    t = torch.zeros(3, 2, dtype=dtype)
    t[1, 1] = bad
    payload = encode("result", run_id="r", round=1, task_id="t", sender="c",
                     tensors={"ok": torch.ones(2), "bad": t})
    _rejects(payload, "tensor 'bad' holds NaN or infinite values")


def test_float16_overflow_to_inf_is_rejected():
    t = torch.tensor([70000.0]).to(torch.float16)   # beyond float16's range -> inf
    assert torch.isinf(t).all()
    _rejects(encode("result", run_id="r", round=1, task_id="t", sender="c", tensors={"w": t}), "NaN or infinite")


def test_integer_extremes_are_not_treated_as_non_finite():
    t = torch.tensor([torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max])
    msg = decode(encode("result", run_id="r", round=1, task_id="t", sender="c", tensors={"n": t}))
    assert torch.equal(msg.tensors["n"], t)


# --------------------------------------------------------------------------- check_tensors

SHAPES = {"features.0.weight": (4, 3), "features.0.bias": (4,), "classifier.weight": (2, 4)}


def test_check_tensors_accepts_exact_match():
    check_tensors(_tensors(), SHAPES)
    check_tensors(_tensors(), {k: list(v) for k, v in SHAPES.items()})   # shapes given as lists
    check_tensors({k: v.half() for k, v in _tensors().items()}, SHAPES, dtype=torch.float16)
    check_tensors({}, {})


def test_check_tensors_missing():
    tensors = _tensors()
    del tensors["features.0.bias"]
    with pytest.raises(ProtocolError, match=r"missing \['features.0.bias'\], unexpected \[\]"):
        check_tensors(tensors, SHAPES)


def test_check_tensors_extra():
    tensors = {**_tensors(), "sneaky": torch.zeros(1)}
    with pytest.raises(ProtocolError, match=r"missing \[\], unexpected \['sneaky'\]"):
        check_tensors(tensors, SHAPES)


def test_check_tensors_wrong_shape():
    tensors = {**_tensors(), "classifier.weight": torch.zeros(4, 2)}
    with pytest.raises(ProtocolError, match=r"'classifier.weight' has shape \(4, 2\), expected \(2, 4\)"):
        check_tensors(tensors, SHAPES)


def test_check_tensors_wrong_dtype():
    tensors = {**_tensors(), "features.0.bias": torch.zeros(4, dtype=torch.float64)}
    with pytest.raises(ProtocolError, match="'features.0.bias' has dtype torch.float64, expected torch.float32"):
        check_tensors(tensors, SHAPES)


def test_check_tensors_on_decoded_message():
    msg = decode(encode("result", run_id="r", round=1, task_id="t", sender="c", tensors=_tensors()))
    check_tensors(msg.tensors, SHAPES)


# --------------------------------------------------------------------------- topics and ids


def test_topics_layout_default_prefix():
    t = Topics()
    assert t.prefix == "fedge"
    assert t.client("dev1", "presence") == "fedge/clients/dev1/presence"
    assert t.client("dev1", "task") == "fedge/clients/dev1/task"
    assert t.all_clients("result") == "fedge/clients/+/result"
    assert t.coordinator_status == "fedge/coordinator/status"


def test_topics_layout_nested_prefix():
    t = Topics("lab/fl-1")
    assert t.client("a", "result") == "lab/fl-1/clients/a/result"
    assert t.all_clients("presence") == "lab/fl-1/clients/+/presence"
    assert t.coordinator_status == "lab/fl-1/coordinator/status"


@pytest.mark.parametrize("prefix", ["fedge", "lab/fl-1"])
@pytest.mark.parametrize("kind", KINDS)
def test_client_of_per_client_topics(prefix, kind):
    t = Topics(prefix)
    assert t.client_of(t.client("dev.7_x", kind)) == "dev.7_x"


@pytest.mark.parametrize("topic", [
    "fedge/coordinator/status",
    "fedge/clients/dev1",
    "fedge/clients/dev1/result/extra",
    "fedge/devices/dev1/result",
    "other/clients/dev1/result",
    "fedgex/clients/dev1/result",
    "fedge",
    "",
    "clients/dev1/result",
])
def test_client_of_none_for_other_topics(topic):
    assert Topics().client_of(topic) is None


def test_client_of_respects_custom_prefix():
    t = Topics("lab/fl")
    assert t.client_of("fedge/clients/dev1/result") is None
    assert t.client_of("lab/fl/clients/dev1/result") == "dev1"


@pytest.mark.parametrize("prefix", ["", "a+b", "fedge/#", "+", "fedge/"])
def test_bad_prefix_rejected(prefix):
    with pytest.raises(ProtocolError, match="bad topic prefix"):
        Topics(prefix)


@pytest.mark.parametrize("client_id", ["a", "dev1", "Dev_1.2-x", "0", "x" * 64, "..."])
def test_valid_client_id_accepts(client_id):
    assert valid_client_id(client_id) is True


@pytest.mark.parametrize("client_id", ["", "a/b", "a+b", "a#", "+", "#", "x" * 65, "a b", "é", "tab\t",
                                       None, 5, b"dev1"])
def test_valid_client_id_rejects(client_id):
    assert valid_client_id(client_id) is False


@pytest.mark.parametrize("client_id", ["dev1\n", "x" * 64 + "\n"])
def test_valid_client_id_rejects_trailing_newline(client_id):
    assert valid_client_id(client_id) is False


def test_decode_rejects_sender_with_trailing_newline():
    _rejects(encode("presence", run_id="r", round=0, task_id="", sender="dev1\n"), "is not a valid id")


# --------------------------------------------------------------------------- compression in encode


@pytest.mark.parametrize("codec, compressor", [("fp32+zstd", "zstd"), ("int8+lz4:4", "lz4")])
def test_encode_compresses_in_the_codec_it_is_given_and_decode_undoes_it(codec, compressor):
    tensors = {"w": torch.zeros(10_000)}
    plain = encode("result", run_id="r", round=1, task_id="t", sender="c", tensors=tensors)
    packed = encode("result", run_id="r", round=1, task_id="t", sender="c", tensors=tensors,
                    compression=parse_codec(codec))
    assert packed[:4] == COMPRESSORS[compressor][0] and len(packed) < len(plain) / 10
    assert torch.equal(decode(packed).tensors["w"], tensors["w"])


def test_encode_leaves_a_message_plain_without_a_compressor_or_when_it_would_not_shrink():
    noise = {"w": torch.randint(0, 256, (8000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))}
    plain = encode("result", run_id="r", round=1, task_id="t", sender="c", tensors=noise)
    for codec in ("fp32", "zstd"):
        again = encode("result", run_id="r", round=1, task_id="t", sender="c", tensors=noise,
                       compression=parse_codec(codec))
        assert again == plain


# --------------------------------------------------------------------------- typed bodies

SPEC = {"name": "mlp", "hidden": [16], "num_classes": 10, "in_channels": 1, "image_size": 8}
DIGEST = "ab" * 32

BODIES = {
    "presence online": ("presence", PresenceBody("online", num_samples=12, input_shape=(1, 8, 8), num_classes=10,
                                                  device={"arch": "aarch64", "cores": 4, "board": None})),
    "presence offline": ("presence", PresenceBody("offline")),
    "task": ("task", TaskBody(objective="train", model=SPEC, up=("fc.weight", "fc.bias"), hyper={"lr": 0.1},
                              upload=UploadSettings(parse_codec("topk:0.1+int8+zstd"), "delta", True),
                              codec=parse_codec("fp16+zstd:5"), broadcast=DIGEST, seed=3, timeout=30.0,
                              resend_every=2.5, deadline=1.7e9)),
    "task, defaults": ("task", TaskBody(objective="evaluate", model=SPEC, up=())),
    "result": ("result", ResultBody(num_samples=5, metrics={"train_loss": 0.25, "n": 3.0},
                                    codec=parse_codec("topk:0.1+int8"), delta=("fc.weight",),
                                    profile={"seconds": 1.5})),
    "result, failed": ("result", ResultBody(error="no such objective", profile={"seconds": 0.1})),
    "status ack": ("status", StatusBody("ack", "f4af0f0ab87c4609")),
    "status rejected": ("status", StatusBody("rejected", "f4af0f0ab87c4609", "bad shapes")),
    "status running": ("status", StatusBody("running")),
    "model": ("model", ModelBody(parse_codec("bf16+lz4"))),
}


@pytest.mark.parametrize("name", BODIES)
def test_each_body_round_trips_through_a_message(name):
    kind, body = BODIES[name]
    msg = decode(encode(kind, run_id="r", round=1, task_id="t", sender="coordinator", body=body.to_body()))
    assert type(body).from_body(msg.body) == body


def test_bodies_keep_the_documented_json_keys():
    task = BODIES["task"][1].to_body()
    assert list(task) == ["objective", "hyper", "model", "up", "seed", "timeout", "resend_every", "deadline",
                          "upload", "broadcast", "codec"]
    assert task["upload"] == {"codec": "topk:0.1+int8+zstd", "update": "delta", "error_feedback": True}
    assert task["codec"] == "fp16+zstd:5" and task["up"] == ["fc.weight", "fc.bias"]
    assert "broadcast" not in BODIES["task, defaults"][1].to_body()
    assert list(BODIES["result"][1].to_body()) == ["num_samples", "metrics", "codec", "delta", "profile"]
    assert BODIES["result, failed"][1].to_body() == {"error": "no such objective", "profile": {"seconds": 0.1}}
    assert BODIES["status ack"][1].to_body() == {"state": "ack", "task_id": "f4af0f0ab87c4609"}
    assert BODIES["status running"][1].to_body() == {"state": "running"}
    assert BODIES["presence offline"][1].to_body() == {"state": "offline"}
    assert BODIES["presence online"][1].to_body()["input_shape"] == [1, 8, 8]
    assert BODIES["model"][1].to_body() == {"codec": "bf16+lz4"}


def test_absent_optional_fields_take_their_defaults():
    task = TaskBody.from_body({"objective": "train", "model": SPEC, "up": []})
    assert (task.hyper, task.seed, task.broadcast, task.deadline) == ({}, 0, None, None)
    assert (task.timeout, task.resend_every) == (DEFAULT_TASK_TIMEOUT, DEFAULT_RESEND_EVERY)
    assert task.upload == UploadSettings() and task.codec.text == "fp32"   # no upload: raw float32
    upload = TaskBody.from_body({"objective": "train", "model": SPEC, "up": [], "upload": {}}).upload
    assert (upload.codec.text, upload.update, upload.error_feedback) == ("fp32", "delta", True)
    result = ResultBody.from_body({"num_samples": 4})
    assert (result.metrics, result.codec.text, result.delta, result.profile, result.error) == ({}, "fp32", (), {}, None)
    assert ModelBody.from_body({}).codec.text == "fp32"
    assert TaskBody.from_body({"objective": "train", "model": SPEC, "up": [], "timeout": 30}).timeout == 30.0


def test_a_failed_result_needs_only_its_reason():
    body = ResultBody.from_body({"error": "out of memory", "num_samples": "whatever"})
    assert body.error == "out of memory" and body.profile == {}


def test_metrics_arrive_as_floats():
    assert ResultBody.from_body({"num_samples": 1, "metrics": {"a": 1, "b": 0.5}}).metrics == {"a": 1.0, "b": 0.5}


_TASK = {"objective": "train", "model": SPEC, "up": ["fc.weight"]}
_RESULT = {"num_samples": 5}


@pytest.mark.parametrize("cls, base, key, value, field", [
    (TaskBody, _TASK, "objective", 3, "objective"),
    (TaskBody, _TASK, "model", "mlp", "model"),
    (TaskBody, _TASK, "up", "fc.weight", "up"),
    (TaskBody, _TASK, "up", ["fc.weight", 2], "up"),
    (TaskBody, _TASK, "hyper", [], "hyper"),
    (TaskBody, _TASK, "upload", "fp32", "upload"),
    (TaskBody, _TASK, "upload", {"codec": 16}, "upload.codec"),
    (TaskBody, _TASK, "upload", {"update": "sum"}, "upload.update"),
    (TaskBody, _TASK, "upload", {"error_feedback": "yes"}, "upload.error_feedback"),
    (TaskBody, _TASK, "codec", ["fp32"], "codec"),
    (TaskBody, _TASK, "broadcast", 5, "broadcast"),
    (TaskBody, _TASK, "broadcast", "not-a-hash", "broadcast"),
    (TaskBody, _TASK, "seed", 1.5, "seed"),
    (TaskBody, _TASK, "seed", True, "seed"),
    (TaskBody, _TASK, "timeout", "30", "timeout"),
    (TaskBody, _TASK, "timeout", 0, "timeout"),
    (TaskBody, _TASK, "timeout", 10**400, "timeout"),
    (TaskBody, _TASK, "resend_every", -1, "resend_every"),
    (TaskBody, _TASK, "deadline", "soon", "deadline"),
    (ResultBody, _RESULT, "num_samples", "5", "num_samples"),
    (ResultBody, _RESULT, "num_samples", 0, "num_samples"),
    (ResultBody, _RESULT, "num_samples", True, "num_samples"),
    (ResultBody, _RESULT, "metrics", [1.0], "metrics"),
    (ResultBody, _RESULT, "metrics", {"train_loss": "low"}, "metrics"),
    (ResultBody, _RESULT, "metrics", {"train_loss": 1e400}, "metrics"),
    (ResultBody, _RESULT, "codec", 8, "codec"),
    (ResultBody, _RESULT, "delta", {"fc.weight": 1}, "delta"),
    (ResultBody, _RESULT, "profile", "fast", "profile"),
    (ResultBody, _RESULT, "error", 500, "error"),
    (StatusBody, {"state": "ack"}, "state", "maybe", "state"),
    (StatusBody, {"state": "ack"}, "task_id", 7, "task_id"),
    (StatusBody, {"state": "rejected"}, "reason", None, "reason"),
    (PresenceBody, {"state": "online"}, "state", "away", "state"),
    (PresenceBody, {"state": "online"}, "num_samples", -1, "num_samples"),
    (PresenceBody, {"state": "online"}, "input_shape", [1, "8", 8], "input_shape"),
    (PresenceBody, {"state": "online"}, "num_classes", 2.0, "num_classes"),
    (PresenceBody, {"state": "online"}, "device", "pi", "device"),
    (ModelBody, {}, "codec", None, "codec"),
])
def test_a_wrong_type_is_refused_naming_the_field(cls, base, key, value, field):
    with pytest.raises(ProtocolError, match=f"field '{field}'") as info:
        cls.from_body({**base, key: value})
    assert "must be" in str(info.value)


@pytest.mark.parametrize("cls, body, field", [
    (TaskBody, {"model": SPEC, "up": []}, "objective"),
    (TaskBody, {"objective": "train", "up": []}, "model"),
    (TaskBody, {"objective": "train", "model": SPEC}, "up"),
    (ResultBody, {"metrics": {}}, "num_samples"),
    (StatusBody, {"task_id": "t"}, "state"),
    (PresenceBody, {"num_samples": 3}, "state"),
])
def test_a_missing_required_field_is_refused_naming_it(cls, body, field):
    with pytest.raises(ProtocolError, match=f"field '{field}' is missing"):
        cls.from_body(body)


@pytest.mark.parametrize("cls", [TaskBody, ResultBody, StatusBody, PresenceBody, ModelBody])
def test_a_body_that_is_not_an_object_is_refused(cls):
    with pytest.raises(ProtocolError, match="body must be an object"):
        cls.from_body(["state", "online"])


@pytest.mark.parametrize("cls, body, field", [
    (TaskBody, {**_TASK, "codec": "fp8"}, "codec"),
    (TaskBody, {**_TASK, "upload": {"codec": "topk:2"}}, "upload.codec"),
    (ResultBody, {**_RESULT, "codec": "int8+fp16"}, "codec"),
    (ModelBody, {"codec": ""}, "codec"),
])
def test_an_invalid_codec_is_a_codec_error_naming_the_field(cls, body, field):
    with pytest.raises(CodecError, match=f"field '{field}'"):
        cls.from_body(body)


def test_a_body_parses_its_codecs_once():
    task = TaskBody.from_body({**_TASK, "codec": "fp16+zstd", "upload": {"codec": "int8+lz4"}})
    assert task.codec == parse_codec("fp16+zstd") and task.upload.codec == parse_codec("int8+lz4")
    assert task.codec.compressor == "zstd" and task.upload.codec.dtype == torch.float32


def test_a_claim_body_is_typed_and_checked():
    from edge_client.wire.protocol import ClaimBody

    claim = ClaimBody("", True, 2048)
    body = {"num_samples": 5, "metrics": {}, **claim.to_body()}   # beside the device's own result body
    assert ClaimBody.from_body(body) == claim
    assert ClaimBody.from_body({"num_samples": 5}) == ClaimBody()
    for bad in ({"held": "yes"}, {"wire_bytes": -1}, {"wire_bytes": True}, {"problem": 3}):
        with pytest.raises(ProtocolError, match="claim field"):
            ClaimBody.from_body(bad)


def test_a_body_that_cannot_be_json_names_the_number_that_is_not_finite():
    body = {"num_samples": 10, "metrics": {"train_loss": 0.5, "train_loss_sq": float("inf")}}
    with pytest.raises(ProtocolError, match=r"not plain finite JSON: body.metrics.train_loss_sq is inf"):
        encode("result", run_id="r", round=3, task_id="t", sender="pi-01", body=body)
    with pytest.raises(ProtocolError, match=r"not plain finite JSON: body.steps.1 is nan"):
        encode("result", run_id="r", round=3, task_id="t", sender="pi-01", body={"steps": [1.0, float("nan")]})


def test_tensors_that_share_memory_are_written_each_whole_and_others_are_not_copied():
    from edge_client.wire.envelope import _unshared

    base = torch.arange(12, dtype=torch.float32)
    alone = torch.ones(3)
    plain = _unshared({"a": base[:6], "b": base[6:], "alone": alone})
    assert plain["alone"] is alone and plain["a"].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    msg = decode(encode("result", run_id="r", round=1, task_id="t", sender="pi-01",
                        tensors={"a": base[:6], "b": base[6:].view(2, 3), "alone": alone}))
    assert torch.equal(msg.tensors["a"], base[:6]) and torch.equal(msg.tensors["b"], base[6:].view(2, 3))
