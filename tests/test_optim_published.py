"""The staleness mitigations as their sources define them, each against a hand recursion of the source's update
rule on a tiny problem (plain tensors, computed here), and checks that the previous behaviour is gone where it
changed: optimizer=nag (Ajanthan et al. 2025 as run in PluralisResearch/AsyncPP), compensation=stage_lr
(PipeMare's lr rescheduling as AsyncPP and LOG-postech/basis-rotation run it), compensation=dc (DC-ASGD-a) and
compensation=basis_rotation (hidden matrices only, experts one by one)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from omegaconf import OmegaConf

from asyncpipe.config import ConfigError, compose
from asyncpipe.config.schema import CompensationConfig, ModelConfig, OptimizerConfig
from asyncpipe.model import GPT
from asyncpipe.optim import DelayedWeights, build_optimizer
from asyncpipe.optim import compensation as comp
from test_optim_compensation import _run  # the simulator's step order, one copy

STEPS = 25
BASE = ["run.dir=unused", "train.seq_len=32"]


def _problem(seed: int, n: int = 4):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(24, n, generator=gen, dtype=torch.float64) / 2
    b = torch.randn(24, generator=gen, dtype=torch.float64)
    x0 = torch.randn(n, generator=gen, dtype=torch.float64)
    return a, b, x0


def _grad(a, b, x):
    return a.T @ (a @ x - b) / a.shape[0]  # of 0.5 * mean (a x - b)^2


def _cfg(name: str, **section) -> CompensationConfig:
    cfg = OmegaConf.structured(CompensationConfig(name=name))
    for key, value in section.items():
        cfg[key] = OmegaConf.merge(cfg[key], value)
    return cfg


# -- nag: NAdamW at AsyncPP's "Ours" settings ----------------------------------------------------------------
def test_nag_preset_is_nadamw_with_asyncpp_settings_under_weight_stashing() -> None:
    """The hand recursion is torch's NAdam with decoupled weight decay (Dozat 2016 with PyTorch's momentum
    schedule), fed gradients of W(t-k); the constants are AsyncPP's: --momentum 0.99, beta2 0.999,
    momentum_decay 0.004, --weight-decay 0.01, eps 1e-8."""
    b1, b2, psi, wd, eps, k = 0.99, 0.999, 0.004, 0.01, 1e-8, 2
    cfg = compose([*BASE, "optimizer=nag", "optimizer.lr=0.05"]).optimizer
    a, b, x0 = _problem(0)
    model = nn.Linear(4, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(x0[None])
    w = model.weight
    opt = build_optimizer(model, cfg)
    got = _run(opt, [w], DelayedWeights([w], [k]), lambda: 0.5 * (a @ w[0] - b).pow(2).mean())

    lr, hist, m, v, mu_prod = cfg.lr, [x0.clone()], torch.zeros(4, dtype=torch.float64), 0.0, 1.0
    v = torch.zeros(4, dtype=torch.float64)
    for t in range(1, STEPS + 1):
        g = _grad(a, b, hist[max(t - 1 - k, 0)])
        x = hist[-1] * (1 - lr * wd)
        mu, mu_next = b1 * (1 - 0.5 * 0.96 ** (t * psi)), b1 * (1 - 0.5 * 0.96 ** ((t + 1) * psi))
        mu_prod *= mu
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        denom = (v / (1 - b2**t)).sqrt() + eps
        x = x - lr * (1 - mu) / (1 - mu_prod) * g / denom - lr * mu_next / (1 - mu_prod * mu_next) * m / denom
        hist.append(x)
    for t in range(STEPS + 1):  # torch keeps NAdam's running product of mu in float32: agreement to ~1e-8
        torch.testing.assert_close(got[t][0][0], hist[t], atol=1e-8, rtol=1e-7)


def test_the_update_averaging_variant_is_no_longer_called_nag() -> None:
    with pytest.raises(ConfigError, match="update_averaging"):
        compose([*BASE, "compensation=nag_lookahead"])
    assert "nag_lookahead" not in comp.available() and "update_averaging" in comp.available()


# -- stage_lr: PipeMare's lr / k^p(t) -------------------------------------------------------------------------
def test_stage_lr_matches_pipemare_rule_on_a_pipedream_profile() -> None:
    """Four 'stages' k = 3, 2, 1, 0 (PipeDream, P = 4); lr_k(t) = lr / k^(1 - min((t+1)/T, 1)) for k >= 1."""
    a, b, x0 = _problem(1)
    ws = [nn.Parameter(x0[i : i + 1].clone()) for i in range(4)]
    delays, lr, T = [3, 2, 1, 0], 0.1, 10
    opt = comp.build(torch.optim.SGD(ws, lr=lr), _cfg("stage_lr", stage_lr={"anneal_steps": T}), dict(zip(ws, delays)))
    got = _run(opt, ws, DelayedWeights(ws, delays), lambda: 0.5 * (a @ torch.cat(ws) - b).pow(2).mean())
    hist = [x0.clone()]
    for t in range(STEPS):
        stale = torch.stack([hist[max(t - k, 0)][i] for i, k in enumerate(delays)])
        g = _grad(a, b, stale)
        p = 1 - min((t + 1) / T, 1)
        lrs = torch.tensor([lr / k**p if k >= 1 else lr for k in delays], dtype=torch.float64)
        hist.append(hist[t] - lrs * g)
    for t in range(STEPS + 1):
        torch.testing.assert_close(torch.cat(got[t]), hist[t], atol=1e-12, rtol=0)


def test_stage_lr_default_anneals_over_the_sources_share_of_the_run() -> None:
    """The YAML default: T = 0.14 x train.steps (7 of AsyncPP's 50 epochs). The previous rule, (1 + k)^-1 for
    the whole run, halved the lr at k = 1 and kept quartering it at k = 3; PipeMare leaves both alone."""
    cfg = compose([*BASE, "compensation=stage_lr", "delay=1", "delay_profile=pipedream", "train.steps=1100"])
    assert cfg.compensation.stage_lr.run_steps == 1100
    opt = build_optimizer(nn.Linear(2, 2), cfg.optimizer, compensation=cfg.compensation, delays=3)
    assert opt.anneal == 154
    assert opt.scale(1, 0) == 1.0 and opt.scale(0, 0) == 1.0  # old: 0.5 at k = 1
    assert opt.scale(3, 0) == pytest.approx(3 ** -(1 - 1 / 154), rel=1e-12)
    assert opt.scale(3, 153) == 1.0 and opt.scale(3, 1099) == 1.0  # old: 0.25 for the whole run


# -- dc: DC-ASGD-a ---------------------------------------------------------------------------------------------
def _dc_reference(a, b, x0, k, lam, rho, eps, lr, paper: bool):
    hist, v = [x0.clone()], None
    for t in range(STEPS):
        g = _grad(a, b, hist[max(t - k, 0)])
        if paper:  # MeanSquare(0) = 0, lam(t) = lam / sqrt(MeanSquare(t) + eps)
            v = (1 - rho) * g * g if v is None else rho * v + (1 - rho) * g * g
            scale = lam / (v + eps).sqrt()
        else:  # the previous asyncpipe rule: EMA seeded with g*g, eps outside the root
            v = g * g if v is None else rho * v + (1 - rho) * g * g
            scale = lam / (v.sqrt() + eps)
        hist.append(hist[t] - lr * (g + scale * g * g * (hist[t] - hist[max(t - k, 0)])))
    return hist


def test_dc_asgd_a_matches_the_paper_rule() -> None:
    a, b, x0 = _problem(2)
    w = nn.Parameter(x0.clone())
    k, lam, rho, eps, lr = 2, 0.5, 0.9, 1e-2, 0.1  # a large eps, so where it sits shows
    section = {"lam": lam, "adaptive": True, "rho": rho, "eps": eps}
    opt = comp.build(torch.optim.SGD([w], lr=lr), _cfg("dc", dc=section), {w: k})
    got = _run(opt, [w], DelayedWeights([w], [k]), lambda: 0.5 * (a @ w - b).pow(2).mean())
    paper = _dc_reference(a, b, x0, k, lam, rho, eps, lr, paper=True)
    for t in range(STEPS + 1):
        torch.testing.assert_close(got[t][0], paper[t], atol=1e-12, rtol=0)
    previous = _dc_reference(a, b, x0, k, lam, rho, eps, lr, paper=False)
    assert (got[-1][0] - previous[-1]).abs().max() > 1e-6  # the test tells the two rules apart


# -- basis rotation --------------------------------------------------------------------------------------------
def test_basis_rotation_rotates_each_expert_in_its_own_basis() -> None:
    """A stacked [E, rows, cols] expert weight under AdamW: expert e keeps its own L, R, Q_L, Q_R and its own
    rotated Adam moments, exactly as if it were a separate matrix."""
    E, rows, cols, lr, wd, (b1, b2), adam_eps, beta, every = 2, 3, 3, 0.02, 0.1, (0.9, 0.95), 1e-8, 0.9, 3
    gen = torch.Generator().manual_seed(3)
    xs = torch.randn(E, 20, cols, generator=gen, dtype=torch.float64)
    ys = torch.randn(E, 20, rows, generator=gen, dtype=torch.float64)
    x0 = torch.randn(E, rows, cols, generator=gen, dtype=torch.float64) / 2
    w = nn.Parameter(x0.clone())
    base = torch.optim.AdamW([w], lr=lr, betas=(b1, b2), eps=adam_eps, weight_decay=wd)
    opt = comp.build(base, _cfg("basis_rotation", rotation={"beta": beta, "every": every}), {w: 1})
    got = _run(opt, [w], DelayedWeights([w], [1]), lambda: 0.5 * (xs @ w.mT - ys).pow(2).sum(-1).mean(-1).sum())

    for e in range(E):
        hist, m, v, L, R, ql, qr = [x0[e].clone()], None, None, None, None, None, None
        for t in range(STEPS):
            W = hist[max(t - 1, 0)]
            g = (xs[e] @ W.T - ys[e]).T @ xs[e] / xs.shape[1]
            L = g @ g.T if L is None else beta * L + (1 - beta) * g @ g.T
            R = g.T @ g if R is None else beta * R + (1 - beta) * g.T @ g
            if t % every == 0:
                new_l, new_r = torch.linalg.eigh(L).eigenvectors, torch.linalg.eigh(R).eigenvectors
                if m is not None:
                    m = new_l.T @ (ql @ m @ qr.T) @ new_r
                ql, qr = new_l, new_r
            gr = ql.T @ g @ qr
            m = (1 - b1) * gr if m is None else b1 * m + (1 - b1) * gr
            v = (1 - b2) * gr * gr if v is None else b2 * v + (1 - b2) * gr * gr
            u_rot = lr * (m / (1 - b1 ** (t + 1))) / ((v / (1 - b2 ** (t + 1))).sqrt() + adam_eps)
            hist.append(hist[t] - lr * wd * hist[t] - ql @ u_rot @ qr.T)
        for t in range(STEPS + 1):
            torch.testing.assert_close(got[t][0][e], hist[t], atol=1e-7, rtol=1e-6)
    assert tuple(opt.buffers["L"][w].shape) == (E, rows, rows)


def _gpt(moe: bool = False) -> GPT:
    extra = {"moe": {"experts": 4, "top_k": 2}} if moe else {}
    cfg = OmegaConf.merge(
        OmegaConf.structured(ModelConfig(name="t", n_layer=2, d_model=32, n_head=4, d_ff=64)), extra
    )
    return GPT(cfg, 48, seed=0)


@pytest.mark.parametrize("moe", [False, True])
def test_basis_rotation_skips_embedding_head_and_routers_by_default(moe: bool) -> None:
    model = _gpt(moe)
    adamw = OmegaConf.structured(OptimizerConfig(name="adamw", lr=0.01))
    names = {id(p): n for n, p in model.named_parameters()}
    matrices = {n for n, p in model.named_parameters() if p.dim() in (2, 3)}
    outside = {n for n in matrices if n.startswith(("layers.0.", f"layers.{len(model.layers) - 1}.")) or "router" in n}
    assert outside and matrices - outside  # the model has both kinds

    default = build_optimizer(model, adamw, compensation=_cfg("basis_rotation"), delays=1)
    assert {names[id(p)] for p in default.rotated} == matrices - outside  # old: every matrix
    if moe:
        assert any(p.dim() == 3 for p in default.rotated)
    every = build_optimizer(model, adamw, compensation=_cfg("basis_rotation", rotation={"all_matrices": True}), delays=1)
    assert {names[id(p)] for p in every.rotated} == matrices


def test_basis_rotation_under_muon_rotating_nothing_is_refused() -> None:
    with pytest.raises(ConfigError, match="rotates nothing"):
        compose([*BASE, "optimizer=muon", "compensation=basis_rotation", "delay=1"])
    cfg = compose([*BASE, "optimizer=muon", "compensation=basis_rotation", "delay=1", "compensation.rotation.all_matrices=true"])
    assert cfg.compensation.rotation.all_matrices
    assert math.isfinite(cfg.compensation.rotation.beta)
