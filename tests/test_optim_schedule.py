"""The lr schedule and the one gradient-clipping rule."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from asyncpipe.errors import UserError
from asyncpipe.optim import clip_grads, grad_sq_norm, lr_factor


def test_warmup_then_cosine_to_floor() -> None:
    total = 100
    f = [lr_factor(s, total, 0.1, 0.1) for s in range(total)]
    assert f[0] == pytest.approx(0.1)  # (0 + 1) / 10 warm-up steps: small but nonzero
    assert f[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert f[10] == pytest.approx(1.0)
    assert f[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))  # monotone decay after warm-up
    mid = 10 + (total - 1 - 10) / 2
    assert lr_factor(int(mid), total) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (int(mid) - 10) / 89)))


def test_schedule_edges() -> None:
    assert lr_factor(0, 1) == 1.0
    assert lr_factor(0, 50, warmup_frac=0.0, min_lr_frac=0.0) == 1.0
    assert lr_factor(49, 50, warmup_frac=0.0, min_lr_frac=0.0) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(UserError):
        lr_factor(0, 0)
    with pytest.raises(UserError):
        lr_factor(0, 10, min_lr_frac=2.0)


def _params_with_grads(scale: float) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.zeros(3, 4)), nn.Parameter(torch.zeros(5)), nn.Parameter(torch.zeros(2))]
    for p in params[:2]:
        p.grad = torch.randn(p.shape, generator=gen) * scale
    return params  # the last one has no grad


def test_clip_scales_to_max_norm_and_returns_pre_clip_norm() -> None:
    params = _params_with_grads(10.0)
    expected = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in params[:2]))
    assert float(grad_sq_norm(params)) == pytest.approx(expected**2, rel=1e-6)
    norm = clip_grads(params, 1.0)
    assert norm == pytest.approx(expected, rel=1e-6)
    assert math.sqrt(float(grad_sq_norm(params))) == pytest.approx(1.0, rel=1e-5)


def test_clip_leaves_small_grads_and_respects_off_and_given_norm() -> None:
    params = _params_with_grads(0.01)
    before = [p.grad.clone() for p in params[:2]]
    clip_grads(params, 1.0)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, params))
    big = _params_with_grads(10.0)
    before = [p.grad.clone() for p in big[:2]]
    clip_grads(big, 0.0)  # 0 = off
    assert all(torch.equal(a, p.grad) for a, p in zip(before, big))
    # A norm given from outside (the pipeline's all-reduced one) decides the scale.
    assert clip_grads(big, 1.0, total_norm=torch.tensor(4.0)) == 4.0
    for a, p in zip(before, big):
        torch.testing.assert_close(p.grad, a * (1.0 / (4.0 + 1e-6)))
