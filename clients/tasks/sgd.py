"""Plain SGD with momentum: torch.optim.SGD's update (dampening 0, no Nesterov, no weight decay), bit for bit
(for a sparse gradient with momentum, to float rounding: its momentum buffer is dense here).

Why not torch.optim.SGD: its first step imports torch._dynamo (2 s and 71 MB in a fresh agent worker, which
never compiles), and its construction per client is a measurable part of a simulated client's overhead.
"""

from __future__ import annotations

import torch


class SGD:
    """``step()`` applies ``p -= lr * buf`` with ``buf = momentum * buf + grad`` (the first gradient on the
    first step), as torch.optim.SGD does; parameters without a gradient are left alone, as there."""

    def __init__(self, params, lr: float, momentum: float = 0.0) -> None:
        self.params, self.lr, self.momentum = list(params), float(lr), float(momentum)
        self.buffers: list[torch.Tensor | None] = [None] * len(self.params)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not live:
            return
        params = [self.params[i] for i in live]
        steps = [self.params[i].grad for i in live]
        if self.momentum:
            old = [j for j, i in enumerate(live) if self.buffers[i] is not None]
            if old:  # buf = momentum * buf + grad
                kept = [self.buffers[live[j]] for j in old]
                torch._foreach_mul_(kept, self.momentum)
                torch._foreach_add_(kept, [steps[j] for j in old])
            for j, i in enumerate(live):
                if self.buffers[i] is None:  # the first step: buf = grad (dense: a sparse buffer that
                    g = steps[j]  # takes each step's rows uncoalesced grows without bound, and slows every step)
                    self.buffers[i] = g.to_dense() if g.is_sparse else torch.clone(g).detach()
            steps = [self.buffers[i] for i in live]
        torch._foreach_add_(params, steps, alpha=-self.lr)
