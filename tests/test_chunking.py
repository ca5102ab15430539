"""Chunking: reassembly out of order, duplicates, losses, tampering, bounds and caps, retained chunked messages,
and a cost per chunk that stays flat however many incomplete messages are held."""

from __future__ import annotations

import os
import random
import time

import pytest

from edge_client.wire.chunking import (DEFAULT_PARTIAL_BYTES, DEFAULT_PARTIAL_MESSAGES, HEADER_BYTES, Assembled,
                                       ChunkingTransport, Reassembler, read_header, split)
from edge_client.wire.transport import InprocHub, MessageTooLarge


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _feed_all(r: Reassembler, sender: str, chunks):
    out = []
    for c in chunks:
        out += r.feed(sender, c)
    return out


def test_shuffled_and_duplicated_chunks_reassemble_once():
    payload = os.urandom(50_000)
    chunks = split(payload, 4096)
    assert len(chunks) == -(-50_000 // (4096 - HEADER_BYTES)) and all(len(c) <= 4096 for c in chunks)
    mixed = chunks + chunks[3:7] + chunks[:1]
    random.Random(0).shuffle(mixed)
    r = Reassembler(max_message_bytes=1 << 20)
    out = _feed_all(r, "a", mixed)
    whole = [o for o in out if o.payload]
    assert len(whole) == 1 and whole[0].payload == payload and not any(o.error for o in out)
    assert whole[0].wire_bytes == sum(len(c) for c in chunks)
    assert r.held == 0
    late = r.feed("a", chunks[2])        # a redelivery after completion: bytes only, no error, no message
    assert len(late) == 1 and not late[0].payload and not late[0].error


def test_interleaved_messages_from_two_senders():
    a, b = os.urandom(20_000), os.urandom(30_000)
    ca, cb = split(a, 2048), split(b, 2048)
    r = Reassembler(max_message_bytes=1 << 20)
    out = []
    for i in range(max(len(ca), len(cb))):
        out += r.feed("a", ca[i]) if i < len(ca) else []
        out += r.feed("b", cb[i]) if i < len(cb) else []
    assert {o.sender: o.payload for o in out} == {"a": a, "b": b}


def test_missing_chunk_times_out_with_a_reason():
    clock = Clock()
    chunks = split(os.urandom(10_000), 2048)
    r = Reassembler(max_message_bytes=1 << 20, timeout=30, clock=clock)
    assert _feed_all(r, "a", chunks[:2] + chunks[3:]) == []
    clock.now = 29
    assert r.expire() == []
    clock.now = 31
    (lost,) = r.expire()
    assert lost.error.startswith("incomplete after 30 s") and f"got {len(chunks) - 1} of {len(chunks)}" in lost.error
    assert not lost.payload and lost.wire_bytes == sum(len(c) for i, c in enumerate(chunks) if i != 2)
    assert r.held == 0


def test_tampered_chunk_fails_the_hash():
    chunks = split(os.urandom(10_000), 2048)
    bad = bytearray(chunks[1])
    bad[HEADER_BYTES + 100] ^= 1
    out = _feed_all(Reassembler(max_message_bytes=1 << 20), "a", [chunks[0], bytes(bad), *chunks[2:]])
    assert len(out) == 1 and "SHA-256" in out[0].error and not out[0].payload


def test_oversize_and_malformed_chunks_are_rejected():
    r = Reassembler(max_message_bytes=5_000)
    chunks = split(os.urandom(10_000), 2048)
    (first,) = r.feed("a", chunks[0])
    assert "exceeds the limit of 5000" in first.error
    assert [o.error for o in _feed_all(r, "a", chunks[1:])] == [""] * (len(chunks) - 1)   # rest ignored quietly
    assert "not a chunk" in r.feed("a", b"FDC1short")[0].error
    header = bytearray(split(b"x" * 100, 1024)[0])
    header[24:28] = (7).to_bytes(4, "little")      # index 7 of a 1-chunk message
    assert "does not fit" in r.feed("a", bytes(header))[0].error


def test_chunks_that_disagree_about_their_message_are_refused():
    payload = os.urandom(6000)
    chunks = split(payload, 2048)
    other = bytearray(chunks[1])
    other[28:32] = (len(chunks) + 1).to_bytes(4, "little")   # a different count under the same id
    r = Reassembler(max_message_bytes=1 << 20)
    out = _feed_all(r, "a", [chunks[0], bytes(other)])
    assert len(out) == 1 and "disagrees" in out[0].error
    assert _feed_all(r, "a", chunks[1:])[0].payload == payload


def test_memory_for_incomplete_messages_is_bounded_per_sender_and_in_total():
    r = Reassembler(max_message_bytes=40_000, per_sender_bytes=40_000, total_bytes=50_000)
    one, two = split(os.urandom(30_000), 4096), split(os.urandom(30_000), 4096)
    out = _feed_all(r, "a", one[:-1]) + _feed_all(r, "a", two[:-1])
    assert len(out) == 1 and "holds more than 40000 bytes" in out[0].error      # a's older message went
    assert r.held <= 40_000
    three = split(os.urandom(30_000), 4096)
    out = _feed_all(r, "b", three[:-1])
    assert len(out) == 1 and "exceed 50000 bytes in total" in out[0].error      # the oldest overall went
    assert r.held <= 50_000
    assert _feed_all(r, "b", three[-1:])[0].payload


def test_transport_chunks_large_messages_and_passes_small_ones():
    hub = InprocHub()
    a = ChunkingTransport(hub.connect("a"), max_message_bytes=4096, max_decoded_bytes=1 << 20)
    b = ChunkingTransport(hub.connect("b"), max_message_bytes=4096, max_decoded_bytes=1 << 20)
    b.subscribe("t/x")
    big, small = os.urandom(20_000), os.urandom(100)
    assert a.publish("t/x", big) > len(big) and a.publish("t/x", small) == len(small)
    got = [b.get(1.0), b.get(1.0)]
    assert [g.payload for g in got] == [big, small] and got[1].wire_bytes == 100
    off = ChunkingTransport(hub.connect("c"), max_message_bytes=4096, max_decoded_bytes=1 << 20, chunking=False)
    with pytest.raises(MessageTooLarge, match="chunking is off"):
        off.publish("t/x", big)


def test_retained_chunked_message_reaches_late_subscribers_and_is_replaced_cleanly():
    hub = InprocHub()
    pub = ChunkingTransport(hub.connect("pub"), max_message_bytes=4096, max_decoded_bytes=1 << 20)
    first, second, third = os.urandom(30_000), os.urandom(10_000), os.urandom(500)
    pub.publish("p/model", first, retain=True)

    def fetch() -> list[bytes]:
        sub = ChunkingTransport(hub.connect(), max_message_bytes=4096, max_decoded_bytes=1 << 20)
        sub.subscribe("p/model", parts=True)
        got = []
        while (item := sub.get(0.2)) is not None:
            assert not item.error
            if item.payload:
                got.append(item.payload)
        return got

    assert fetch() == [first]
    parts = len(split(first, 4096))
    assert set(hub._retained) == {f"p/model/{i}" for i in range(parts)}
    assert all(read_header(hub._retained[f"p/model/{i}"]).part_topic for i in range(parts))
    pub.publish("p/model", second, retain=True)    # fewer chunks: the stale higher parts are cleared
    assert fetch() == [second] and len(hub._retained) == len(split(second, 4096))
    pub.publish("p/model", third, retain=True)     # fits one message: all parts are cleared
    assert fetch() == [third]
    assert set(hub._retained) == {"p/model"}         # no stale chunk is left retained on the broker


def test_a_retained_chunk_on_the_wrong_part_topic_is_refused():
    hub = InprocHub()
    sub = ChunkingTransport(hub.connect("sub"), max_message_bytes=4096, max_decoded_bytes=1 << 20)
    sub.subscribe("p/model", parts=True)
    chunks = split(os.urandom(10_000), 4096, part_topic=True)
    raw = hub.connect("raw")
    raw.publish("p/model/1", chunks[0])          # chunk 0 posing as part 1
    item = sub.get(1.0)
    assert item is not None and "arrived on p/model/1" in item.error and not item.payload


def test_total_memory_cap_evicts_the_oldest_across_senders_and_counts_evictions():
    r = Reassembler(max_message_bytes=20_000, total_bytes=50_000)
    messages = {s: split(os.urandom(15_000), 4096) for s in "abcde"}
    out = []
    for s, chunks in messages.items():           # 3 of 4 chunks (about 12 KB) from each of five senders
        out += _feed_all(r, s, chunks[:-1])
        assert r.held <= 50_000
    assert [o.sender for o in out] == ["a"] and "exceed 50000 bytes in total" in out[0].error
    assert r.evicted == 1 and r.partial_messages == 4
    late = _feed_all(r, "a", messages["a"][-1:])     # a late chunk of an evicted message: ignored quietly
    assert late == [Assembled("a", wire_bytes=len(messages["a"][-1]))]
    dropped, done = _feed_all(r, "e", messages["e"][-1:])    # e's last chunk needs room: b, now the oldest, goes
    assert dropped.sender == "b" and "in total" in dropped.error and done.payload and r.evicted == 2


def test_count_cap_evicts_the_oldest_incomplete_messages():
    r = Reassembler(max_message_bytes=1 << 20, max_partial_messages=3)
    messages = [split(os.urandom(5_000), 2048) for _ in range(5)]
    out = []
    for i, chunks in enumerate(messages):
        out += r.feed(f"s{i}", chunks[0])
    assert [o.sender for o in out] == ["s0", "s1"] and all("more than 3 incomplete messages" in o.error for o in out)
    assert r.partial_messages == 3 and r.evicted == 2
    for i in (2, 3, 4):
        assert _feed_all(r, f"s{i}", messages[i][1:])[-1].payload
    assert r.partial_messages == 0 and r.held == 0


def test_empty_first_chunks_cannot_pile_up():
    r = Reassembler(max_message_bytes=1 << 20, max_partial_messages=100)
    for _ in range(1000):      # header only: no data, so only the count cap stops them
        r.feed("flood", split(os.urandom(10_000), 1024)[0][:HEADER_BYTES])
    assert r.partial_messages == 100 and r.evicted == 900 and r.held == 0


def test_a_message_larger_than_the_byte_bounds_is_refused_without_evicting_others():
    r = Reassembler(max_message_bytes=100_000, per_sender_bytes=30_000, total_bytes=40_000)
    small = split(os.urandom(10_000), 4096)
    assert _feed_all(r, "a", small[:-1]) == []
    big = split(os.urandom(35_000), 4096)
    (refused,) = r.feed("b", big[0])
    assert "cannot be reassembled" in refused.error and "raise" in refused.error
    assert r.evicted == 0 and _feed_all(r, "b", big[1:]) == [Assembled("b", wire_bytes=len(c)) for c in big[1:]]
    assert _feed_all(r, "a", small[-1:])[0].payload


def test_every_fed_byte_is_reported_exactly_once():
    clock = Clock()
    r = Reassembler(max_message_bytes=30_000, per_sender_bytes=25_000, total_bytes=40_000,
                    max_partial_messages=4, timeout=10, clock=clock)
    rng = random.Random(1)
    fed, reported = 0, 0
    chunks = [(f"s{rng.randrange(3)}", c) for _ in range(12) for c in split(os.urandom(rng.randrange(1, 28_000)), 3000)]
    chunks += rng.sample(chunks, 10)
    rng.shuffle(chunks)
    for sender, c in chunks:
        fed += len(c)
        reported += sum(o.wire_bytes for o in r.feed(sender, c))
    clock.now = 11
    reported += sum(o.wire_bytes for o in r.expire())
    assert reported == fed and r.held == 0 and r.partial_messages == 0


def test_transport_caps_partial_memory_by_default_and_on_request():
    hub = InprocHub()
    t = ChunkingTransport(hub.connect("a"), max_decoded_bytes=1 << 20)
    assert t.reassembler.total_bytes == DEFAULT_PARTIAL_BYTES
    assert t.reassembler.max_partial_messages == DEFAULT_PARTIAL_MESSAGES
    big = ChunkingTransport(hub.connect("b"), max_decoded_bytes=DEFAULT_PARTIAL_BYTES * 2)
    assert big.reassembler.total_bytes == DEFAULT_PARTIAL_BYTES * 2     # the largest message must still fit
    small = ChunkingTransport(hub.connect("c"), max_message_bytes=4096, max_decoded_bytes=20_000,
                              max_partial_bytes=30_000, max_partial_messages=2)
    assert small.reassembler.total_bytes == 30_000 and small.reassembler.max_partial_messages == 2
    with pytest.raises(ValueError, match="raise max_partial_bytes"):
        ChunkingTransport(hub.connect("d"), max_decoded_bytes=1 << 20, max_partial_bytes=1 << 19)
    small.subscribe("t/+")
    raw = hub.connect("raw")
    for i in range(3):
        raw.publish(f"t/{i}", split(os.urandom(10_000), 4096)[0])
    item = small.get(1.0)
    assert item is not None and item.topic == "t/0" and "more than 2 incomplete messages" in item.error
    assert small.reassembler.evicted == 1


def _per_chunk_seconds(held: int, probes: int = 400) -> float:
    """Best-of-five time per chunk fed (and one expiry pass) while ``held`` messages stay incomplete."""
    r = Reassembler(max_message_bytes=1 << 20, total_bytes=1 << 34, max_partial_messages=held + 10 * probes)
    payload = os.urandom(3000)
    first = split(payload, 2048)[0]
    for i in range(held):                # same data, new message id each time: no split per message
        head = bytearray(first)
        head[8:24] = i.to_bytes(16, "little")
        r.feed(f"s{i % 100}", bytes(head))
    best = float("inf")
    for _ in range(5):
        messages = [split(payload, 2048) for _ in range(probes)]
        start = time.perf_counter()
        for i, (a, b) in enumerate(messages):
            r.feed(f"s{i % 100}", a)
            r.feed(f"s{i % 100}", b)
        r.expire()
        best = min(best, (time.perf_counter() - start) / (2 * probes))
    assert r.partial_messages == held
    return best


def test_cost_per_chunk_does_not_grow_with_the_incomplete_messages_held():
    few, many = _per_chunk_seconds(100), _per_chunk_seconds(30_000)
    assert many < 3 * few, f"{many * 1e6:.1f} us per chunk with 30000 held vs {few * 1e6:.1f} us with 100"
