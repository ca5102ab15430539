"""The device's SGD: torch's own update rule, without ``torch.optim.Optimizer``.

The first ``torch.optim.Optimizer`` a process builds imports ``torch._dynamo``: about 820
more modules and 72 MB more RSS (219 to 291 MB with torch 2.13 on x86-64), and over a second
on a 2-core machine, several on a Raspberry Pi. A device trains with plain SGD and has no
use for the compiler, so it calls the functional update ``torch.optim.sgd.sgd`` (the
function ``torch.optim.SGD.step`` calls) on momentum buffers it keeps itself: the same
arithmetic, the same result to the bit, none of that import.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim.sgd import sgd

__all__ = ["DeviceSGD"]


class DeviceSGD:
    """SGD with momentum and weight decay over ``params``, as ``torch.optim.SGD`` with the same arguments."""

    def __init__(self, params: Iterable[torch.nn.Parameter], *, lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        self.params = list(params)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self._buffers: list[torch.Tensor | None] = [None] * len(self.params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        buffers = [self._buffers[i] for i in live]
        sgd([self.params[i] for i in live], [self.params[i].grad for i in live], buffers,
            weight_decay=self.weight_decay, momentum=self.momentum, lr=self.lr, dampening=0.0, nesterov=False,
            maximize=False)
        for i, buffer in zip(live, buffers):   # sgd creates a parameter's buffer on its first step
            self._buffers[i] = buffer
