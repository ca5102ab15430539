"""What makes a result usable: its tensors decoded back to values, checked, and accepted by the strategy.

The coordinator runs this on every result it takes itself; an aggregation worker runs
the same on its share, so both accept and refuse exactly the same results.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from coordinator.strategies.base import ClientResult, Strategy, TaskPlan
from edge_client.wire.codec import CodecSpec
from edge_client.wire.protocol import Message, ProtocolError, ResultBody, check_tensors
from edge_client.wire.updates import decode_parts

__all__ = ["accept_result", "one_torch_thread"]


def accept_result(plan: TaskPlan, msg: Message, body: ResultBody, shapes: Mapping[str, tuple[int, ...]],
                  codec: CodecSpec, strategy: Strategy, spec: dict[str, Any]) -> ClientResult:
    """The result of ``plan`` that ``msg`` carries; ProtocolError with the reason when it cannot be used.

    ``shapes``: the network's tensor shapes (what ``plan.up`` names must have unless ``plan.expect``
    says otherwise); ``codec``: the upload codec the task asked for (its dtype is the values' dtype);
    ``spec``: the model spec the task ran, for the strategy's own check.
    """
    if body.error is not None:
        raise ProtocolError(f"client could not run the task: {body.error}")
    expect = plan.expect if plan.expect is not None else {k: shapes[k] for k in plan.up}
    values, deltas = decode_parts(msg.tensors, body, expect, plan.down)
    check_tensors({**values, **deltas}, expect, codec.dtype)   # float64 for fp64 statistics
    if plan.update == "delta":   # a sent parameter answered with its value is an update all the same
        for name in [k for k in values if k in plan.down]:
            value = values.pop(name)
            deltas[name] = value - plan.down[name].to(value.dtype)
    result = ClientResult(plan.client_id, body.num_samples, values, dict(body.metrics), deltas, plan.down)
    problem = strategy.check_result(plan, result, spec)
    if problem:
        raise ProtocolError(problem)
    return result


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run the block on one intra-op thread (this thread only; others keep their own count).

    Checking and folding a result are many small element-wise ops: torch's thread pool makes
    each cost 10 to 30 times more CPU on a busy 2-core coordinator (28.6 ms against 1.7 ms to
    fold a 1.7 MB model) while devices, broker and the evaluation want the same cores.
    """
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
