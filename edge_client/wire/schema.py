"""The wire protocol as JSON Schema, generated from the declarations the encoders and decoders use.

Every message is one safetensors buffer whose metadata holds a JSON header (``envelope.encode``); the header's
``body`` is one kind's body dataclass (``bodies.py``, ``worker_bodies.py``), whose fields and their comments
are the declaration. ``docs/protocol.schema.json`` is this module's output, and a test fails when it differs
from the code, so another implementation can be written against the published file.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from edge_client.wire.bodies import ModelBody, PresenceBody, ResultBody, StatusBody, TaskBody, UploadSettings
from edge_client.wire.codec import CodecSpec
from edge_client.wire.envelope import DEFAULT_MAX_MESSAGE_BYTES, KINDS, PROTOCOL_VERSION
from edge_client.wire.worker_bodies import ManifestBody, PartialBody
from storage.declarations import key_comments

__all__ = ["BODIES", "protocol_schema"]

# Each message kind's body; a kind without one here fails the test that every kind is published.
BODIES: dict[str, type] = {"presence": PresenceBody, "task": TaskBody, "result": ResultBody, "status": StatusBody,
                           "model": ModelBody, "manifest": ManifestBody, "partial": PartialBody}

_SIMPLE = {int: "integer", float: "number", str: "string", bool: "boolean"}


def protocol_schema() -> dict[str, Any]:
    """The header every message carries, and one body schema per kind (``$defs``)."""
    missing = [kind for kind in KINDS if kind not in BODIES]
    if missing:
        raise TypeError(f"message kinds {missing} have no body declaration in edge_client.wire.schema.BODIES")
    defs = {f"{kind}_body": _object(cls) for kind, cls in BODIES.items()}
    defs["upload_settings"] = _object(UploadSettings)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"fedge wire protocol, version {PROTOCOL_VERSION}",
        "description": "The JSON header in the metadata key 'fedge' of each message's safetensors buffer; the "
                       "buffer's tensors are the message's tensors. A message may be zstd- or lz4-compressed as a "
                       f"whole (its codec), and at most {DEFAULT_MAX_MESSAGE_BYTES} bytes unless the run says more.",
        "type": "object",
        "required": ["v", "kind", "run_id", "round", "task_id", "sender", "body"],
        "additionalProperties": False,
        "properties": {
            "v": {"const": PROTOCOL_VERSION},
            "kind": {"enum": list(KINDS)},
            "run_id": {"type": "string"},
            "round": {"type": "integer", "minimum": 0},
            "task_id": {"type": "string"},
            "sender": {"type": "string"},
            "body": {"type": "object", "description": "the kind's body: $defs/KIND_body"},
        },
        "$defs": defs,
    }


def _object(cls: type) -> dict[str, Any]:
    comments = key_comments(cls)
    hints = typing.get_type_hints(cls)
    properties, required = {}, []
    for f in dataclasses.fields(cls):
        schema = _type(hints[f.name])
        if comments.get(f.name):
            schema["description"] = comments[f.name]
        properties[f.name] = schema
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
            required.append(f.name)
    return {"type": "object", "properties": properties, "required": required,
            "description": (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")}


def _type(hint: Any) -> dict[str, Any]:
    """A JSON Schema for a field's annotation, as ``to_body`` writes it."""
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [_type(a) for a in args if a is not type(None)]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return {"anyOf": [schema, {"type": "null"}]} if type(None) in args else schema
    if hint in _SIMPLE:
        return {"type": _SIMPLE[hint]}
    if hint is CodecSpec:
        return {"type": "string", "description": "a codec spec, e.g. fp32, int8, topk:0.1+int8+zstd"}
    if hint is UploadSettings:
        return {"$ref": "#/$defs/upload_settings"}
    if origin in (tuple, list):
        return {"type": "array", "items": _type(args[0]) if args else {}}
    if origin is dict or hint is dict:
        return {"type": "object", "additionalProperties": _type(args[1]) if len(args) == 2 and args[1] is not Any
                else {}}
    return {}
