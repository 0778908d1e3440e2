"""The lr schedules (cosine, wsd) and the one gradient-clipping rule."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from asyncpipe.errors import UserError
from asyncpipe.optim import LRSchedule, clip_grads, grad_sq_norm, lr_factor


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


def _wsd(steps: int, warmup: int, decay_frac: float = 0.2, floor: float = 0.1) -> list[float]:
    return [LRSchedule("wsd", steps, warmup, floor, decay_frac).factor(s) for s in range(steps)]


def test_wsd_matches_the_hand_derived_formula() -> None:
    """10 steps, 2 warm-up, decay_frac 0.3 (D = 3 decay steps, starting at S = 7), floor 0.1: by hand,
    1/2, 2/2, then 1 for steps 2..6, then 1 - 0.9 x 1/3, 1 - 0.9 x 2/3, 1 - 0.9 x 3/3 = 0.7, 0.4, 0.1."""
    f = _wsd(10, 2, 0.3)
    assert f == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.7, 0.4, 0.1])
    s = LRSchedule("wsd", 10, 2, 0.1, 0.3)
    assert (s.decay_steps, s.decay_start) == (3, 7)


def test_wsd_lengths_share_everything_before_their_own_decay() -> None:
    """The warm-up and the stable phase do not depend on train.steps: the 1x run's schedule is the 2.5x run's
    up to the 1x run's decay start (1100 -> decay at 880; 2750 -> decay at 2200)."""
    short, long_ = _wsd(1100, 110), _wsd(2750, 110)
    start = LRSchedule("wsd", 1100, 110, 0.1, 0.2).decay_start
    assert start == 880 and LRSchedule("wsd", 2750, 110, 0.1, 0.2).decay_start == 2200
    assert short[:start] == long_[:start]
    assert short[start] < 1.0 == long_[start]
    assert short[-1] == pytest.approx(0.1) and long_[-1] == pytest.approx(0.1)


def test_cosine_with_warmup_steps_is_the_fraction_rule_when_they_agree() -> None:
    a = LRSchedule("cosine", 100, 10, 0.1)
    assert [a.factor(s) for s in range(100)] == [lr_factor(s, 100, 0.1, 0.1) for s in range(100)]


@pytest.mark.parametrize("args, needle", [
    (("wsd", 10, 9, 0.1, 0.2), "runs past the wsd decay start, step 8"),
    (("cosine", 10, 11, 0.1, 0.2), "is longer than train.steps=10"),
    (("wsd", 10, 1, 0.1, 1.0), "train.decay_frac=1.0 must be in (0, 1)"),
    (("linear", 10, 1, 0.1, 0.2), "train.lr_schedule=linear is not allowed"),
])  # fmt: skip
def test_schedule_refusals(args: tuple, needle: str) -> None:
    with pytest.raises(UserError) as err:
        LRSchedule(*args)
    assert needle in str(err.value)
