"""Delayed optimisation W(t+1) = W(t) - lr * g(W(t-k)) against hand-written recursions, and the memory it keeps."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call

from asyncpipe.errors import UserError
from asyncpipe.optim import DelayedWeights, delays_for

STEPS = 50
LR = 0.1


# -- least squares with SGD, uniform delay ----------------------------------------------------------------
def _least_squares(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(32, 5, generator=gen, dtype=torch.float64) / 2
    b = torch.randn(32, generator=gen, dtype=torch.float64)
    w0 = torch.randn(5, generator=gen, dtype=torch.float64)
    return a, b, w0


def _grad_ls(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Gradient of 0.5 * mean((a w - b)^2)."""
    return a.T @ (a @ w - b) / a.shape[0]


def _run_delayed_sgd(a, b, w0, k: int) -> list[torch.Tensor]:
    w = nn.Parameter(w0.clone())
    opt = torch.optim.SGD([w], lr=LR)
    dw = DelayedWeights([w], [k])
    trace = [w.detach().clone()]
    for _ in range(STEPS):
        with dw.stale():
            for rows in (slice(0, 16), slice(16, 32)):  # two micro-batches, both at the stale weights
                (0.5 * (a[rows] @ w - b[rows]).pow(2).sum() / a.shape[0]).backward()
        dw.advance()
        opt.step()
        opt.zero_grad()
        trace.append(w.detach().clone())
    return trace


@pytest.mark.parametrize("k", [0, 1, 2])
def test_uniform_delay_matches_hand_recursion(k: int) -> None:
    a, b, w0 = _least_squares()
    hand = [w0.clone()]
    for t in range(STEPS):
        stale = hand[max(t - k, 0)]  # W(t-k), with W(t-k) := W(0) for t < k
        hand.append(hand[t] - LR * _grad_ls(a, b, stale))
    got = _run_delayed_sgd(a, b, w0, k)
    for t in range(STEPS + 1):
        torch.testing.assert_close(got[t], hand[t], atol=1e-6, rtol=0)
    if k > 0:  # the delay must actually change the trajectory
        assert not torch.allclose(got[-1], _run_delayed_sgd(a, b, w0, 0)[-1], atol=1e-6)


