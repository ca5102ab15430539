"""What a result carries: the client's update as a difference or as raw values, encoded.

The task says how to answer (``upload``: codec, ``delta`` or ``raw``, error
feedback). A tensor the client received in the task (or its broadcast) goes back
as the difference between its trained value and the received one, so a lossy
codec only blurs the change, never the weights; anything else (statistics an
objective computes, parameters the task did not send) goes back as raw values,
dense. With a lossy codec and error feedback on, what encoding dropped from a
difference (its residual) is kept on the device and added to the next update, so
over rounds nothing is lost for good. The residuals live in the client's state
directory and survive restarts.

Both sides use this module: the client encodes (:func:`encode_upload`), the
coordinator decodes a result into its values and its differences
(:func:`decode_parts`), so strategies average updates and never see the codec;
:func:`decode_upload` adds each difference back to the exact tensor sent, for
whoever wants parameters.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from edge_client.privacy import add_noise, clip_update, fresh_generator
from edge_client.wire.codec import CodecError, CodecSpec, all_finite, decode_tensors, encode_tensors
from edge_client.wire.errors import ProtocolError
from edge_client.wire.protocol import UPDATES, ResultBody, UploadSettings
from storage.files import write_tensors_atomic

# UPDATES and UploadSettings (the task's ``upload``) are defined with the other bodies
# in the protocol module; they are part of this module's interface too.
__all__ = ["UPDATES", "UploadSettings", "ResidualStore", "encode_upload", "encode_clipped_upload", "decode_parts",
           "decode_upload", "encode_download", "decode_download"]

log = logging.getLogger("fedge.updates")
RESIDUAL_FILE = "residual.safetensors"
_BEFORE = "before/"   # in RESIDUAL_FILE: the residuals the last task started from


@dataclass
class ResidualStore:
    """Error-feedback residuals of one run, by tensor name, saved atomically in ``directory``; also a codec's
    per-tensor state (``lowrank``'s warm-start Q, as ``NAME:q``), which follows the same runs and resumes.

    A residual from another run (or with another shape) is meaningless and dropped.
    Without a directory the residuals live in memory only.

    The residuals before the last task are kept too (``before``), with that task's name: a
    coordinator resumed from its last checkpoint sends the round in flight again, and the device
    then adds what it had dropped before that round, not what it dropped from an upload the
    coordinator never aggregated (which would also make a resumed run differ from an unbroken one).
    """

    directory: Path | None
    run_id: str = ""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    task: str = ""                # the last task that used the residuals ("round:seed")
    before: dict[str, torch.Tensor] = field(default_factory=dict)   # the residuals that task started from
    _loaded: bool = False

    def for_run(self, run_id: str, task: str = "") -> dict[str, torch.Tensor]:
        """The residuals a task of ``run_id`` adds to its update (the caller updates them in place);
        ``task`` names it, so that the same task sent again starts from the same residuals."""
        if not self._loaded:
            self._load()
        if run_id != self.run_id:
            self.run_id, self.tensors, self.task, self.before = run_id, {}, "", {}
        if task and task == self.task:
            self.tensors = dict(self.before)
        else:
            self.task, self.before = task, dict(self.tensors)
        return self.tensors

    def _load(self) -> None:
        self._loaded = True
        path = self.directory / RESIDUAL_FILE if self.directory else None
        if path is None or not path.is_file():
            return
        try:
            with safe_open(str(path), framework="pt") as fh:
                meta = json.loads((fh.metadata() or {}).get("fedge", "{}"))
                saved = {k: fh.get_tensor(k).to(torch.float32) for k in fh.keys()}
            self.run_id, self.task = str(meta.get("run_id", "")), str(meta.get("task", ""))
            self.tensors = {k: v for k, v in saved.items() if not k.startswith(_BEFORE)}
            self.before = {k[len(_BEFORE):]: v for k, v in saved.items() if k.startswith(_BEFORE)}
        except (SafetensorError, OSError, ValueError) as exc:
            log.warning("ignored unreadable error-feedback residuals in %s: %s", path, exc)
            self.tensors, self.before, self.task = {}, {}, ""

    def save(self) -> None:
        if self.directory is None:
            return
        write_tensors_atomic(self.directory / RESIDUAL_FILE,
                             {**self.tensors, **{_BEFORE + k: v for k, v in self.before.items()}},
                             {"fedge": json.dumps({"run_id": self.run_id, "task": self.task})})


def encode_upload(tensors: Mapping[str, torch.Tensor], received: Mapping[str, torch.Tensor],
                  settings: UploadSettings, residuals: ResidualStore, run_id: str, *,
                  raw_only: bool = False, generator: torch.Generator | None = None
                  ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Wire tensors for ``tensors`` in ``settings.codec``, and the names sent as differences.

    The result's body names the codec (``settings.codec``) and the differences (``delta``).
    ``received``: what the task sent down, the reference of each difference.
    ``raw_only``: the tensors are not model parameters (an objective's statistics).
    With ``settings.clip_norm`` the differences are clipped (:func:`encode_clipped_upload`).
    """
    wire, delta, _ = encode_clipped_upload(tensors, received, settings, residuals, run_id, raw_only=raw_only,
                                           generator=generator)
    return wire, delta


def encode_clipped_upload(tensors: Mapping[str, torch.Tensor], received: Mapping[str, torch.Tensor],
                          settings: UploadSettings, residuals: ResidualStore, run_id: str, *,
                          raw_only: bool = False, generator: torch.Generator | None = None,
                          task: str = ""
                          ) -> tuple[dict[str, torch.Tensor], list[str], bool]:
    """:func:`encode_upload`, and whether the differences were clipped to ``settings.clip_norm``.

    The error-feedback residual is added before clipping, so what a round sends (its own update and
    what earlier codecs dropped) is within the clip norm: the bound differential privacy needs holds per
    round. What clipping removes is dropped, not carried; only what the codec drops becomes the next
    residual (docs/privacy.md). With ``settings.noise_multiplier`` (local differential privacy) the
    clipped update gets the device's Gaussian noise before the codec, which then only post-processes
    a private release; whether it was clipped is returned all the same, and the caller must not send it.
    ``task`` names the task (its round and seed) for the error-feedback residuals (:class:`ResidualStore`).
    """
    spec = settings.codec
    delta = [] if raw_only or settings.update == "raw" else sorted(n for n in tensors if n in received)
    values = {n: t.detach().to(spec.dtype) for n, t in tensors.items()}
    for name in delta:
        values[name] = values[name] - received[name]
    feedback = settings.error_feedback and spec.lossy and bool(delta)
    stateful = spec.transform == "lowrank" and bool(delta)   # its warm-start Q lives with the residuals
    stored = residuals.for_run(run_id, task) if feedback or stateful else {}
    if feedback:
        for name in delta:
            old = stored.get(name)
            if old is not None and old.shape == values[name].shape:
                values[name] = values[name] + old
    clipped = False
    if settings.noise_multiplier is not None and sorted(values) != delta:
        raise ProtocolError("a task with upload.noise_multiplier (local differential privacy) must ask for "
                            "differences of the tensors it sent only: nothing leaves the device without noise")
    if settings.clip_norm is not None and delta:
        bounded, clipped = clip_update({name: values[name] for name in delta}, settings.clip_norm)
        if settings.noise_multiplier is not None:   # from the OS's entropy: never the task's seed, which is public
            bounded = add_noise(bounded, settings.noise_multiplier * settings.clip_norm, fresh_generator())
        values.update(bounded)
    wire = encode_tensors(values, spec, sparse=delta, generator=generator, state=stored if stateful else None)
    if feedback:
        sent = decode_tensors(wire, spec, {n: tuple(v.shape) for n, v in values.items()}, sparse=delta)
        for name in delta:   # each difference let go as its residual is made: the update is not held three times
            stored[name] = values.pop(name) - sent.pop(name)
    if feedback or stateful:
        residuals.save()
    return wire, delta, clipped


def decode_parts(wire: Mapping[str, torch.Tensor], body: ResultBody,
                 expected: Mapping[str, tuple[int, ...]], sent: Mapping[str, torch.Tensor]
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A result as (values, differences): the tensors that came as values, and the differences
    from the exact tensors ``sent`` (kept as differences, so a server optimizer steps on the update the
    device computed, not on a parameter rebuilt from it). A difference whose sum with what was sent is
    not finite is refused here, as a value would be."""
    stray = sorted(set(body.delta) - (set(expected) & set(sent)))
    if stray:
        raise CodecError(f"differences declared for tensors the task did not send: {stray[:5]}")
    values = decode_tensors(wire, body.codec, expected, sparse=body.delta)
    deltas = {name: values.pop(name) for name in body.delta}
    for name, delta in deltas.items():
        if not all_finite(sent[name].to(torch.float32) + delta):
            raise CodecError(f"tensor {name!r} is not finite after adding its difference")
    return values, deltas


def decode_upload(wire: Mapping[str, torch.Tensor], body: ResultBody,
                  expected: Mapping[str, tuple[int, ...]], sent: Mapping[str, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
    """Float32 values of a result: differences are added back to the exact tensors ``sent``."""
    values, deltas = decode_parts(wire, body, expected, sent)
    return {**values, **{name: sent[name].to(torch.float32) + d for name, d in deltas.items()}}


def encode_download(tensors: Mapping[str, torch.Tensor], spec: CodecSpec, *,
                    generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Wire tensors of what a task or broadcast sends down: dense, in ``spec.dense()``, the body's ``codec``."""
    return encode_tensors(tensors, spec.dense(), generator=generator)


def decode_download(wire: Mapping[str, torch.Tensor], codec: CodecSpec,
                    shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Float32 tensors of a task or model broadcast (dense, any subset of ``shapes``) in its body's ``codec``."""
    return decode_tensors(wire, codec.dense(), shapes, exact=False)
