"""The fedge wire protocol: topic layout, message kinds, the envelope and the typed bodies.

Every message is one safetensors buffer whose metadata holds a JSON header; decoding
checks the header before any tensor is materialized, and nothing is ever unpickled.
This module is the protocol's one import path; each part has its module:

- :mod:`edge_client.wire.topics`: the topic layout (:class:`Topics`) and :func:`valid_client_id`;
- :mod:`edge_client.wire.envelope`: :class:`Message`, :func:`encode`, :func:`decode` (its
  :class:`ContentError` keeps the header of a message whose content it refused) and :func:`check_tensors`;
- :mod:`edge_client.wire.bodies`: the bodies a device exchanges (:class:`PresenceBody`,
  :class:`TaskBody` with :class:`UploadSettings`, :class:`ResultBody`, :class:`StatusBody`,
  :class:`ModelBody`, :class:`DeltaBody`);
- :mod:`edge_client.wire.worker_bodies`: the aggregation workers' (:class:`ManifestBody`,
  :class:`ClaimBody`, :class:`PartialBody`);
- :mod:`edge_client.wire.body_fields`: how a body's fields are declared, checked, written and published
  (:mod:`edge_client.wire.schema` makes docs/protocol.schema.json from the declarations).

A message may travel compressed (:mod:`edge_client.wire.compression`) and in chunks
(:mod:`edge_client.wire.chunking`). ``docs/protocol.md`` describes the same thing for
people; keep both true.
"""

from __future__ import annotations

from edge_client.wire.bodies import (DEFAULT_RESEND_EVERY, DEFAULT_TASK_TIMEOUT, MODEL_FROM, PRESENCE_STATES,
                                     REFUSAL_APP, STATUS_STATES, UPDATES, DeltaBody, ModelBody, PresenceBody,
                                     ResultBody, StatusBody, TaskBody, UploadSettings)
from edge_client.wire.envelope import (DEFAULT_MAX_MESSAGE_BYTES, KINDS, PROTOCOL_VERSION, ContentError, Message,
                                       check_tensors, decode, encode)
from edge_client.wire.errors import ProtocolError
from edge_client.wire.topics import Topics, valid_client_id
from edge_client.wire.worker_bodies import ClaimBody, ManifestBody, PartialBody

__all__ = [
    "PROTOCOL_VERSION",
    "KINDS",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_TASK_TIMEOUT",
    "DEFAULT_RESEND_EVERY",
    "UPDATES",
    "PRESENCE_STATES",
    "STATUS_STATES",
    "REFUSAL_APP",
    "MODEL_FROM",
    "ProtocolError",
    "ContentError",
    "Message",
    "Topics",
    "UploadSettings",
    "PresenceBody",
    "TaskBody",
    "ResultBody",
    "StatusBody",
    "ModelBody",
    "DeltaBody",
    "ManifestBody",
    "ClaimBody",
    "PartialBody",
    "encode",
    "decode",
    "check_tensors",
    "valid_client_id",
]
