"""The error-feedback wrapper against the formula x(t+1) = x(t) - u(t) - lam * (u(t) - u(t-1)), by hand."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn as nn
from omegaconf import OmegaConf

from asyncpipe.config.schema import CompensationConfig, OptimizerConfig
from asyncpipe.optim import DelayedWeights, ErrorFeedback, build_optimizer

STEPS = 30


def _problem(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(24, 4, generator=gen, dtype=torch.float64) / 2
    b = torch.randn(24, generator=gen, dtype=torch.float64)
    x0 = torch.randn(4, generator=gen, dtype=torch.float64)
    return a, b, x0


def _grad(a, b, x):
    return a.T @ (a @ x - b) / a.shape[0]


def _backward(a, b, w):
    (0.5 * (a @ w - b).pow(2).mean()).backward()


def _lr(t: int) -> float:
    return 0.1 * (1 + 0.5 * math.sin(t))  # a changing lr: EF must measure the update actually applied


@pytest.mark.parametrize("lam", [0.5, 1.0])
def test_sgd_matches_formula(lam: float) -> None:
    a, b, x0 = _problem()
    w = nn.Parameter(x0.clone())
    ef = ErrorFeedback(torch.optim.SGD([w], lr=0.1), lam)
    x, u_prev = x0.clone(), None
    for t in range(STEPS):
        u = _lr(t) * _grad(a, b, x)
        corr = torch.zeros_like(x) if u_prev is None else lam * (u - u_prev)
        x_next = x - u - corr

        ef.param_groups[0]["lr"] = _lr(t)
        _backward(a, b, w)
        ef.step()
        ef.zero_grad()
        torch.testing.assert_close(w.detach(), x_next, atol=1e-12, rtol=0)
        assert ef.last_correction_norm == pytest.approx(float(corr.norm()), rel=1e-5, abs=1e-12)
        assert ef.last_update_norm == pytest.approx(float((x - x_next).norm()), rel=1e-5)
        x, u_prev = x_next, u
    assert ef.last_correction_norm > 0


def test_adamw_matches_formula_with_own_moments() -> None:
    """Adam's state sees the EF-corrected iterates; recompute its update from our own m, v."""
    a, b, x0 = _problem(1)
    lam, wd, (b1, b2), eps = 1.0, 0.1, (0.9, 0.95), 1e-8
    w = nn.Parameter(x0.clone())
    ef = ErrorFeedback(torch.optim.AdamW([w], lr=0.01, betas=(b1, b2), eps=eps, weight_decay=wd), lam)
    x, m, v, u_prev = x0.clone(), torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64), None
    for t in range(STEPS):
        lr = 0.01 * _lr(t) / 0.1
        g = _grad(a, b, x)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1 ** (t + 1)), v / (1 - b2 ** (t + 1))
        u = lr * wd * x + lr * m_hat / (v_hat.sqrt() + eps)
        x_next = x - u - (0 if u_prev is None else lam * (u - u_prev))

        ef.param_groups[0]["lr"] = lr
        _backward(a, b, w)
        ef.step()
        ef.zero_grad()
        torch.testing.assert_close(w.detach(), x_next, atol=1e-12, rtol=1e-10)
        x, u_prev = x_next, u
    # The wrapped optimizer's moments are its own: exactly the ones the recursion kept.
    torch.testing.assert_close(ef.state[w]["exp_avg"], m, atol=1e-12, rtol=1e-10)


def test_ef_with_one_step_delay() -> None:
    """The research setting: u(t) = lr * g(x(t-1)) and the EF extrapolation on top."""
    a, b, x0 = _problem(2)
    lam, lr = 1.0, 0.2
    w = nn.Parameter(x0.clone())
    dw = DelayedWeights([w], [1])
    ef = ErrorFeedback(torch.optim.SGD([w], lr=lr), lam)
    hist, u_prev = [x0.clone()], None
    for t in range(STEPS):
        u = lr * _grad(a, b, hist[max(t - 1, 0)])
        hist.append(hist[t] - u - (0 if u_prev is None else lam * (u - u_prev)))
        u_prev = u

        with dw.stale():
            _backward(a, b, w)
        dw.advance()
        ef.step()
        ef.zero_grad()
        torch.testing.assert_close(w.detach(), hist[t + 1], atol=1e-12, rtol=0)


def test_lam_zero_is_the_plain_optimizer() -> None:
    a, b, x0 = _problem(3)
    w1, w2 = nn.Parameter(x0.clone()), nn.Parameter(x0.clone())
    plain = torch.optim.AdamW([w1], lr=0.05)
    wrapped = ErrorFeedback(torch.optim.AdamW([w2], lr=0.05), 0.0)
    for _ in range(10):
        for w, opt in ((w1, plain), (w2, wrapped)):
            _backward(a, b, w)
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(w1.detach(), w2.detach(), atol=1e-14, rtol=0)


def test_param_without_grad_is_left_alone() -> None:
    used, unused = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    ef = ErrorFeedback(torch.optim.AdamW([used, unused], lr=0.1, weight_decay=0.1), 1.0)
    for _ in range(3):
        used.sum().backward()
        ef.step()
        ef.zero_grad()
    assert torch.equal(unused.detach(), torch.ones(3))
    assert not torch.equal(used.detach(), torch.ones(3))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _steps(model: nn.Module, opt: torch.optim.Optimizer, n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(16, 4, generator=gen)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _cfg(name: str, **kw) -> OptimizerConfig:
    return OmegaConf.structured(OptimizerConfig(name=name, **kw))


EF = OmegaConf.structured(CompensationConfig(name="ef"))
EF.ef.lam = 0.7


def test_state_dict_round_trip_gives_identical_steps() -> None:
    model = _model()
    opt = build_optimizer(model, _cfg("adamw", lr=0.01), compensation=EF)
    assert isinstance(opt, ErrorFeedback) and isinstance(opt, torch.optim.Optimizer)
    _steps(model, opt, 5, seed=1)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _steps(model, opt, 4, seed=2)

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model2 = _model()
    opt2 = build_optimizer(model2, _cfg("adamw", lr=0.01), compensation=EF)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    assert opt2.param_groups is opt2.optimizer.param_groups  # still shared after torch replaced the list
    _steps(model2, opt2, 4, seed=2)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)

    # Without the EF buffer the next step would differ: the buffer really is part of the state.
    model3 = _model()
    opt3 = build_optimizer(model3, _cfg("adamw", lr=0.01), compensation=EF)
    model3.load_state_dict(saved["model"])
    opt3.optimizer.load_state_dict(saved["opt"]["optimizer"])
    _steps(model3, opt3, 4, seed=2)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), model3.parameters()))


def test_muon_ef_round_trip_and_lr_reaches_inner() -> None:
    model = _model()
    hidden = lambda name, p: name == "2.weight" or name == "0.weight"  # noqa: E731
    opt = build_optimizer(model, _cfg("muon", lr=0.02, aux_lr=0.003), compensation=EF, hidden=hidden)
    for group in opt.param_groups:
        group["lr"] = group["base_lr"] * 0.5
    # Muon holds both weights; AdamW only the biases (one no-decay group).
    inner_lrs = sorted(g["lr"] for o in opt.optimizer.optimizers for g in o.param_groups)
    assert inner_lrs == pytest.approx([0.0015, 0.01])
    _steps(model, opt, 3, seed=1)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    _steps(model, opt, 3, seed=2)
    model2 = _model()
    opt2 = build_optimizer(model2, _cfg("muon", lr=0.02, aux_lr=0.003), compensation=EF, hidden=hidden)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    _steps(model2, opt2, 3, seed=2)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
