"""A device's side of a secure round: its SecAgg+ state between the four stages, for one round at a time.

The training task (stage ``advertise``) leaves the device with its update vector and its key pairs;
the next three tasks of the same round take the state one step further each
(:mod:`edge_client.secagg.protocol` refuses a step run twice or out of order). Only the newest
round's state is kept: a newer advertise replaces it, the unmask answer ends it, and a stage task of
any other round (a replay, a stale task) is refused, so a device never masks two inputs from one set
of masks nor holds an update longer than its round.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from edge_client.privacy import clip_update
from edge_client.secagg import ClientState, RefusedError, advertise, masked_input, share, unmask
from edge_client.secagg.errors import MessageError
from edge_client.secagg.stages import StageReply, StageTask, update_vector

__all__ = ["SecureRounds", "secure_vector"]


def secure_vector(stage: StageTask, trained: Mapping[str, torch.Tensor], received: Mapping[str, torch.Tensor],
                  names: list[str], num_samples: int, loss: float, clip_norm: float | None) -> np.ndarray:
    """The vector this device masks: its update (trained minus received, over ``names``), clipped to
    ``clip_norm`` first under central DP (the same :func:`clip_update` as a plain upload), weighted, with the
    tail :func:`update_vector` adds. Its length must be the round's: else the sum could not be split."""
    missing = [n for n in names if n not in received or n not in trained]
    if missing:
        raise MessageError(f"a secure round sums updates of tensors the task sent; it asks for {missing[:3]}, "
                           "which it did not send")
    deltas = {n: trained[n].detach().to(torch.float64).cpu() - received[n].to(torch.float64).cpu() for n in names}
    clipped = False
    if clip_norm is not None:
        deltas, clipped = clip_update(deltas, clip_norm)
    vector = update_vector([deltas[n].numpy() for n in names], stage.weight(num_samples), loss, clipped,
                           stage.params.clip)
    if len(vector) != stage.params.length:
        raise MessageError(f"this device's update has {len(vector)} entries, the round's length is "
                           f"{stage.params.length}: the task's model and the round's parameters disagree")
    return vector


class SecureRounds:
    """The secure round in progress on this device, keyed by (run id, round)."""

    def __init__(self) -> None:
        self._key: tuple[str, int] | None = None
        self._state: ClientState | None = None
        self._vector: np.ndarray | None = None
        self.num_samples = 0

    def advertise(self, key: tuple[str, int], stage: StageTask, vector: np.ndarray, num_samples: int) -> StageReply:
        """Start a round (dropping any older one): fresh key pairs, and the vector kept until ``mask``."""
        self.discard()
        state, message = advertise(stage.params, stage.client)
        self._key, self._state, self._vector, self.num_samples = key, state, vector, num_samples
        return StageReply("advertise", message)

    def answer(self, key: tuple[str, int], stage: StageTask) -> StageReply:
        """The answer to a ``share``, ``mask`` or ``unmask`` task of the round in progress; RefusedError for
        any other round, MessageError for parameters that are not the round's."""
        state = self._state
        if state is None or key != self._key:
            raise RefusedError(f"a {stage.stage} task of run {key[0]} round {key[1]}, but this device holds no "
                               "secure round of it (a replayed or stale task, or one whose training task never "
                               "came here)")
        if stage.params != state.params or stage.client != state.client_id:
            raise MessageError(f"the {stage.stage} task's round parameters or device id differ from its training "
                               "task's: refused")
        if stage.stage == "share":
            state, message = share(state, stage.message)
        elif stage.stage == "mask":
            state, message = masked_input(state, stage.message, self._vector)
            self._vector = None   # masked once: the plain update is no longer needed
        else:
            state, message = unmask(state, stage.message)
        self._state = state
        if stage.stage == "unmask":
            self.discard()   # the round is over for this device
        return StageReply(stage.stage, message)

    def discard(self) -> None:
        self._key = self._state = self._vector = None
