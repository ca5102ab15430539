"""Fuzzing the wire: the envelope decoder, the codecs' layout decoders and the chunk reassembler fed generated and
mutated messages.

All three read bytes that any device or anyone with broker access can send, so none may
crash, hang or hold memory without bound: the decoder refuses with ProtocolError, the
reassembler reports a failure (an ``Assembled`` with ``error``) and raises nothing, the codec
layouts refuse with CodecError.
Valid messages are built with the real ``encode`` (every kind, every wire dtype, with
and without compression) and then mutated: truncated, bit-flipped, bytes inserted,
deleted or duplicated, header length and header JSON rewritten (wrong dtypes, shapes,
offsets and fields), NaN and infinity written into tensors, compression frames
corrupted or inflated, plain garbage; chunk streams are duplicated, reordered,
dropped, mixed between senders and tampered with. Each codec's wire tensors (dense, top-k, eden,
lowrank) are mutated the same way and must decode to finite tensors of the right shapes or be
refused with a CodecError.

The bulk runs from a seeded ``random.Random`` so every run sees the same inputs;
hypothesis drives the structured cases, derandomized with a bounded ``max_examples``.
Inputs that once crashed the decoder (a shape of 1e999, headers nested 100,000 deep)
are kept as tests of their own at the end.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import struct
import time
import tracemalloc
from collections.abc import Callable
from functools import lru_cache
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_client.wire.chunking import HEADER_BYTES, Assembled, Reassembler, split
from edge_client.wire.codec import CodecError, decode_tensors, encode_tensors, parse_codec
from edge_client.wire.compression import COMPRESSORS
from edge_client.wire.protocol import KINDS, Message, ProtocolError, decode, encode, valid_client_id

MAX_BYTES = 1 << 20          # the decoder's limit in these tests: small, so size checks are reached
BULK_DECODES = 100_000       # mutated (and some intact) envelopes through decode per run
BULK_STREAMS = 10_000        # chunk streams, each of 1 to 4 messages, through a reassembler per run

FUZZ = settings(deadline=None, derandomize=True, database=None, max_examples=200,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
           "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64}
_FLOAT_TAGS = ("F32", "F16", "BF16", "F64")
_SHAPES = ((), (0,), (1,), (7,), (2, 3), (3, 0, 2), (2, 2, 2, 2), (64,), (16, 33))


class Original(NamedTuple):
    """A message as it was built, to compare with what decodes."""

    kind: str
    run_id: str
    round: int
    task_id: str
    sender: str
    body: dict[str, Any]
    tensors: dict[str, torch.Tensor]


# ----------------------------------------------------------------------------- building messages

def _tensor(rng: random.Random, tag: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Values of one dtype; some constant, so compression sometimes pays."""
    dtype = _DTYPES[tag]
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    if rng.random() < 0.3:
        return torch.full(shape, rng.randrange(-3, 4) if tag != "U8" else 7, dtype=dtype)
    if tag in _FLOAT_TAGS:
        return (torch.randn(shape, generator=gen) * 10).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, shape, generator=gen, dtype=dtype)


