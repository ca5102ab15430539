"""Delta broadcasts (codec.down_delta): the coordinator's tracked reference, a device rebuilding it, and the
fallbacks to the full broadcast. No broker, no training: the coordinator's Downlink makes the messages and a
DeviceProtocol takes them, the clock passed in."""

from __future__ import annotations

import hashlib

import pytest
import torch

from coordinator.config import load_config
from coordinator.runtime.downlink import Downlink
from coordinator.runtime.model_reference import ModelReference
from edge_client.device_protocol import BroadcastCache, DeviceProtocol
from edge_client.wire.codec import CodecError, parse_codec
from edge_client.wire.model_delta import apply_delta, encode_delta, model_digest
from edge_client.wire.protocol import TaskBody, Topics, decode, encode

T = Topics()
ME = "dev1"
SHAPES = {"conv.weight": (8, 3, 3, 3), "conv.bias": (8,), "fc.weight": (10, 32)}


def walk(rounds: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """A global model over ``rounds`` rounds: a start, then a random step each round (training's stand-in)."""
    g = torch.Generator().manual_seed(seed)
    model = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    out = []
    for _ in range(rounds):
        model = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in model.items()}
        out.append(model)
    return out


def step_size(wire: dict[str, torch.Tensor], name: str) -> float:
    """The largest int8 quantization step of one tensor's delta (its per-channel scales)."""
    return float(wire[name + ":scale"].max())


@pytest.mark.parametrize("spec", ["int8", "int8+zstd", "topk:0.5+int8", "int8:stochastic"])
def test_coordinator_and_device_hold_the_same_bits_and_the_error_does_not_accumulate(spec):
    codec = parse_codec(spec)
    reference = ModelReference(codec)
    device: dict[str, torch.Tensor] | None = None
    for round, target in enumerate(walk(12), start=1):
        step = reference.step(target, torch.Generator().manual_seed(round))
        if step.delta is None:   # the first broadcast: the model itself
            assert round == 1
            device = {n: t.clone() for n, t in step.model.items()}
        else:
            assert device is not None and step.base == model_digest(device)
            device = apply_delta(device, step.delta, codec)
        assert all(torch.equal(device[n], step.model[n]) for n in SHAPES)          # bit for bit
        assert model_digest(device) == step.digest
        if step.delta is not None and codec.topk is None:
            for name in SHAPES:   # within one quantization step of the true model, every round: nothing piles up
                gap = float((device[name] - target[name]).abs().max())
                assert gap <= step_size(step.delta, name) * (1.0 if codec.stochastic else 0.5) + 1e-6


def test_without_the_reference_the_error_would_pile_up():
    """What the reference prevents: deltas between successive global models, each quantized on its own."""
    codec = parse_codec("int8")
    models = walk(30, seed=1)
    naive = {n: t.clone() for n, t in models[0].items()}
    reference = ModelReference(codec)
    reference.step(models[0])
    for before, after in zip(models, models[1:]):
        naive = apply_delta(naive, encode_delta(after, before, codec), codec)
        tracked = reference.step(after).model
    last = models[-1]
    naive_gap = max(float((naive[n] - last[n]).abs().max()) for n in SHAPES)
    tracked_gap = max(float((tracked[n] - last[n]).abs().max()) for n in SHAPES)
    assert tracked_gap < naive_gap / 3


def test_a_retried_attempt_gets_the_same_step_and_a_new_layout_goes_full_only():
    reference = ModelReference(parse_codec("int8"))
    a, b = walk(2)
    reference.step(a)
    first = reference.step(b)
    assert reference.step({n: t.clone() for n, t in b.items()}) is first   # same model: no second advance
    grown = {**b, "fc.weight": torch.zeros(12, 32)}
    full = reference.step(grown)
    assert full.delta is None and full.base is None and torch.equal(full.model["fc.weight"], grown["fc.weight"])


