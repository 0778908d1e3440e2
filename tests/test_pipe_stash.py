"""The two-version weight stash: a backward after an optimizer step still sees its forward's weights."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from asyncpipe.engines.pipeline.stash import WeightStash


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _grads_at(net: nn.Module, state: dict, x: torch.Tensor) -> list[torch.Tensor]:
    ref = copy.deepcopy(net)
    ref.load_state_dict(state)
    ref.zero_grad()
    ref(x).square().sum().backward()
    return [p.grad.clone() for p in ref.parameters()]


def test_2bw_protocol_matches_the_update_rule():
    net = _net()
    w0 = copy.deepcopy(net.state_dict())
    stash = WeightStash(net, delay=1)
    opt = torch.optim.SGD(stash.params, lr=0.1)
    xa, xb = torch.randn(5, 4), torch.randn(5, 4)

    def step(src: int, batch_version: int) -> None:
        grads = stash.take_grads(batch_version)
        stash.begin_update(src, src + 1)
        for p, g in zip(stash.params, grads):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
        stash.end_update(src + 1)

    # batch 0 (micro-batch a) runs on W(0); batch 1's micro-batch b is forwarded on W(0) before step 0 ...
    with stash.use(0):
        net(xa).square().sum().backward()
    stash.release(0)
    with stash.use(0):
        yb = net(xb)
    assert all(mod._parameters[n] is p for mod, n, p in stash._owners), "use() must restore the handles"
    step(0, batch_version=0)
    w1 = {k: v - 0.1 * g for (k, v), g in zip(w0.items(), _grads_at(net, w0, xa))}
    assert all(torch.allclose(p, w1[k]) for (k, _), p in zip(w0.items(), stash.params))
    # ... and backwarded after it: its gradient is the one at W(0), not at W(1)
    yb.square().sum().backward()
    stash.release(0)
    assert stash.weight_bytes == 2 * stash.param_bytes == stash.peak_bytes
    gb = [v.grad.clone() for v in stash.slots[0]]
    assert all(torch.allclose(g, r) for g, r in zip(gb, _grads_at(net, w0, xb)))
    # step 1: W(2) = W(1) - lr * g(W(0)), written over W(0)'s slot; W(1) stays for batch 2
    step(1, batch_version=0)
    w2 = {k: w1[k] - 0.1 * g for k, g in zip(w0, gb)}
    assert all(torch.allclose(p, w2[k]) for k, p in zip(w0, stash.params))
    assert all(torch.allclose(v, w1[k]) for k, v in zip(w0, stash.slots[1]))
    assert stash.versions_alive == {2}
    assert stash.weight_bytes == 2 * stash.param_bytes


def test_refuses_to_overwrite_a_version_in_use():
    net = _net()
    stash = WeightStash(net, delay=1)
    stash.take_grads(0)
    stash.begin_update(0, 1)
    stash.end_update(1)
    with stash.use(0):
        net(torch.randn(2, 4))  # in flight on W(0), which the next update would overwrite
    stash.take_grads(0)
    with pytest.raises(RuntimeError, match="still used"):
        stash.begin_update(1, 2)
    with pytest.raises(RuntimeError, match="not stashed"):
        with stash.use(5):
            pass


def test_delay_0_keeps_one_version_in_place():
    net = _net()
    stash = WeightStash(net, delay=0)
    before = [p for p in net.parameters()]
    assert stash.params == before and stash.weight_bytes == stash.param_bytes
    stash.begin_update(0, 1)
    stash.end_update(1)
    assert stash.peak_bytes == stash.param_bytes