def _body(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A JSON object as bodies are: nested objects and lists of strings, integers and finite floats."""
    leaves: list[Callable[[], Any]] = [lambda: rng.randrange(-10**12, 10**12), lambda: rng.uniform(-1e6, 1e6),
                                       lambda: rng.choice(["", "fp16+zstd", "ok", "ünïcödé ✓", "a\"b\\c"]),
                                       lambda: rng.random() < 0.5, lambda: None]
    out: dict[str, Any] = {}
    for i in range(rng.randrange(0, 5)):
        pick = rng.random()
        if pick < 0.15 and depth < 3:
            out[f"k{i}"] = _body(rng, depth + 1)
        elif pick < 0.3:
            out[f"k{i}"] = [rng.choice(leaves)() for _ in range(rng.randrange(4))]
        else:
            out[f"k{i}"] = rng.choice(leaves)()
    return out


def build(rng: random.Random, *, big: bool = False) -> tuple[bytes, Original]:
    """One valid message from the real encoder: any kind, tensors of any wire dtype, maybe compressed."""
    names = rng.sample(["w", "b", "layer.0.weight", "layer.0.bias", "head", "ünï", "x" * 40], rng.randrange(0, 5))
    tensors = {n: _tensor(rng, rng.choice(list(_DTYPES)), rng.choice(_SHAPES)) for n in names}
    if big:
        tensors["big"] = _tensor(rng, rng.choice(["F32", "I16", "U8"]), (rng.randrange(2000, 8000),))
    original = Original(kind=rng.choice(KINDS), run_id=rng.choice(["20260101-000000-abcdef", "", "r" * 100]),
                        round=rng.randrange(-2, 10**6), task_id=rng.choice(["t-1", "", "✓"]),
                        sender=rng.choice(["coordinator", "pi-01", "sim-000", "a.b_c-D"]), body=_body(rng),
                        tensors=tensors)
    codec = rng.choice([None, None, parse_codec("fp32+zstd"), parse_codec("fp16+lz4")])
    payload = encode(original.kind, run_id=original.run_id, round=original.round, task_id=original.task_id,
                     sender=original.sender, body=original.body, tensors=tensors, compression=codec)
    return payload, original


@lru_cache(maxsize=None)
def pool() -> tuple[tuple[bytes, Original], ...]:
    """Valid messages to mutate, built once per run."""
    rng = random.Random(20260101)
    return tuple(build(rng, big=i % 8 == 0) for i in range(160))


# ----------------------------------------------------------------------------- mutations

def _split_header(payload: bytes) -> tuple[dict[str, Any], bytes] | None:
    """The safetensors header as JSON and the data behind it, when the payload has a readable one."""
    if len(payload) < 8:
        return None
    (n,) = struct.unpack("<Q", payload[:8])
    try:
        return json.loads(payload[8:8 + n]), payload[8 + n:]
    except ValueError:
        return None


def _join_header(header: Any, data: bytes) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(text)) + text + data


_ODD_VALUES: tuple[Any, ...] = (None, True, False, 0, -1, 1.5, 2**31, 2**63, 2**64 + 5, -(2**70), "", "x", "2",
                                [], [1], {}, {"a": 1}, [[0]], "F32", "../../etc")


def _int_list(value: Any) -> list[int] | None:
    """``value`` when it is a list of integers (as shapes and offsets should be), else None."""
    return value if isinstance(value, list) and all(type(v) is int for v in value) else None


def _edit_tensor_entry(rng: random.Random, header: dict[str, Any], data: bytes) -> bytes:
    entries = [k for k in header if k != "__metadata__"]
    if not entries:
        header[rng.choice(["w", "__x__"])] = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
        return _join_header(header, data)
    name = rng.choice(entries)
    info = header[name]
    if not isinstance(info, dict):
        header[name] = rng.choice(_ODD_VALUES)
        return _join_header(header, data)
    shape = _int_list(info.get("shape"))
    offsets = _int_list(info.get("data_offsets"))
    start, end = offsets if offsets is not None and len(offsets) == 2 else (0, len(data))
    what = rng.randrange(12)
    if what == 0:       # another dtype, valid or not: sizes then disagree, or the tag is unknown
        info["dtype"] = rng.choice(list(_DTYPES) + ["BOOL", "U64", "F8_E4M3", "f32", "", 4, None])
    elif what == 1:     # one dimension more or fewer
        shape = shape or []
        info["shape"] = shape + [rng.randrange(4)] if rng.random() < 0.5 or not shape else shape[:-1]
    elif what == 2:     # dimensions that are not non-negative integers, or absurdly large
        info["shape"] = [rng.choice(_ODD_VALUES) for _ in range(rng.randrange(1, 4))]
    elif what == 3:     # a shape that keeps the byte count but moves it between dimensions
        shape = shape or []
        info["shape"] = [shape[0] * shape[1]] + shape[2:] if len(shape) >= 2 else shape + [1]
    elif what == 4:     # offsets past the data, reversed, negative, overlapping, odd types
        info["data_offsets"] = rng.choice([[end, start], [start, end + 1], [start - 1, end], [0, len(data) + 8],
                                           [start, 2**64], [-4, end], [start], [start, end, end], "0,4",
                                           [float(start), float(end)], [0, 0]])
    elif what == 5 and info:
        del info[rng.choice(list(info))]
    elif what == 6:
        header[name + "2"] = dict(info)          # a second entry over the same bytes
    elif what == 7:
        del header[name]                         # bytes nobody claims
    elif what == 8:
        info[rng.choice(["extra", "dtype", "shape", "data_offsets"])] = rng.choice(_ODD_VALUES)
    elif what == 9:     # a huge shape whose product is zero
        info["shape"] = [0, 2**62, 2**62]
    elif what == 10:    # sizes that overflow a 64-bit product
        info["shape"] = [2**40, 2**40]
        info["data_offsets"] = [0, 2**80]
    else:
        header[rng.choice(["", "a" * 300, "__metadata__x", "\u0000"])] = dict(info)
    return _join_header(header, data)


def _edit_metadata(rng: random.Random, header: dict[str, Any], data: bytes) -> bytes:
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or rng.random() < 0.1:
        header["__metadata__"] = rng.choice(_ODD_VALUES)
        return _join_header(header, data)
    try:
        fedge = json.loads(meta["fedge"])
    except (KeyError, TypeError, ValueError):
        meta["fedge"] = rng.choice(_ODD_VALUES)
        return _join_header(header, data)
    what = rng.randrange(6)
    if what == 0 and isinstance(fedge, dict):      # a field with a value of the wrong type or range
        fedge[rng.choice(["v", "kind", "run_id", "round", "task_id", "sender", "body"])] = rng.choice(
            _ODD_VALUES + (1, 3, "presence", "result", "a/b", "+", "#", "x" * 65, "ok-id"))
    elif what == 1 and isinstance(fedge, dict):    # a field missing
        fedge.pop(rng.choice(["v", "kind", "run_id", "round", "task_id", "sender", "body"]), None)
    elif what == 2:                                 # not an object at all
        fedge = rng.choice(_ODD_VALUES)
    elif what == 3:                                 # metadata that is not JSON
        meta["fedge"] = rng.choice(["", "{", "NaN", "Infinity", "[1,2", "{\"v\":2,}", "\udcff"])
        return _join_header(header, data)
    elif what == 4:                                 # metadata with other keys, or none
        meta[rng.choice(["other", "fedge2"])] = "x"
        if rng.random() < 0.5:
            del meta["fedge"]
        return _join_header(header, data)
    else:                                           # a body with non-finite numbers, refused as such
        meta["fedge"] = json.dumps(fedge).replace("}", ",\"nan\":NaN}", 1)
        return _join_header(header, data)
    meta["fedge"] = json.dumps(fedge)
    return _join_header(header, data)


def m_header_json(rng: random.Random, payload: bytes) -> bytes:
    """Rewrite the safetensors header as JSON (tensor entries or fedge fields) and repack it consistently."""
    parts = _split_header(payload)
    if parts is None or not isinstance(parts[0], dict):
        return m_bitflip(rng, payload)
    header, data = parts
    return (_edit_tensor_entry if rng.random() < 0.6 else _edit_metadata)(rng, header, data)


def m_nonfinite(rng: random.Random, payload: bytes) -> bytes:
    """Write NaN or an infinity into a floating-point tensor's data."""
    parts = _split_header(payload)
    if parts is None:
        return m_bitflip(rng, payload)
    header, data = parts
    widths = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}

    def writable(info: Any) -> bool:
        if not isinstance(info, dict) or not isinstance(info.get("dtype"), str) or info["dtype"] not in widths:
            return False
        offsets = info.get("data_offsets")
        return (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] and offsets[0] + widths[info["dtype"]] <= offsets[1] <= len(data))

    floats = [v for k, v in header.items() if k != "__metadata__" and writable(v)] if isinstance(header, dict) else []
    if not floats:
        return m_bitflip(rng, payload)
    info = rng.choice(floats)
    tag, (first, last) = info["dtype"], info["data_offsets"]
    width = widths[tag]
    value = rng.choice([float("nan"), float("inf"), float("-inf")])
    pattern = {"F32": struct.pack("<f", value), "F64": struct.pack("<d", value),
               "F16": struct.pack("<e", value), "BF16": struct.pack("<f", value)[2:]}[tag]
    at = len(payload) - len(data) + first + width * rng.randrange((last - first) // width)
    return payload[:at] + pattern + payload[at + width:]


def m_truncate(rng: random.Random, payload: bytes) -> bytes:
    return payload[:rng.randrange(len(payload) + 1)]


def m_bitflip(rng: random.Random, payload: bytes) -> bytes:
    if not payload:
        return bytes([rng.randrange(256)])
    out = bytearray(payload)
    for _ in range(rng.choice([1, 1, 2, 3, 8])):
        # the header and the first bytes matter most: aim there half the time
        at = rng.randrange(min(len(out), 200)) if rng.random() < 0.5 else rng.randrange(len(out))
        out[at] ^= 1 << rng.randrange(8)
    return bytes(out)


def m_insert(rng: random.Random, payload: bytes) -> bytes:
    at = rng.randrange(len(payload) + 1)
    return payload[:at] + rng.randbytes(rng.choice([1, 2, 4, 8, 100])) + payload[at:]


def m_delete(rng: random.Random, payload: bytes) -> bytes:
    at = rng.randrange(len(payload) + 1)
    return payload[:at] + payload[at + rng.choice([1, 2, 4, 8, 100]):]


def m_duplicate(rng: random.Random, payload: bytes) -> bytes:
    at, size = rng.randrange(len(payload) + 1), rng.choice([1, 8, 64, 1000])
    return payload[:at] + payload[at:at + size] + payload[at:]


def m_header_length(rng: random.Random, payload: bytes) -> bytes:
    """Declare another header length: off by a few, past the end, at and over the limits, 2**64 - 1."""
    (n,) = struct.unpack("<Q", payload[:8]) if len(payload) >= 8 else (0,)
    value = rng.choice([0, 1, n - 1, n + 1, n + 8, len(payload) - 8, len(payload) - 7, 4 << 20, (4 << 20) + 1,
                        MAX_BYTES, 2**32, 2**63, 2**64 - 1])
    return struct.pack("<Q", min(max(0, value), 2**64 - 1)) + payload[8:]


def m_garbage(rng: random.Random, payload: bytes) -> bytes:
    """Random bytes, some behind a magic so they reach the compressors or pass for an envelope start."""
    prefix = rng.choice([b"", b"", COMPRESSORS["zstd"][0], COMPRESSORS["lz4"][0], b"FDC1", payload[:8],
                         COMPRESSORS["zstd"][0] + b"\x28\xb5\x2f\xfd", COMPRESSORS["lz4"][0] + b"\x04\x22\x4d\x18"])
    return prefix + rng.randbytes(rng.choice([0, 1, 7, 8, 9, 64, 1000]))


def _frame(name: str, data: bytes, *, declare_size: bool = True) -> bytes:
    """``data`` as a compressed message, even where compression does not pay."""
    if name == "zstd":
        import zstandard
        packed = zstandard.ZstdCompressor(write_content_size=declare_size).compress(data)
    else:
        import lz4.frame
        packed = lz4.frame.compress(data, store_size=declare_size)
    return COMPRESSORS[name][0] + packed


def m_recompress(rng: random.Random, payload: bytes) -> bytes:
    """Compress a (mutated) envelope, so the decoder gets past decompression to a broken envelope."""
    return _frame(rng.choice(["zstd", "lz4"]), payload, declare_size=rng.random() < 0.8)


def m_bomb(rng: random.Random, payload: bytes) -> bytes:
    """A small frame that expands past the limit, with its size declared or not."""
    return _frame(rng.choice(["zstd", "lz4"]), payload[:64] + bytes(MAX_BYTES + rng.randrange(1, 4096)),
                  declare_size=rng.random() < 0.5)


def m_oversize(rng: random.Random, payload: bytes) -> bytes:
    """Longer than the receiver's limit, plain or compressed."""
    longer = payload + bytes(MAX_BYTES + 1 - len(payload) + rng.randrange(100))
    return longer if rng.random() < 0.5 else m_bomb(rng, payload)


_MUTATIONS: tuple[tuple[Callable[[random.Random, bytes], bytes], int], ...] = (
    (m_truncate, 10), (m_bitflip, 20), (m_insert, 8), (m_delete, 8), (m_duplicate, 4), (m_header_length, 6),
    (m_header_json, 30), (m_nonfinite, 6), (m_garbage, 5), (m_recompress, 3), (m_oversize, 0.3),
)
_MUTATORS = [m for m, _ in _MUTATIONS]
_WEIGHTS = [w for _, w in _MUTATIONS]


def mutate(rng: random.Random, payload: bytes) -> bytes:
    """One to three stacked mutations."""
    for mutation in rng.choices(_MUTATORS, _WEIGHTS, k=rng.choice([1, 1, 1, 2, 3])):
        payload = mutation(rng, payload)
    return payload


# ----------------------------------------------------------------------------- checks

def _same(message: Message, original: Original) -> bool:
    return (message.kind, message.run_id, message.round, message.task_id, message.sender, message.body) == (
        original.kind, original.run_id, original.round, original.task_id, original.sender, original.body) and \
        message.tensors.keys() == original.tensors.keys() and all(
            t.dtype == original.tensors[k].dtype and t.shape == original.tensors[k].shape
            and torch.equal(t, original.tensors[k]) for k, t in message.tensors.items())


def check_decode(payload: bytes, original: Original | None = None, *, max_bytes: int = MAX_BYTES) -> str:
    """Decode; return ``"ok"`` or the refusal's reason. Anything but ProtocolError fails the test."""
    try:
        message = decode(payload, max_bytes=max_bytes)
    except ProtocolError as exc:
        assert original is None, f"an intact message was refused: {exc}"
        return str(exc)
    except Exception as exc:
        raise AssertionError(f"decode raised {type(exc).__name__}: {exc!s:.300} on a {len(payload)}-byte "
                             f"payload starting {payload[:300]!r}") from exc
    if original is not None:
        assert _same(message, original), f"decoded {message!r:.300} differs from {original!r:.300}"
    else:   # what a mutation left acceptable must still meet every promise decode makes
        assert message.kind in KINDS and valid_client_id(message.sender) and isinstance(message.body, dict)
        assert isinstance(message.round, int) and not isinstance(message.round, bool)
        assert all(bool(torch.isfinite(t).all()) for t in message.tensors.values() if t.is_floating_point())
    return "ok"


# ----------------------------------------------------------------------------- the decoder, in bulk

def test_intact_messages_decode_to_what_was_encoded():
    for payload, original in pool():
        assert check_decode(payload, original) == "ok"


@pytest.mark.timeout(120)
def test_bulk_mutated_envelopes_decode_or_raise_protocol_error():
    rng = random.Random(7)
    messages = pool()
    checks = ("exceeds the limit", "too short", "header length", "not a fedge envelope", "is not a JSON object",
              "invalid entry", "protocol version", "unknown message kind", "missing or not", "is not a valid id",
              "tensor data is corrupt", "NaN or infinite", "frame is corrupt", "frame is truncated", "expands past",
              "declares")
    reached: dict[str, int] = dict.fromkeys(checks, 0)
    accepted = 0
    start = time.perf_counter()
    for i in range(BULK_DECODES):
        payload, original = messages[rng.randrange(len(messages))]
        if i % 50 == 0:
            check_decode(payload, original)
            continue
        reason = check_decode(mutate(rng, payload))
        accepted += reason == "ok"
        for check in checks:
            if check in reason:
                reached[check] += 1
    elapsed = time.perf_counter() - start
    print(f"\n{BULK_DECODES} envelopes decoded in {elapsed:.1f} s; accepted after mutation: {accepted}; "
          f"refusals by check: {reached}")
    # The mutations must reach every check, the deep ones included, and leave some messages valid.
    assert accepted > BULK_DECODES // 50
    assert all(reached.values()), f"checks no mutation reached: {[c for c, n in reached.items() if not n]}"
    assert elapsed < 60, f"{BULK_DECODES} decodes took {elapsed:.0f} s: the decoder got slow on bad input"


def test_compression_bombs_are_refused_within_bounded_memory():
    rng = random.Random(3)
    payload = pool()[0][0]
    tracemalloc.start()
    try:
        for _ in range(12):
            assert check_decode(m_bomb(rng, payload)) != "ok"
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The frames are built inside the traced region (MAX_BYTES of zeros each); the decoder must
    # not add more than about one limit's worth on top.
    assert peak < 3 * MAX_BYTES, f"peak {peak} bytes"


def test_decoding_holds_at_most_a_few_times_the_limit():
    rng = random.Random(5)
    messages = [mutate(rng, p) for p, _ in pool() for _ in range(5)]
    big = encode("model", run_id="r", round=1, task_id="t", sender="coordinator",
                 tensors={"w": torch.zeros(MAX_BYTES // 4 - 100)})
    messages += [big, m_bitflip(rng, big), big[:-1], m_header_length(rng, big)]
    tracemalloc.start()
    try:
        for payload in messages:
            check_decode(payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * MAX_BYTES, f"peak {peak} bytes"


# ----------------------------------------------------------------------------- the reassembler, in bulk

class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def m_chunk(rng: random.Random, chunk: bytes) -> bytes:
    """Tamper with one chunk: a header field, its data, its length."""
    if len(chunk) < HEADER_BYTES:       # already cut short by an earlier tampering
        return m_garbage(rng, chunk)
    what = rng.randrange(8)
    out = bytearray(chunk)
    if what == 0:                     # index, count, length: any value, in range or not
        at, width = rng.choice([(24, 4), (28, 4), (32, 8)])
        out[at:at + width] = rng.choice([0, 1, 2, 255, 2**32 - 1, 2**width * 8 - 1, rng.randrange(64)]).to_bytes(
            8, "little")[:width]
    elif what == 1:                   # the digest
        out[40 + rng.randrange(32)] ^= 1 << rng.randrange(8)
    elif what == 2:                   # the message id: now a message of its own
        out[8 + rng.randrange(16)] ^= 1 << rng.randrange(8)
    elif what == 3:                   # flags and reserved bytes
        out[4 + rng.randrange(4)] ^= 1 << rng.randrange(8)
    elif what == 4 and len(out) > HEADER_BYTES:   # a data bit
        out[rng.randrange(HEADER_BYTES, len(out))] ^= 1 << rng.randrange(8)
    elif what == 5:
        return chunk[:rng.randrange(len(chunk))]
    elif what == 6:
        return chunk + rng.randbytes(rng.choice([1, 100]))
    else:
        return m_garbage(rng, chunk)
    return bytes(out)


class StreamCheck:
    """Feeds chunk streams to one reassembler and checks every promise it makes on the way."""

    def __init__(self, reassembler: Reassembler, clock: Clock) -> None:
        self.r, self.clock = reassembler, clock
        self.fed = self.reported = 0
        self.sent: dict[bytes, Original | None] = {}     # sha256 of each message split -> its original if intact
        self.whole = self.decoded = 0

    def feed(self, sender: str, chunk: bytes) -> None:
        self.fed += len(chunk)
        for done in self.r.feed(sender, chunk):
            self.take(done)
        assert self.r.held <= self.r.total_bytes and self.r.partial_messages <= self.r.max_partial_messages

    def take(self, done: Assembled) -> None:
        self.reported += done.wire_bytes
        assert not (done.payload and done.error)
        if done.payload:
            digest = hashlib.sha256(done.payload).digest()
            assert digest in self.sent, "the reassembler produced a message nobody sent"
            self.whole += 1
            self.decoded += check_decode(done.payload, self.sent[digest]) == "ok"

    def finish(self) -> None:
        self.clock.now += self.r.timeout + 1
        for done in self.r.expire():
            self.take(done)
        assert self.r.partial_messages == 0 and self.r.held == 0
        assert self.reported == self.fed, "some chunk's bytes were not reported exactly once"


def _stream(rng: random.Random, messages: list[bytes], chunk_bytes: int) -> list[bytes]:
    """The chunks of ``messages``, interleaved, some duplicated, dropped, tampered with, reordered."""
    chunks = [c for m in messages for c in split(m, chunk_bytes, part_topic=rng.random() < 0.2)]
    if rng.random() < 0.3:
        chunks += rng.choices(chunks, k=rng.randrange(1, 4))                      # redelivered
    if rng.random() < 0.2 and len(chunks) > 1:
        del chunks[rng.randrange(len(chunks))]                                    # lost
    if rng.random() < 0.25:
        at = rng.randrange(len(chunks))
        chunks[at] = m_chunk(rng, chunks[at])                                     # tampered
    if rng.random() < 0.7:
        rng.shuffle(chunks)
    return chunks


@pytest.mark.timeout(120)
def test_bulk_chunk_streams_reassemble_only_whole_sent_messages():
    rng = random.Random(11)
    clock = Clock()
    check = StreamCheck(Reassembler(max_message_bytes=200_000, per_sender_bytes=64_000, total_bytes=96_000,
                                    max_partial_messages=6, timeout=30, clock=clock), clock)
    messages = pool()
    sent = 0
    for _ in range(BULK_STREAMS):
        batch = []
        for _ in range(rng.randrange(1, 5)):
            payload, original = messages[rng.randrange(len(messages))]
            if rng.random() < 0.3:
                payload, original = mutate(rng, payload), None
            check.sent[hashlib.sha256(payload).digest()] = original
            batch.append(payload)
        sent += len(batch)
        sender = rng.choice(["fedge/clients/a/result", "fedge/clients/b/result", "fedge/coordinator/model"])
        for chunk in _stream(rng, batch, rng.choice([1024, 1500, 4096])):
            check.feed(sender if rng.random() < 0.95 else "fedge/clients/z/result", chunk)
        if rng.random() < 0.1:
            clock.now += rng.choice([1, 31])
            for done in check.r.expire():
                check.take(done)
    check.finish()
    print(f"{sent} messages in {BULK_STREAMS} chunk streams: {check.whole} reassembled, {check.decoded} decoded, "
          f"{check.r.evicted} evicted, {check.r.expired} expired")
    assert check.whole > sent // 2 and check.decoded > sent // 3 and check.r.evicted and check.r.expired


def test_a_chunk_flood_from_many_senders_holds_bounded_memory():
    """Tiny first chunks under fresh ids from many topics: only the caps bound what is kept."""
    rng = random.Random(13)
    r = Reassembler(max_message_bytes=1 << 20, total_bytes=256 << 10, max_partial_messages=512)
    template = split(bytes(50_000), 2048)
    tracemalloc.start()
    try:
        for i in range(20_000):
            chunk = bytearray(template[rng.randrange(len(template))][:rng.choice([HEADER_BYTES, 200, 2048])])
            chunk[8:24] = rng.randbytes(16)
            r.feed(f"fedge/clients/c{i % 3000}/result", bytes(chunk))
            if i % 4000 == 0:
                r.expire()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # 256 KiB of chunk data, 512 incomplete messages' bookkeeping and the finished ids
    # remembered for at most 1024 senders (about 2 MB measured).
    assert r.held <= 256 << 10 and r.partial_messages <= 512 and r.evicted > 15_000
    assert peak < 4 << 20, f"peak {peak} bytes"


# ----------------------------------------------------------------------------- structured cases (hypothesis)

_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                       st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
_json = st.recursive(_json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                     max_leaves=12)
_tensors = st.dictionaries(
    st.text(min_size=1, max_size=12).filter(lambda n: n != "__metadata__"),
    st.tuples(st.sampled_from(list(_DTYPES)), st.lists(st.integers(0, 5), max_size=3), st.integers(0, 2**30)),
    max_size=4)


@st.composite
def messages(draw: st.DrawFn) -> tuple[bytes, Original]:
    tensors = {}
    for name, (tag, shape, seed) in draw(_tensors).items():
        tensors[name] = _tensor(random.Random(seed), tag, tuple(shape))
    original = Original(kind=draw(st.sampled_from(KINDS)), run_id=draw(st.text(max_size=30)),
                        round=draw(st.integers(-(2**63), 2**63 - 1)), task_id=draw(st.text(max_size=30)),
                        sender=draw(st.from_regex(r"[A-Za-z0-9_.-]{1,64}", fullmatch=True)),
                        body=draw(st.dictionaries(st.text(max_size=8), _json, max_size=5)), tensors=tensors)
    codec = draw(st.sampled_from([None, "fp32+zstd", "fp32+lz4"]))
    payload = encode(original.kind, run_id=original.run_id, round=original.round, task_id=original.task_id,
                     sender=original.sender, body=original.body, tensors=tensors,
                     compression=parse_codec(codec) if codec else None)
    return payload, original


@FUZZ
@given(messages())
def test_generated_messages_round_trip(message: tuple[bytes, Original]) -> None:
    payload, original = message
    assert check_decode(payload, original) == "ok"


@FUZZ
@given(messages(), st.lists(st.tuples(st.sampled_from(_MUTATORS), st.integers(0, 2**32)), min_size=1, max_size=3))
def test_generated_messages_mutated_decode_or_refuse(message: tuple[bytes, Original],
                                                     mutations: list[tuple[Callable[..., bytes], int]]) -> None:
    payload = message[0]
    for mutation, seed in mutations:
        payload = mutation(random.Random(seed), payload)
    check_decode(payload)


@FUZZ
@given(messages(), st.sampled_from(["dtype", "shape", "data_offsets", "entry", "v", "kind", "run_id", "round",
                                    "task_id", "sender", "body", "metadata"]), _json)
def test_any_json_in_any_header_field_decodes_or_refuses(message: tuple[bytes, Original], where: str,
                                                         value: Any) -> None:
    header, data = _split_header(message[0]) or ({}, b"")
    if not header:       # compressed: the edit goes into the envelope inside
        return
    names = [k for k in header if k != "__metadata__"]
    if where in ("dtype", "shape", "data_offsets", "entry"):
        if not names:
            header["t"] = value
        elif where == "entry":
            header[names[0]] = value
        else:
            header[names[0]][where] = value
    elif where == "metadata":
        header["__metadata__"] = value
    else:
        fedge = json.loads(header["__metadata__"]["fedge"])
        fedge[where] = value
        header["__metadata__"]["fedge"] = json.dumps(fedge)
    check_decode(_join_header(header, data))


@FUZZ
@given(st.lists(st.integers(1, 30_000), min_size=1, max_size=4), st.sampled_from([1024, 1100, 4096]),
       st.randoms(use_true_random=False), st.lists(st.sampled_from(["dup", "drop", "tamper", "swap", "foreign"]),
                                                   max_size=6))
def test_generated_chunk_streams_reassemble_only_whole_sent_messages(sizes: list[int], chunk_bytes: int,
                                                                     rng: random.Random, operations: list[str]) -> None:
    clock = Clock()
    check = StreamCheck(Reassembler(max_message_bytes=40_000, per_sender_bytes=50_000, total_bytes=70_000,
                                    max_partial_messages=3, timeout=10, clock=clock), clock)
    payloads = [rng.randbytes(n) for n in sizes]
    for payload in payloads:
        check.sent[hashlib.sha256(payload).digest()] = None
    chunks = [("a", c) for p in payloads for c in split(p, chunk_bytes)]
    for op in operations:
        at = rng.randrange(len(chunks))
        if op == "dup":
            chunks.insert(rng.randrange(len(chunks) + 1), chunks[at])
        elif op == "drop" and len(chunks) > 1:
            del chunks[at]
        elif op == "tamper":
            chunks[at] = (chunks[at][0], m_chunk(rng, chunks[at][1]))
        elif op == "swap":
            other = rng.randrange(len(chunks))
            chunks[at], chunks[other] = chunks[other], chunks[at]
        elif op == "foreign":
            chunks[at] = ("b", chunks[at][1])
    for sender, chunk in chunks:
        check.feed(sender, chunk)
    check.finish()
    if not operations:
        assert check.whole == sum(1 for n in sizes if n <= 40_000)


# ----------------------------------------------------------------------------- codec layouts

CODEC_TEXTS = ("fp32", "fp16", "int8", "topk:0.1+int8", "topk:0.5", "eden", "eden+int8", "eden:0.3", "lowrank:2",
               "lowrank:2+int8", "lowrank:3+fp16")
CODEC_SHAPES = {"w": (12, 20), "c": (4, 3, 3, 3), "b": (5,), "s": (), "e": (3,)}
BULK_LAYOUTS = 2_500    # mutated wire tensor sets per codec through decode_tensors


def _wire_of(text: str, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {k: torch.randn(shape, generator=gen) for k, shape in CODEC_SHAPES.items()}
    return dict(encode_tensors(tensors, parse_codec(text), sparse=set(CODEC_SHAPES), generator=gen, state={}))


def mutate_layout(rng: random.Random, wire: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One to three edits of a set of wire tensors as a sender could make them: entries dropped, added or
    swapped, dtypes and shapes changed, values replaced by random ones, NaN, infinities or huge numbers."""
    out = dict(wire)
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(sorted(out)) if out else "w"
        op = rng.randrange(7)
        if op == 0 and out:
            del out[key]
        elif op == 1:
            kind = rng.choice(["val", "idx", "mask", "scale", "bits", "seed", "p", "q", "p:scale", "junk"])
            out[key.split(":", 1)[0] + ":" + kind] = _tensor(rng, rng.choice(list(_DTYPES)), rng.choice(_SHAPES))
        elif op == 2 and key in out:
            out[key] = _tensor(rng, rng.choice(list(_DTYPES)), tuple(out[key].shape))
        elif op == 3 and key in out:
            tag = next(t for t, d in _DTYPES.items() if d == out[key].dtype)
            out[key] = _tensor(rng, tag, rng.choice(_SHAPES + (tuple(out[key].shape),)))
        elif op == 4 and key in out:
            tag = next(t for t, d in _DTYPES.items() if d == out[key].dtype)
            out[key] = _tensor(rng, tag, tuple(out[key].shape))
        elif op == 5 and key in out and out[key].is_floating_point() and out[key].numel():
            t = out[key].clone()
            t.view(-1)[rng.randrange(t.numel())] = rng.choice([math.nan, math.inf, -math.inf, 3e38, -1.0])
            out[key] = t
        elif op == 6 and len(out) > 1:
            a, b = rng.sample(sorted(out), 2)
            out[a], out[b] = out[b], out[a]
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("text", CODEC_TEXTS)
def test_codec_decoders_fed_mutated_layouts_refuse_with_codec_error(text):
    """What the envelope lets through reaches the codec: every layout's decoder either refuses with a
    CodecError or gives finite tensors of the expected shapes, whatever entries, dtypes, shapes and values came."""
    rng = random.Random(11)
    spec = parse_codec(text)
    originals = [_wire_of(text, seed) for seed in range(4)]
    refused = 0
    for i in range(BULK_LAYOUTS):
        wire = mutate_layout(rng, originals[i % len(originals)])
        sparse = set(CODEC_SHAPES) if rng.random() < 0.9 else {rng.choice(sorted(CODEC_SHAPES))}
        try:
            out = decode_tensors(wire, spec, CODEC_SHAPES, sparse=sparse & {k.split(":", 1)[0] for k in wire})
        except CodecError:
            refused += 1
            continue
        assert {k: tuple(v.shape) for k, v in out.items()} == CODEC_SHAPES
        assert all(bool(torch.isfinite(v).all()) for v in out.values())
    assert refused > BULK_LAYOUTS // 2


# ----------------------------------------------------------------------------- crashes still in the decoder

def _raw_header(payload: bytes, edit: Callable[[str], str]) -> bytes:
    (n,) = struct.unpack("<Q", payload[:8])
    text = edit(payload[8:8 + n].decode()).encode()
    return struct.pack("<Q", len(text)) + text + payload[8 + n:]


_PLAIN = encode("result", run_id="r", round=1, task_id="t", sender="pi-01", body={"a": 1},
                tensors={"w": torch.ones(2, 3)})


def test_a_shape_number_that_overflows_to_infinity_is_refused():
    reason = check_decode(_raw_header(_PLAIN, lambda s: s.replace('"shape":[2,3]', '"shape":[2,1e999]')))
    assert "not finite" in reason


def test_a_deeply_nested_header_is_refused():
    reason = check_decode(_raw_header(_PLAIN, lambda s: '{"x":' + "[" * 100_000 + "]" * 100_000 + "," + s[1:]))
    assert "RecursionError" in reason


def test_deeply_nested_fedge_metadata_is_refused():
    nested = "[" * 100_000 + "]" * 100_000
    reason = check_decode(_raw_header(_PLAIN, lambda s: s.replace('\\"a\\":1', '\\"a\\":' + nested)))
    assert "RecursionError" in reason


def test_a_non_finite_number_in_the_body_is_refused():
    with pytest.raises(ProtocolError, match="not finite"):
        decode(_raw_header(_PLAIN, lambda s: s.replace('\\"a\\":1', '\\"a\\":1e999')))


# ----------------------------------------------------------------------------- delta broadcasts

def _delta_mutation(rng: random.Random, wire: dict[str, torch.Tensor], body: dict[str, Any]
                    ) -> tuple[str, dict[str, torch.Tensor], dict[str, Any]]:
    """A delta message's tensors or body made wrong in one way (or left intact): the kind it travels as, too."""
    wire, body, kind = dict(wire), dict(body), "delta"
    name = rng.choice(sorted(wire))
    what = rng.randrange(11)
    if what == 0:
        del wire[name]
    elif what == 1:
        wire["extra"] = torch.zeros(3, dtype=torch.int8)
    elif what == 2:
        wire[name] = wire[name].to(rng.choice([torch.float32, torch.float16, torch.int16, torch.uint8]))
    elif what == 3:
        wire[name] = torch.zeros(*[d + rng.choice([-1, 1, 2]) for d in wire[name].shape] or [2],
                                 dtype=wire[name].dtype).clamp(min=0)
    elif what == 4 and name.endswith(":scale"):
        wire[name] = torch.full_like(wire[name], rng.choice([-1.0, float("nan"), float("inf"), 3e38]))
    elif what == 5:
        wire[name] = torch.randint(-128, 128, wire[name].shape, dtype=torch.int8) if wire[name].dtype == torch.int8 \
            else wire[name] * rng.choice([0.0, 2.0, 1e30])
    elif what == 6:
        body["codec"] = rng.choice(["fp16", "fp32", "topk:0.5+int8", "bf16", "int8:stochastic", "nonsense", 7])
    elif what == 7:
        body[rng.choice(["base", "result"])] = rng.choice(["0" * 64, "xyz", None, 1])
    elif what == 8:
        del body[rng.choice(sorted(body))]
    elif what == 9:
        kind = rng.choice(["model", "result", "status"])
    return kind, wire, body


def test_mutated_delta_broadcasts_rebuild_exactly_or_fall_back():
    """A device rebuilding a model from a delta its task names (whatever the delta holds) either gets the exact
    model the task's digest names or refuses the delta and fetches the full broadcast; it never raises."""
    from edge_client.device_protocol import DeviceProtocol
    from edge_client.wire.model_delta import apply_delta, encode_delta, model_digest
    from edge_client.wire.protocol import Topics

    topics, rng = Topics(), random.Random(20260102)
    g = torch.Generator().manual_seed(5)
    base = {"conv.weight": torch.randn(4, 3, 3, 3, generator=g), "conv.bias": torch.randn(4, generator=g),
            "fc.weight": torch.randn(10, 12, generator=g)}
    target = {n: t + 0.1 * torch.randn(t.shape, generator=g) for n, t in base.items()}
    codec = parse_codec("int8")
    wire = encode_delta(target, base, codec)
    result = model_digest(apply_delta(base, wire, codec))
    body = {"codec": "int8", "base": model_digest(base), "result": result}
    full = encode("model", run_id="r", round=1, task_id="", sender="coordinator", body={"codec": "fp32"},
                  tensors=base)
    rebuilt_count = refused = 0
    for i in range(300):
        kind, tensors, fields = _delta_mutation(rng, wire, body) if i else ("delta", wire, body)
        try:
            delta = encode(kind, run_id="r", round=2, task_id="", sender="coordinator", body=fields, tensors=tensors)
        except ProtocolError:
            continue
        device = DeviceProtocol("dev", topics)
        device.handle(topics.coordinator_status, encode("status", run_id="r", round=1, task_id="",
                                                        sender="coordinator", body={"state": "running"}), 0.0)
        first = {"objective": "train", "model": {}, "up": [], "timeout": 20, "model_digest": model_digest(base),
                 "broadcast": hashlib.sha256(full).hexdigest()}
        device.handle(topics.client("dev", "task"), encode("task", run_id="r", round=1, task_id=f"a{i}",
                                                            sender="coordinator", body=first), 0.0)
        assert device.handle(topics.model, full, 0.0).run
        second = {**first, "broadcast": "f" * 64, "model_digest": result, "delta_base": model_digest(base),
                  "delta_broadcast": hashlib.sha256(delta).hexdigest()}
        out = device.handle(topics.client("dev", "task"), encode("task", run_id="r", round=2, task_id=f"b{i}",
                                                                  sender="coordinator", body=second), 0.0)
        assert out.subscribe == [(topics.model_delta, True)]
        out = device.handle(topics.model_delta, delta, 0.0)
        if out.run:
            rebuilt_count += 1
            got, _ = device.broadcasts.get("f" * 64)
            assert model_digest(got) == result and out.run[0].model_from == "delta"
        else:
            refused += 1
            assert out.subscribe == [(topics.model, True)] and out.run == []
    assert rebuilt_count >= 1 and refused > 200