# -- a layered model with the pipedream profile --------------------------------------------------------------
class Layered(nn.Module):
    """Five layers shaped like [Embedding, Block x 3, Head] for partition purposes."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        sizes = [(3, 6), (6, 6), (6, 6), (6, 6), (6, 1)]
        self.layers = nn.ModuleList(nn.Linear(i, o, dtype=torch.float64) for i, o in sizes)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


def _data():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(16, 3, generator=gen, dtype=torch.float64)
    return x, torch.randn(16, 1, generator=gen, dtype=torch.float64)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 0.5 * (out - y).pow(2).mean()


def test_pipedream_delays_follow_the_partition() -> None:
    # 5 layers, 3 stages: partition gives stage 0 = [emb, block1], 1 = [block2], 2 = [block3, head].
    delays = delays_for(Layered(), "pipedream", 1, 3)
    expected = {0: 2, 1: 2, 2: 1, 3: 0, 4: 0}
    assert delays == {f"layers.{i}.{w}": d for i, d in expected.items() for w in ("weight", "bias")}
    assert set(delays_for(Layered(), "pipedream", 1, 1).values()) == {0}
    assert set(delays_for(Layered(), "uniform", 2, 3).values()) == {2}


def test_pipedream_profile_matches_per_stage_recursion() -> None:
    x, y = _data()
    model = Layered()
    names = [n for n, _ in model.named_parameters()]
    delays = delays_for(model, "pipedream", 1, 3)
    assert sorted(set(delays.values())) == [0, 1, 2]

    # Hand recursion: the gradient at step t is taken at the point where each parameter holds W_p(t - k_p).
    ref = copy.deepcopy(model)
    hist = [{n: p.detach().clone() for n, p in ref.named_parameters()}]
    for t in range(STEPS):
        point = {n: hist[max(t - delays[n], 0)][n].clone().requires_grad_(True) for n in names}
        grads = torch.autograd.grad(_loss(functional_call(ref, point, (x,)), y), [point[n] for n in names])
        hist.append({n: hist[t][n] - LR * g for n, g in zip(names, grads)})

    params = [p for _, p in model.named_parameters()]
    dw = DelayedWeights(params, [delays[n] for n in names])
    opt = torch.optim.SGD(params, lr=LR)
    for t in range(STEPS):
        with dw.stale():
            _loss(model(x), y).backward()
        dw.advance()
        opt.step()
        opt.zero_grad()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), hist[t + 1][n], atol=1e-6, rtol=0)
    # Sanity: a uniform run differs, so the per-stage delays matter.
    assert not torch.allclose(params[0].detach(), _uniform_final(0)[0], atol=1e-6)


def _uniform_final(k: int) -> list[torch.Tensor]:
    x, y = _data()
    model = Layered()
    params = list(model.parameters())
    dw, opt = DelayedWeights(params, [k] * len(params)), torch.optim.SGD(params, lr=LR)
    for _ in range(STEPS):
        with dw.stale():
            _loss(model(x), y).backward()
        dw.advance()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in params]


def test_pipedream_needs_enough_blocks() -> None:
    with pytest.raises(UserError):
        delays_for(Layered(), "pipedream", 1, 4)  # only 3 blocks
    with pytest.raises(UserError):
        delays_for(Layered(), "zigzag", 1, 2)


# -- memory: exactly k copies, pointer swaps, no per-step allocation ---------------------------------------
def test_copies_and_bytes() -> None:
    params = list(Layered().parameters())
    total_bytes = sum(p.numel() * p.element_size() for p in params)
    for k in (0, 1, 2):
        dw = DelayedWeights(params, [k] * len(params))
        assert dw.n_copies == k * len(params)
        assert dw.extra_bytes == k * total_bytes
        assert sum(len(r) for r in dw.state_dict()["rings"].values()) == k * len(params)
    mixed = DelayedWeights(params, [2, 2, 1, 1, 0, 0, 0, 0, 0, 0])
    assert mixed.n_copies == 6
    assert mixed.extra_bytes == sum(k * p.numel() * 8 for k, p in zip([2, 2, 1, 1], params))


def test_steps_swap_pointers_without_new_storage() -> None:
    x, y = _data()
    model = Layered()
    params = list(model.parameters())
    dw, opt = DelayedWeights(params, [1] * len(params)), torch.optim.SGD(params, lr=LR)

    def storages() -> set[int]:
        ring_ptrs = {t.data_ptr() for r in dw.state_dict()["rings"].values() for t in r}
        return ring_ptrs | {p.data_ptr() for p in params}

    before = storages()
    assert len(before) == 2 * len(params)
    for _ in range(3):
        with dw.stale():
            inside = {p.data_ptr() for p in params}
            _loss(model(x), y).backward()
        assert inside.isdisjoint({p.data_ptr() for p in params})  # the stale tensors were swapped in
        dw.advance()
        opt.step()
        opt.zero_grad()
        assert storages() == before  # the same buffers, rotated: nothing allocated per step


def test_delay_zero_is_a_no_op() -> None:
    params = list(Layered().parameters())
    dw = DelayedWeights(params, [0] * len(params))
    ptrs = [p.data_ptr() for p in params]
    with dw.stale():
        assert [p.data_ptr() for p in params] == ptrs
    dw.advance()
    assert dw.n_copies == 0 and dw.extra_bytes == 0


def test_exception_inside_stale_restores_current_weights() -> None:
    p = nn.Parameter(torch.zeros(3))
    dw = DelayedWeights([p], [1])  # stores W(0) = zeros
    with torch.no_grad():
        p.add_(1.0)  # the current weights move on to ones
    with pytest.raises(RuntimeError, match="boom"):
        with dw.stale():
            assert torch.equal(p.detach(), torch.zeros(3))
            raise RuntimeError("boom")
    assert torch.equal(p.detach(), torch.ones(3))
    with dw.stale():  # and the stored copy is still intact
        assert torch.equal(p.detach(), torch.zeros(3))


def test_state_dict_resume_is_exact() -> None:
    x, y = _data()

    def run(model, dw, opt, n):
        for _ in range(n):
            with dw.stale():
                _loss(model(x), y).backward()
            dw.advance()
            opt.step()
            opt.zero_grad()

    def fresh():
        model = Layered()
        params = list(model.parameters())
        delays = [2] * 4 + [1] * 4 + [0] * 2
        return model, DelayedWeights(params, delays), torch.optim.SGD(params, lr=LR, momentum=0.9)

    model, dw, opt = fresh()
    run(model, dw, opt, 7)
    saved = copy.deepcopy({"model": model.state_dict(), "dw": dw.state_dict(), "opt": opt.state_dict()})
    run(model, dw, opt, 5)

    model2, dw2, opt2 = fresh()
    model2.load_state_dict(saved["model"])
    dw2.load_state_dict(saved["dw"])
    opt2.load_state_dict(saved["opt"])
    run(model2, dw2, opt2, 5)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)

    model3, dw3, _ = fresh()
    other = DelayedWeights(list(model3.parameters()), [1] * 10)
    with pytest.raises(UserError):
        other.load_state_dict(saved["dw"])
