"""The activation offload's saved-tensor hooks: what they keep on the device must not tie a graph to itself.

A forward that dies before its backward (an OOM in a capped probe, an OOM the train stage recovers from) drops its
graph; every tensor the hooks kept, and the layers and weights behind it, must go with it. On CPU no tensor is
offloaded, so every saved tensor takes the kept path.
"""

from __future__ import annotations

import gc
import weakref

import torch

from stages.train.offload import OffloadActivations


class _Block(torch.nn.Module):
    """Ops that save their own outputs for backward (softmax, exp, sigmoid), as a router and its experts do."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(16, 4)
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        weights = torch.softmax(self.router(x), dim=-1)
        return torch.sigmoid(self.proj(x)).exp() * weights.sum(-1, keepdim=True)


def test_a_forward_dropped_before_its_backward_frees_its_graph_and_its_module():
    model = _Block()
    x = torch.randn(8, 16, requires_grad=True)
    with OffloadActivations(model):
        out = model(x)
    # the graph's leaves hold the weights: alive after the drop means the graph is
    weights = [weakref.ref(p) for p in model.parameters()]
    del out, model
    gc.collect()
    assert [w() for w in weights] == [None] * 4, "the dropped forward's graph kept its weights alive"


def test_gradients_through_the_hooks_equal_the_plain_ones():
    torch.manual_seed(0)
    model = _Block()
    x = torch.randn(8, 16, requires_grad=True)
    model(x).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    hooks = OffloadActivations(model)
    with hooks:
        out = model(x)
    out.sum().backward()
    hooks.reset()
    for a, b in zip(plain, [p.grad for p in model.parameters()] + [x.grad], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
