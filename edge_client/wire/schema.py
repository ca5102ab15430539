"""The wire protocol as JSON Schema, generated from the declarations the encoders and decoders use.

Every message is one safetensors buffer whose metadata holds a JSON header (``envelope.encode``); the header's
``body`` is one kind's body dataclass (``bodies.py``, ``worker_bodies.py``), whose fields are declared with
:func:`edge_client.wire.body_fields.wire`: each one's type, range or values, default and when it is left out
come from that declaration, its description from the comment beside it. ``docs/protocol.schema.json`` is this
module's output, and a test fails when it differs from the code, so another implementation can be written
against the published file.
"""

from __future__ import annotations

from typing import Any

from edge_client.wire.bodies import (DeltaBody, ModelBody, PresenceBody, ResultBody, StatusBody, TaskBody,
                                     UploadSettings)
from edge_client.wire.body_fields import REQUIRED, Body, rules
from edge_client.wire.envelope import (DEFAULT_MAX_MESSAGE_BYTES, HEADER, KINDS, MAX_HEADER_BYTES, PROTOCOL_VERSION,
                                       TENSOR_DTYPES)
from edge_client.wire.worker_bodies import ClaimBody, ManifestBody, PartialBody
from storage.declarations import key_comments

__all__ = ["BODIES", "PARTS", "protocol_schema", "body_schema"]

# Each message kind's body; a kind without one here fails the test that every kind is published.
BODIES: dict[str, type[Body]] = {"presence": PresenceBody, "task": TaskBody, "result": ResultBody,
                                 "status": StatusBody, "model": ModelBody, "manifest": ManifestBody,
                                 "partial": PartialBody, "delta": DeltaBody}
# Objects inside or added to a body: a task's ``upload``, and what a worker adds to the result it claims.
PARTS: dict[str, type[Body]] = {"upload_settings": UploadSettings, "claim_fields": ClaimBody}


def protocol_schema() -> dict[str, Any]:
    """The header every message carries, and one body schema per kind (``$defs``)."""
    missing = [kind for kind in KINDS if kind not in BODIES or not BODIES[kind].TENSORS]
    if missing:
        raise TypeError(f"message kinds {missing} have no body declaration (with its TENSORS) in "
                        "edge_client.wire.schema.BODIES")
    defs = {f"{kind}_body": {**body_schema(cls), "x-tensors": cls.TENSORS} for kind, cls in BODIES.items()}
    defs.update({name: body_schema(cls) for name, cls in PARTS.items()})
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"fedge wire protocol, version {PROTOCOL_VERSION}",
        "description": "The JSON header in the metadata key 'fedge' of each message's safetensors buffer; the "
                       "buffer's tensors are the message's tensors. A message may be zstd- or lz4-compressed as a "
                       f"whole (its codec), and at most {DEFAULT_MAX_MESSAGE_BYTES} bytes unless the run says more.",
        "x-limits": {"max_message_bytes": DEFAULT_MAX_MESSAGE_BYTES, "max_header_bytes": MAX_HEADER_BYTES,
                     "tensor_dtypes": list(TENSOR_DTYPES), "floating_point_tensors": "finite"},
        "type": "object",
        "required": ["v", "kind", *HEADER],
        "additionalProperties": False,
        "properties": {
            "v": {"const": PROTOCOL_VERSION},
            "kind": {"enum": list(KINDS)},
            **{name: dict(check.schema) for name, check in HEADER.items()},
            "body": {**HEADER["body"].schema, "description": "the kind's body: $defs/KIND_body"},
        },
        "allOf": [{"if": {"properties": {"kind": {"const": kind}}},
                   "then": {"properties": {"body": {"$ref": f"#/$defs/{kind}_body"}}}} for kind in BODIES],
        "$defs": defs,
    }


def body_schema(cls: type[Body]) -> dict[str, Any]:
    """One body's object schema. Fields that belong to the body only without (``unless``) or only with
    (``only_with``) another key go in the ``else`` or ``then`` of an ``if`` on that key."""
    comments = key_comments(cls)
    top: dict[str, Any] = {"properties": {}, "required": []}
    branches: dict[str, dict[str, dict[str, Any]]] = {}
    for name, rule in rules(cls).items():
        schema = dict(rule.check.schema)
        if comments.get(name):
            schema["description"] = comments[name]
        absent = rule.absent_value() if rule.absent is not REQUIRED else None
        if absent is not None:
            schema["default"] = rule.check.dump(absent)
        switch = rule.unless or rule.only_with
        if switch is None:
            part = top
        else:
            branch = branches.setdefault(switch, {"then": {"properties": {}, "required": []},
                                                  "else": {"properties": {}, "required": []}})
            part = branch["then" if rule.only_with else "else"]
        part["properties"][name] = schema
        if rule.absent is REQUIRED:
            part["required"].append(name)
    out = {"type": "object", **top,
           "description": (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")}
    if branches:
        out["allOf"] = [{"if": {"required": [switch]}, **branch} for switch, branch in branches.items()]
    return out
