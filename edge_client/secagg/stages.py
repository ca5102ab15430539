"""Secure aggregation over fedge's tasks and results: the ``secagg`` object of a stage's task and result.

A secure round is four exchanges of ordinary tasks and results (docs/protocol.md): ``advertise``
(the training task; the device trains and answers with its public keys), ``share``, ``mask`` and
``unmask``. Each task's body carries :class:`StageTask` as its ``secagg`` object, each result's
body :class:`StageReply`; the masked words of the ``mask`` stage travel as one integer tensor
(:data:`MASKED_TENSOR`) beside the reply, not as base64 in the JSON header.

The vector a device masks is laid out here once (:func:`update_vector`, :func:`split_sum`), so
device and coordinator cannot disagree on it: the weighted update, then :data:`TAIL` entries
(the weight, the weighted training loss, the clipped bit), all within ``clip``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import torch

from edge_client.secagg import masking
from edge_client.secagg.errors import MessageError
from edge_client.secagg.messages import (Advertise, ForwardedShares, MaskedInput, PublicKeys, SecAggParams,
                                         ShareBundle, UnmaskRequest, UnmaskResponse)
from edge_client.wire.body_fields import Fields, is_int, is_number
from edge_client.wire.errors import ProtocolError

__all__ = ["STAGES", "MASKED_TENSOR", "TAIL", "LOSS_CAP", "StageTask", "StageReply", "update_vector", "split_sum",
           "SumParts"]

STAGES = ("advertise", "share", "mask", "unmask")
MASKED_TENSOR = "secagg.masked"
TAIL = 3            # the weight, the weighted training loss / LOSS_CAP, the clipped bit; each times clip
LOSS_CAP = 16.0     # a training loss above this counts as this in the round's loss (it must fit in [0, clip])

_ASKED = {"share": PublicKeys, "mask": ForwardedShares, "unmask": UnmaskRequest}
_ANSWERED = {"advertise": Advertise, "share": ShareBundle, "mask": MaskedInput, "unmask": UnmaskResponse}
Asked = Union[PublicKeys, ForwardedShares, UnmaskRequest]
Answered = Union[Advertise, ShareBundle, MaskedInput, UnmaskResponse]


def _stage(f: Fields) -> str:
    return f.get("stage", f"one of {', '.join(STAGES)}", lambda v: v in STAGES)


def _translate(read: Any) -> Any:
    """Run ``read`` with every refusal a MessageError (one type for every secure-aggregation refusal)."""
    try:
        return read()
    except MessageError:
        raise
    except ProtocolError as exc:
        raise MessageError(str(exc)) from None


@dataclass(frozen=True)
class StageTask:
    """A stage task's ``secagg`` object: the round's parameters, the device's id in it and what it is asked.

    ``weight_unit``: the device's weight in the sum is ``num_samples / weight_unit`` (at most 1 when it
    reports no more samples than it announced); 0 means every device weighs 1 (central DP).
    """

    stage: str
    params: SecAggParams
    client: int
    weight_unit: float
    message: Asked | None = None   # None for advertise

    @classmethod
    def from_body(cls, body: Any) -> StageTask:
        def read() -> StageTask:
            f = Fields("secagg task", body)
            stage = _stage(f)
            params = SecAggParams.from_body(f.get("params", "an object of round parameters", lambda v: True))
            client = f.get("client", f"this device's id in the round, 0..{params.num_clients - 1}",
                           lambda v: is_int(v) and 0 <= v < params.num_clients)
            unit = float(f.get("weight_unit", "a number >= 0", lambda v: is_number(v) and v >= 0))
            message = None
            if stage in _ASKED:
                message = _ASKED[stage].from_body(f.get("message", "an object", lambda v: True))
                if message.round_id != params.round_id:
                    raise MessageError(f"secagg task's message is for round {message.round_id}, its params for "
                                       f"{params.round_id}")
            elif "message" in f:
                raise MessageError("secagg task of stage 'advertise' carries no message")
            return cls(stage, params, client, unit, message)

        return _translate(read)

    def to_body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"stage": self.stage, "params": self.params.to_body(), "client": self.client,
                               "weight_unit": self.weight_unit}
        if self.message is not None:
            out["message"] = self.message.to_body()
        return out

    def weight(self, num_samples: int) -> float:
        """This device's weight: its share of the largest sample count, or 1 (central DP)."""
        return 1.0 if self.weight_unit == 0 else min(1.0, num_samples / self.weight_unit)