def test_apply_delta_checks_names_shapes_dtypes_and_finiteness():
    codec = parse_codec("int8")
    base, target = walk(2)
    wire = encode_delta(target, base, codec)
    with pytest.raises(CodecError, match="missing"):
        apply_delta(base, {k: v for k, v in wire.items() if not k.startswith("conv.bias")}, codec)
    with pytest.raises(CodecError, match="unexpected"):
        apply_delta(base, {**wire, "extra": torch.zeros(2, dtype=torch.int8)}, codec)
    with pytest.raises(CodecError, match="shape"):
        apply_delta({**base, "fc.weight": torch.zeros(10, 31)}, wire, codec)
    with pytest.raises(CodecError, match="int8"):
        apply_delta(base, {**wire, "fc.weight": wire["fc.weight"].to(torch.float32)}, codec)
    with pytest.raises(CodecError, match="scales"):
        apply_delta(base, {**wire, "fc.weight:scale": torch.full((10,), float("inf"))}, codec)
    with pytest.raises(CodecError, match="not finite"):
        apply_delta({**base, "fc.weight": torch.full((10, 32), 3e38)}, {**wire, "fc.weight": torch.full(
            (10, 32), 127, dtype=torch.int8), "fc.weight:scale": torch.full((10,), 3e38 / 127)}, codec)
    with pytest.raises(CodecError, match="float32"):
        apply_delta({n: t.double() for n, t in base.items()}, wire, codec)


# --- the device's side, with the coordinator's messages ---------------------------------------------------------

class Coordinator:
    """The coordinator's downlink with delta broadcasts, and the tasks it would send."""

    def __init__(self, spec: str = "int8+zstd") -> None:
        config = load_config(None, [("codec", "down_delta", spec), ("run", "seed", 3)])
        self.downlink = Downlink(config, "live")
        self.round = 0

    def broadcast(self, model: dict[str, torch.Tensor]):
        self.round += 1
        return self.downlink.broadcast(self.round, model)

    def task(self, task_id: str, messages, *, offer_delta: bool = True) -> bytes:
        fields = {"model_digest": messages.model_digest}
        if offer_delta and messages.delta_digest is not None:
            fields.update(delta_broadcast=messages.delta_digest, delta_base=messages.base)
        body = TaskBody(objective="train", model={"name": "mlp"}, up=tuple(SHAPES), broadcast=messages.digest,
                        timeout=20, resend_every=2, **fields)
        return encode("task", run_id="live", round=self.round, task_id=task_id, sender="coordinator",
                      body=body.to_body())


class Device:
    def __init__(self, cache: BroadcastCache | None = None) -> None:
        self.cache = cache if cache is not None else BroadcastCache()
        self.p = DeviceProtocol(ME, T, self.cache)
        self.now = 100.0
        self.p.handle(T.coordinator_status, encode("status", run_id="live", round=1, task_id="", sender="coordinator",
                                                   body={"state": "running"}), self.now)

    def take(self, coordinator: Coordinator, messages, task_id: str, **options: object) -> tuple[str | None, list]:
        """Give the device a task of ``messages``, then whatever it subscribes to; how it came by the model and
        the topics it subscribed to."""
        out = self.p.handle(T.client(ME, "task"), coordinator.task(task_id, messages, **options), self.now)
        topics = [t for t, _ in out.subscribe]
        pending = list(topics)
        while not out.run and pending:
            topic = pending.pop(0)
            payload = messages.delta_payload if topic == T.model_delta else messages.payload
            out = self.p.handle(topic, payload, self.now)
            new = [t for t, _ in out.subscribe]
            topics += new
            pending += new
        assert [t.msg.task_id for t in out.run] == [task_id]
        return out.run[0].model_from, topics

    def model(self, messages) -> dict[str, torch.Tensor]:
        wire, codec = self.cache.get(messages.digest)
        assert codec.text == "fp32"
        return wire


def test_a_device_rebuilds_each_round_from_deltas_and_holds_the_coordinators_reference():
    c, d = Coordinator(), Device()
    for round, target in enumerate(walk(6), start=1):
        messages = c.broadcast(target)
        got, topics = d.take(c, messages, f"t{round}")
        assert (got, topics) == (("full", [T.model]) if round == 1 else ("delta", [T.model_delta]))
        held = d.model(messages)
        reference = c.downlink.reference.current
        assert all(torch.equal(held[n], reference.model[n]) for n in SHAPES)
        assert model_digest(held) == messages.model_digest
    assert len(messages.delta_payload) * 2 < len(messages.payload)   # a tiny model: the header weighs


