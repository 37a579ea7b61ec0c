"""clients.tasks.sgd.SGD is torch.optim.SGD's update bit for bit (the default loop's optimizer)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from clients.tasks.sgd import SGD


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3), nn.Linear(3, 3))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_same_weights_as_torch_optim_sgd_after_many_steps(momentum):
    ours, theirs = _model(), _model()
    theirs.load_state_dict(ours.state_dict())
    frozen = [m[3].weight for m in (ours, theirs)]  # one parameter gets no gradient on some steps
    opt_ours = SGD(ours.parameters(), lr=0.05, momentum=momentum)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=momentum)
    gen = torch.Generator().manual_seed(1)
    for step in range(12):
        x, y = torch.randn(32, 8, generator=gen), torch.randint(0, 3, (32,), generator=gen)
        for model, opt, last in ((ours, opt_ours, frozen[0]), (theirs, opt_theirs, frozen[1])):
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            if step % 3 == 1:
                last.grad = None
            opt.step()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)


def test_no_gradient_no_step_and_zero_grad_keeps_tensors_when_asked():
    p = nn.Parameter(torch.ones(3))
    opt = SGD([p], lr=1.0, momentum=0.9)
    opt.step()
    assert torch.equal(p, torch.ones(3)) and opt.buffers == [None]
    p.grad = torch.ones(3)
    opt.step()
    opt.zero_grad(set_to_none=False)
    assert torch.equal(p.detach(), torch.zeros(3)) and torch.equal(p.grad, torch.zeros(3))


def test_a_sparse_gradient_with_momentum_keeps_a_dense_buffer_and_torchs_values():
    """torch's sparse momentum buffer takes each step's rows uncoalesced: 1,500 steps on a 5,000-row table took
    15 s against 0.3 s dense (a review). Ours is dense from its first step, with the same values to rounding."""
    torch.manual_seed(0)
    ours, theirs = nn.Embedding(300, 8, sparse=True), nn.Embedding(300, 8, sparse=True)
    theirs.load_state_dict(ours.state_dict())
    opt_ours, opt_theirs = SGD(ours.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(theirs.parameters(), lr=0.1,
                                                                                       momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    for _ in range(40):
        idx = torch.randint(0, 300, (16,), generator=gen)
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad(set_to_none=True)
            model(idx).pow(2).sum().backward()
            opt.step()
    assert not opt_ours.buffers[0].is_sparse
    torch.testing.assert_close(ours.weight, theirs.weight, rtol=1e-5, atol=1e-6)
