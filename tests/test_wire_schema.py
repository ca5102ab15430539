"""The published wire protocol (docs/protocol.schema.json) is the code's: generated from the body declarations,
every message kind has one, what the encoders write fits it, and it refuses what the decoders refuse."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from edge_client.wire.bodies import ModelBody, PresenceBody, ResultBody, StatusBody, TaskBody, UploadSettings
from edge_client.wire.body_fields import rules
from edge_client.wire.codec import parse_codec
from edge_client.wire.envelope import KINDS, decode, encode
from edge_client.wire.errors import ProtocolError
from edge_client.wire.schema import BODIES, PARTS, protocol_schema
from edge_client.wire.worker_bodies import ClaimBody, ManifestBody, PartialBody

try:   # the reference validator when it is installed; else the subset below, which is all the file uses
    import jsonschema
except ImportError:
    jsonschema = None

SCHEMA = Path(__file__).resolve().parent.parent / "docs" / "protocol.schema.json"

# (kind, body): every kind with its optional fields, and without them.
SAMPLES = [
    ("presence", PresenceBody(state="online", num_samples=12, input_shape=(1, 8, 8), num_classes=10,
                              device={"cpu": "x"})),
    ("presence", PresenceBody(state="offline")),
    ("task", TaskBody(objective="train", model={"name": "mlp"}, up=("w",), hyper={"lr": 0.1},
                      upload=UploadSettings(codec=parse_codec("int8"), update="delta", clip_norm=1.0,
                                            noise_multiplier=0.5),
                      broadcast="a" * 64, deadline=1.5e9, session="ab12", secagg={"stage": "advertise"})),
    ("task", TaskBody(objective="evaluate", model={"name": "mlp"}, up=())),
    ("result", ResultBody(num_samples=3, metrics={"train_loss": 0.5}, delta=("w",), profile={"seconds": 1.0},
                          codec=parse_codec("topk:0.1+int8+zstd"), secagg={"stage": "mask"})),
    ("result", ResultBody(num_samples=1)),
    ("result", ResultBody(error="no data", refusal="app", withdrawn=True)),
    ("result", ResultBody(error="no data")),
    ("status", StatusBody(state="rejected", task_id="t1", reason="too large")),
    ("status", StatusBody(state="running", session="ff00")),
    ("model", ModelBody()),
    ("model", ModelBody(parse_codec("bf16+lz4"))),
    ("manifest", ManifestBody(exchange="e", phase="train", model={"name": "mlp"}, up=("w",),
                              codec=parse_codec("fp32"), tasks={"t1": "c1"}, broadcast="b" * 64, clip_norm=1.0,
                              noise_multiplier=0.0, flush=True)),
    ("manifest", ManifestBody("e", "train", {"name": "mlp"}, ("w",), parse_codec("int8"), {})),
    ("partial", PartialBody(exchange="e", weight=3.0, tasks=("t1",))),
]
CLAIM = {**ResultBody(num_samples=2).to_body(), **ClaimBody("bad shapes", False, 1234).to_body()}


def _fails(value: Any, schema: dict, root: dict) -> str:
    """Why ``value`` does not fit ``schema`` ("" when it does)."""
    if jsonschema is not None:
        errors = list(jsonschema.Draft202012Validator({**schema, "$defs": root["$defs"]}).iter_errors(value))
        return "; ".join(e.message for e in errors)
    try:
        _check(value, schema, root, "$")
    except AssertionError as exc:
        return str(exc)
    return ""


_TYPES = {"integer": int, "number": (int, float), "string": str, "boolean": bool, "array": list, "object": dict,
          "null": type(None)}
_UNDERSTOOD = {"$schema", "title", "description", "default", "$defs", "$ref", "type", "const", "enum", "minimum",
               "exclusiveMinimum", "pattern", "minItems", "items", "properties", "required", "additionalProperties",
               "allOf", "if", "then", "else", "x-limits", "x-tensors"}


def _check(value: Any, schema: dict, root: dict, path: str) -> None:
    """The subset of JSON Schema 2020-12 the generated file uses (``test_the_validator_knows_every_keyword``)."""
    if "$ref" in schema:
        _check(value, root["$defs"][schema["$ref"].rsplit("/", 1)[1]], root, path)
    if "const" in schema:
        assert value == schema["const"], f"{path}: {value!r} is not {schema['const']!r}"
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} is not one of {schema['enum']}"
    kind = schema.get("type")
    if kind:
        assert isinstance(value, _TYPES[kind]) and not (kind in ("integer", "number") and isinstance(value, bool)), \
            f"{path}: {value!r} is not {kind}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        assert value >= schema.get("minimum", value), f"{path}: {value!r} < {schema['minimum']}"
        if "exclusiveMinimum" in schema:
            assert value > schema["exclusiveMinimum"], f"{path}: {value!r} <= {schema['exclusiveMinimum']}"
    if isinstance(value, str) and "pattern" in schema:
        assert re.search(schema["pattern"], value), f"{path}: {value!r} does not match {schema['pattern']}"
    if isinstance(value, list):
        assert len(value) >= schema.get("minItems", 0), f"{path}: fewer than {schema['minItems']} items"
        for i, item in enumerate(value):
            _check(item, schema.get("items", {}), root, f"{path}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            assert key in value, f"{path}: {key} missing"
        for key, item in value.items():
            if key in props:
                _check(item, props[key], root, f"{path}.{key}")
            elif "additionalProperties" in schema:
                extra = schema["additionalProperties"]
                assert extra is not False, f"{path}: {key} is not allowed"
                _check(item, extra, root, f"{path}.{key}")
    for part in schema.get("allOf", []):
        _check(value, part, root, path)
    if "if" in schema:
        try:
            _check(value, schema["if"], root, path)
        except AssertionError:
            _check(value, schema.get("else", {}), root, path)
        else:
            _check(value, schema.get("then", {}), root, path)


def _declared(schema: dict) -> set[str]:
    """Every key a body schema declares, in its properties or in those of its branches."""
    keys = set(schema.get("properties", {}))
    for part in schema.get("allOf", []):
        keys |= _declared(part.get("then", {})) | _declared(part.get("else", {}))
    return keys


def test_the_published_schema_is_generated_from_the_code():
    assert json.loads(SCHEMA.read_text()) == protocol_schema(), \
        "docs/protocol.schema.json is stale: python -c 'import json; from edge_client.wire.schema import " \
        "protocol_schema; print(json.dumps(protocol_schema(), indent=2))' > docs/protocol.schema.json"


def test_every_kind_is_declared_and_every_field_of_its_body():
    assert sorted(BODIES) == sorted(KINDS)
    assert all(cls.TENSORS for cls in BODIES.values()), "say which tensors each kind carries ('none' if none)"
    for cls in [*BODIES.values(), *PARTS.values()]:
        assert list(rules(cls)) == list(dict.fromkeys([*getattr(cls, "WIRE_ORDER", ()),
                                                       *(f.name for f in dataclasses.fields(cls))])), cls


def test_a_field_without_a_declaration_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Loose(PartialBody):
        note: str = ""

    with pytest.raises(TypeError, match=r"fields \['note'\] are not declared"):
        Loose(exchange="e", weight=1.0, tasks=("t",)).to_body()


def test_the_validator_knows_every_keyword():
    def keywords(node: Any) -> set[str]:
        if isinstance(node, list):
            return set().union(*map(keywords, node)) if node else set()
        if not isinstance(node, dict):
            return set()
        found = set()
        for key, item in node.items():
            if key in ("properties", "$defs"):
                found |= set().union(*map(keywords, item.values())) if item else set()
            elif key.startswith("x-") or key in ("const", "enum", "default", "required"):
                found |= {key}   # annotations and values, not schemas
            else:
                found |= {key} | keywords(item)
        return found

    assert keywords(protocol_schema()) <= _UNDERSTOOD


@pytest.mark.parametrize("kind,body", SAMPLES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(SAMPLES)])
def test_what_the_encoder_writes_fits_the_published_schema(kind, body):
    schema = json.loads(SCHEMA.read_text())
    wire = encode(kind, run_id="r", round=1, task_id="t1", sender="c1", body=body.to_body(),
                  tensors={"w": torch.zeros(2)})
    message = decode(wire)
    header = {"v": schema["properties"]["v"]["const"], "kind": message.kind, "run_id": message.run_id,
              "round": message.round, "task_id": message.task_id, "sender": message.sender, "body": message.body}
    assert _fails(header, schema, schema) == ""
    assert set(message.body) <= _declared(schema["$defs"][f"{kind}_body"]), "the encoder wrote an undeclared key"
    assert type(body).from_body(message.body) == body


def test_a_claim_fits_the_result_and_the_claim_schemas():
    schema = protocol_schema()
    assert _fails(CLAIM, schema["$defs"]["result_body"], schema) == ""
    assert _fails(CLAIM, schema["$defs"]["claim_fields"], schema) == ""
    assert set(CLAIM) <= _declared(schema["$defs"]["result_body"]) | _declared(schema["$defs"]["claim_fields"])


def test_the_schema_carries_the_ranges_enums_patterns_and_defaults():
    defs = protocol_schema()["$defs"]
    assert defs["result_body"]["allOf"][0]["else"]["properties"]["num_samples"]["minimum"] == 1
    assert defs["task_body"]["properties"]["timeout"] == {
        "type": "number", "exclusiveMinimum": 0, "default": 600.0,
        "description": defs["task_body"]["properties"]["timeout"]["description"]}
    assert defs["status_body"]["properties"]["state"]["enum"] == ["ack", "rejected", "closed", "running", "finished", "stopped"]
    assert defs["task_body"]["properties"]["session"]["pattern"] == "^[0-9a-f]{1,32}$"
    assert defs["upload_settings"]["properties"]["update"]["default"] == "delta"
    assert defs["upload_settings"]["properties"]["noise_multiplier"]["minimum"] == 0
    assert defs["manifest_body"]["required"] == ["exchange", "phase", "model", "up", "tasks"]


# JSON values each field is tried with: the schema must refuse exactly what the decoder refuses.
_TRIES = [None, True, False, -1, 0, 1, 2, 0.5, -0.5, "", "x", "online", "delta", "ack", "app", "a" * 64, "ab12",
          [], ["w"], [1], [-1], {}, {"a": 1}, {"a": "c1"}, {"a": "no id!"}]


@pytest.mark.parametrize("kind,body", SAMPLES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(SAMPLES)])
def test_the_schema_refuses_what_the_decoder_refuses(kind, body):
    schema = protocol_schema()
    cls, good = type(body), body.to_body()
    for name, rule in rules(cls).items():
        if "codec" in name:
            continue   # a codec spec's grammar is parse_codec's, not the schema's: any string fits the schema
        for value in [*_TRIES, ...]:
            tried = {k: v for k, v in good.items() if k != name} if value is ... else {**good, name: value}
            try:
                cls.from_body(tried)
                refused = ""
            except ProtocolError as exc:
                refused = str(exc)
            unfit = _fails(tried, schema["$defs"][f"{kind}_body"], schema)
            assert bool(refused) == bool(unfit), (name, value, refused or "decoder accepts", unfit or "schema fits")
            if refused:   # it names the field (another one when the key switched a result to failed or not)
                assert re.search(r"field '[\w.]+'", refused), refused


def test_the_upload_object_refuses_what_its_decoder_refuses():
    schema = protocol_schema()
    for name in rules(UploadSettings):
        if name == "codec":
            continue
        for value in _TRIES:
            tried = {"clip_norm": 1.0, name: value}
            try:
                UploadSettings.from_body(tried)
                refused = False
            except ProtocolError:
                refused = True
            assert refused == bool(_fails(tried, schema["$defs"]["upload_settings"], schema)), (name, value)


@pytest.mark.parametrize("key,value", [("round", "1"), ("round", True), ("sender", "a/b"), ("sender", 3),
                                       ("run_id", None), ("body", [])])
def test_the_schema_refuses_the_headers_the_decoder_refuses(key, value):
    schema = protocol_schema()
    header = {"v": 2, "kind": "status", "run_id": "r", "round": 1, "task_id": "t", "sender": "c1",
              "body": StatusBody("running").to_body()}
    assert _fails(header, schema, schema) == ""
    assert _fails({**header, key: value}, schema, schema)
