"""The device's SGD and Adam: torch's own update rules, without ``torch.optim.Optimizer``.

The first ``torch.optim.Optimizer`` a process builds imports ``torch._dynamo``: about 820
more modules and 72 MB more RSS (219 to 291 MB with torch 2.13 on x86-64), and over a second
on a 2-core machine, several on a Raspberry Pi. A device trains with plain SGD and has no
use for the compiler, so it calls the functional update ``torch.optim.sgd.sgd`` (the
function ``torch.optim.SGD.step`` calls) on momentum buffers it keeps itself: the same
arithmetic, the same result to the bit, none of that import. A method's auxiliary networks
(critics that estimate mutual information, for one) train with Adam the same way
(``torch.optim.adam.adam`` on moments and step counts kept here).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim.adam import adam
from torch.optim.sgd import sgd

__all__ = ["DeviceSGD", "DeviceAdam"]


class _DeviceOptimizer:
    """What both optimizers share: their parameters, and which of them have a gradient this step."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.params = list(params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _live(self) -> list[int]:
        """Indices of the parameters with a gradient: torch's optimizers leave the others (and their state) alone."""
        return [i for i, p in enumerate(self.params) if p.grad is not None]


class DeviceSGD(_DeviceOptimizer):
    """SGD with momentum and weight decay over ``params``, as ``torch.optim.SGD`` with the same arguments."""

    def __init__(self, params: Iterable[torch.nn.Parameter], *, lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self._buffers: list[torch.Tensor | None] = [None] * len(self.params)

    @torch.no_grad()
    def step(self) -> None:
        live = self._live()
        buffers = [self._buffers[i] for i in live]
        sgd([self.params[i] for i in live], [self.params[i].grad for i in live], buffers,
            weight_decay=self.weight_decay, momentum=self.momentum, lr=self.lr, dampening=0.0, nesterov=False,
            maximize=False)
        for i, buffer in zip(live, buffers):   # sgd creates a parameter's buffer on its first step
            self._buffers[i] = buffer


class DeviceAdam(_DeviceOptimizer):
    """Adam over ``params`` (no weight decay, no AMSGrad), as ``torch.optim.Adam`` with the same arguments."""

    def __init__(self, params: Iterable[torch.nn.Parameter], *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        super().__init__(params)
        self.lr, self.betas, self.eps = lr, betas, eps
        # per parameter, created at its first step as torch.optim.Adam does: (step, first moment, second moment)
        self._state: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * len(self.params)

    @torch.no_grad()
    def step(self) -> None:
        live = self._live()
        for i in live:
            if self._state[i] is None:
                p = self.params[i]
                self._state[i] = (torch.tensor(0.0, dtype=torch.get_default_dtype()),
                                  torch.zeros_like(p, memory_format=torch.preserve_format),
                                  torch.zeros_like(p, memory_format=torch.preserve_format))
        states = [self._state[i] for i in live]
        adam([self.params[i] for i in live], [self.params[i].grad for i in live], [s[1] for s in states],
             [s[2] for s in states], [], [s[0] for s in states], amsgrad=False, beta1=self.betas[0],
             beta2=self.betas[1], lr=self.lr, weight_decay=0.0, eps=self.eps, maximize=False)
