"""The published wire protocol (docs/protocol.schema.json) is the code's: generated from the body declarations,
every message kind has one, and what the encoders write fits it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from edge_client.wire.bodies import ModelBody, PresenceBody, ResultBody, StatusBody, TaskBody, UploadSettings
from edge_client.wire.codec import parse_codec
from edge_client.wire.envelope import KINDS, decode, encode
from edge_client.wire.schema import BODIES, protocol_schema
from edge_client.wire.worker_bodies import ManifestBody, PartialBody

SCHEMA = Path(__file__).resolve().parent.parent / "docs" / "protocol.schema.json"

SAMPLES = {
    "presence": PresenceBody(state="online", num_samples=12, input_shape=(1, 8, 8), num_classes=10),
    "task": TaskBody(objective="train", model={"name": "mlp"}, up=("w",), hyper={"lr": 0.1},
                     upload=UploadSettings(codec=parse_codec("int8"), update="delta", clip_norm=1.0),
                     broadcast="a" * 64, deadline=1.5e9, session="ab12"),
    "result": ResultBody(num_samples=3, metrics={"train_loss": 0.5}, delta=("w",), profile={"seconds": 1.0}),
    "status": StatusBody(state="rejected", task_id="t1", reason="too large"),
    "model": ModelBody(),
    "manifest": ManifestBody(exchange="e", phase="train", model={"name": "mlp"}, up=("w",), codec=parse_codec("fp32"),
                             tasks={"c1": "t1"}, broadcast="b" * 64, clip_norm=1.0),
    "partial": PartialBody(exchange="e", weight=3.0, tasks=("t1",)),
}
FAILED = ResultBody(error="no data", refusal="app", withdrawn=True)


def _check(value: Any, schema: dict, root: dict, path: str) -> None:
    """The subset of JSON Schema the generated file uses: type, const, enum, anyOf, $ref, items, properties."""
    if "$ref" in schema:
        return _check(value, root["$defs"][schema["$ref"].rsplit("/", 1)[1]], root, path)
    if "anyOf" in schema:
        errors = []
        for option in schema["anyOf"]:
            try:
                return _check(value, option, root, path)
            except AssertionError as exc:
                errors.append(str(exc))
        raise AssertionError(f"{path}: {value!r} fits none of {errors}")
    if "const" in schema:
        assert value == schema["const"], path
    if "enum" in schema:
        assert value in schema["enum"], path
    kind = schema.get("type")
    python = {"integer": int, "number": (int, float), "string": str, "boolean": bool, "array": list,
              "object": dict, "null": type(None)}
    if kind:
        assert isinstance(value, python[kind]) and not (kind in ("integer", "number") and isinstance(value, bool)), \
            f"{path}: {value!r} is not {kind}"
    if kind == "array":
        for i, item in enumerate(value):
            _check(item, schema.get("items", {}), root, f"{path}[{i}]")
    if kind == "object":
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            assert key in value, f"{path}: {key} missing"
        for key, item in value.items():
            if key in props:
                _check(item, props[key], root, f"{path}.{key}")
            else:
                extra = schema.get("additionalProperties", {} if not props else False)
                assert extra is not False, f"{path}: {key} is not declared"
                _check(item, extra, root, f"{path}.{key}")


def test_the_published_schema_is_generated_from_the_code():
    assert json.loads(SCHEMA.read_text()) == protocol_schema(), \
        "docs/protocol.schema.json is stale: python -c 'import json; from edge_client.wire.schema import " \
        "protocol_schema; print(json.dumps(protocol_schema(), indent=2))' > docs/protocol.schema.json"


def test_every_kind_is_declared():
    assert sorted(BODIES) == sorted(KINDS)


@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_what_the_encoder_writes_fits_the_published_schema(kind):
    schema = protocol_schema()
    wire = encode(kind, run_id="r", round=1, task_id="t1", sender="c1", body=SAMPLES[kind].to_body(),
                  tensors={"w": torch.zeros(2)})
    message = decode(wire)
    header = {"v": schema["properties"]["v"]["const"], "kind": message.kind, "run_id": message.run_id,
              "round": message.round, "task_id": message.task_id, "sender": message.sender, "body": message.body}
    _check(header, schema, schema, "header")
    _check(message.body, schema["$defs"][f"{kind}_body"], schema, kind)
    if kind == "result":
        _check(FAILED.to_body(), schema["$defs"]["result_body"], schema, "failed result")