@dataclass(frozen=True)
class StageReply:
    """A stage result's ``secagg`` object and, for ``mask``, the tensor of masked words beside it."""

    stage: str
    message: Answered

    def wire(self, bits: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The body's ``secagg`` object and the result's tensors (``bits``: the round's, for the word size)."""
        if isinstance(self.message, MaskedInput):
            return ({"stage": self.stage, "message": self.message.header()},
                    {MASKED_TENSOR: _words_tensor(self.message.vector, bits)})
        return {"stage": self.stage, "message": self.message.to_body()}, {}

    @classmethod
    def from_body(cls, body: Any, stage: str, params: SecAggParams,
                  tensors: Mapping[str, torch.Tensor]) -> StageReply:
        """The reply to a task of ``stage``, checked: its stage, its message's fields and, for ``mask``, that
        exactly one tensor of ``params.length`` words in the dtype of ``params.bits`` came with it."""
        def read() -> StageReply:
            f = Fields("secagg result", body)
            got = _stage(f)
            if got != stage:
                raise MessageError(f"secagg result answers stage {got!r}, its task was stage {stage!r}")
            raw = f.get("message", "an object", lambda v: True)
            if stage != "mask":
                if tensors:
                    raise MessageError(f"a secagg {stage} result carries no tensors, got {sorted(tensors)[:3]}")
                return cls(stage, _ANSWERED[stage].from_body(raw))
            return cls(stage, MaskedInput.from_header(raw, _words(tensors, params)))

        return _translate(read)


def _signed(bits: int) -> np.dtype:
    """The envelope has no unsigned 32- or 64-bit type: words travel as the signed type of their size
    (the same bits)."""
    return np.dtype("<i4") if masking.word_dtype(bits).itemsize == 4 else np.dtype("<i8")


def _words_tensor(raw: bytes, bits: int) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(raw, dtype=_signed(bits)).copy())


def _words(tensors: Mapping[str, torch.Tensor], params: SecAggParams) -> bytes:
    if sorted(tensors) != [MASKED_TENSOR]:
        raise MessageError(f"a secagg mask result carries exactly the tensor {MASKED_TENSOR!r}, got "
                           f"{sorted(tensors)[:3]}")
    t = tensors[MASKED_TENSOR]
    want = torch.int32 if _signed(params.bits).itemsize == 4 else torch.int64
    if t.dtype != want or tuple(t.shape) != (params.length,):
        raise MessageError(f"{MASKED_TENSOR} must be {want} of shape ({params.length},), the round's words at "
                           f"{params.bits} bits, got {t.dtype} {tuple(t.shape)}")
    return t.contiguous().numpy().astype(_signed(params.bits), copy=False).tobytes()


def update_vector(deltas: Sequence[np.ndarray], weight: float, loss: float, clipped: bool, clip: float) -> np.ndarray:
    """What a device masks: its weighted update flattened in the given order, then the weight, the weighted
    loss (over :data:`LOSS_CAP`) and the clipped bit, each of the last three times ``clip`` so that all fit
    in [-clip, clip]. Summed over devices it holds every number the coordinator's aggregation needs."""
    loss = min(max(loss, 0.0), LOSS_CAP) if math.isfinite(loss) else LOSS_CAP
    tail = np.array([weight, weight * loss / LOSS_CAP, float(clipped)], dtype=np.float64) * clip
    return np.concatenate([*(weight * np.asarray(d, dtype=np.float64).ravel() for d in deltas), tail])


@dataclass(frozen=True)
class SumParts:
    """A summed vector taken apart: the weighted update's sums by tensor, the total weight, the
    weight-averaged training loss and the number of clipped updates."""

    sums: dict[str, torch.Tensor]
    weight: float
    loss: float
    clipped: int


def split_sum(values: np.ndarray, shapes: Sequence[tuple[str, tuple[int, ...]]], clip: float) -> SumParts:
    """Undo :func:`update_vector` on a sum of such vectors (float64)."""
    sums, offset = {}, 0
    for name, shape in shapes:
        size = math.prod(shape)
        sums[name] = torch.from_numpy(np.ascontiguousarray(values[offset:offset + size])).reshape(shape)
        offset += size
    if offset + TAIL != len(values):
        raise MessageError(f"a summed vector of {len(values)} entries does not hold {offset} update entries and "
                           f"{TAIL} more")
    weight, loss, clipped = (float(v) / clip for v in values[offset:])
    return SumParts(sums, weight, loss / weight * LOSS_CAP if weight > 0 else 0.0, max(0, round(clipped)))