def test_a_device_without_the_base_takes_the_full_broadcast_then_deltas():
    c = Coordinator()
    models = walk(5)
    for target in models[:3]:
        messages = c.broadcast(target)
    late = Device()   # new, restarted, or it missed rounds: it holds nothing
    assert late.take(c, messages, "t3") == ("no_base", [T.model])
    messages = c.broadcast(models[3])
    assert late.take(c, messages, "t4") == ("delta", [T.model_delta])


def test_a_stale_base_falls_back_to_the_full_broadcast():
    c, d = Coordinator(), Device()
    models = walk(4)
    d.take(c, c.broadcast(models[0]), "t1")
    c.broadcast(models[1])                  # the device was not selected in round 2
    messages = c.broadcast(models[2])       # a delta from round 2's model, which the device never had
    assert d.take(c, messages, "t3") == ("no_base", [T.model])
    assert torch.equal(d.model(messages)["fc.weight"], c.downlink.reference.current.model["fc.weight"])


def test_a_delta_whose_rebuilt_digest_differs_falls_back_to_the_full_broadcast():
    c, d = Coordinator(), Device()
    models = walk(3)
    first = c.broadcast(models[0])
    d.take(c, first, "t1")
    messages = c.broadcast(models[1])
    # The device's copy of round 1's model has drifted by one bit (a corrupt store): the rebuilt model's digest is
    # not the task's, so the device must not train on it.
    held = d.model(first)
    held["conv.bias"][0] = torch.nextafter(held["conv.bias"][0], torch.tensor(1e9))
    got, topics = d.take(c, messages, "t2")
    assert (got, topics) == ("bad_delta", [T.model_delta, T.model])
    assert model_digest(d.model(messages)) == messages.model_digest   # what it trains on is the full model


def test_a_refused_delta_message_falls_back_and_an_unoffered_delta_is_not_fetched():
    c, d = Coordinator(), Device()
    models = walk(3)
    d.take(c, c.broadcast(models[0]), "t1")
    messages = c.broadcast(models[1])
    out = d.p.handle(T.client(ME, "task"), c.task("t2", messages), d.now)
    assert out.subscribe == [(T.model_delta, True)]
    # a message on the delta topic that is not the delta the task names: ignored, the wait goes on
    assert d.p.handle(T.model_delta, b"junk", d.now).run == []
    # an old coordinator's task (no delta offered) fetches the full broadcast only
    assert Device().take(c, messages, "t3", offer_delta=False) == ("full", [T.model])


def test_a_delta_naming_other_digests_than_its_task_is_refused():
    c, d = Coordinator(), Device()
    models = walk(3)
    d.take(c, c.broadcast(models[0]), "t1")
    messages = c.broadcast(models[1])
    forged = encode("delta", run_id="live", round=2, task_id="", sender="coordinator",
                    body={"codec": "int8", "base": messages.base, "result": "0" * 64},
                    tensors=c.downlink.reference.current.delta)
    body = TaskBody(objective="train", model={"name": "mlp"}, up=tuple(SHAPES), broadcast=messages.digest,
                    timeout=20, model_digest=messages.model_digest, delta_broadcast=hashlib.sha256(forged).hexdigest(),
                    delta_base=messages.base)
    d.p.handle(T.client(ME, "task"), encode("task", run_id="live", round=2, task_id="t2", sender="coordinator",
                                            body=body.to_body()), d.now)
    out = d.p.handle(T.model_delta, forged, d.now)
    assert out.run == [] and out.subscribe == [(T.model, True)] and "failed its checks" in out.notes[0].text
    assert [t.model_from for t in d.p.handle(T.model, messages.payload, d.now).run] == ["bad_delta"]


def test_an_old_device_reads_the_task_without_the_new_fields():
    c = Coordinator()
    c.broadcast(walk(2)[0])
    messages = c.broadcast(walk(2)[1])
    body = decode(c.task("t2", messages)).body
    assert {"model_digest", "delta_broadcast", "delta_base"} <= set(body)
    # a reader declaring fewer fields (an older device) ignores keys it does not know: the same parse without them
    old = {k: v for k, v in body.items() if k not in ("model_digest", "delta_broadcast", "delta_base")}
    assert TaskBody.from_body({**old, "a_future_field": 1}).broadcast == messages.digest
