"""Every staleness mitigation (`compensation=`) against its update rule, recomputed by hand on least squares."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn
from omegaconf import OmegaConf

from asyncpipe.compensation.ef import EFSwitch
from asyncpipe.config.alias import resolve_switch
from asyncpipe.config.schema import CompensationConfig, OptimizerConfig
from asyncpipe.errors import UserError
from asyncpipe.optim import DelayedWeights, ErrorFeedback, build_optimizer, compensate_grads, forward_weights
from asyncpipe.optim import compensation as comp

STEPS = 25
LR = 0.1


def _problem(seed: int = 0, n: int = 4):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(24, n, generator=gen, dtype=torch.float64) / 2
    b = torch.randn(24, generator=gen, dtype=torch.float64)
    x0 = torch.randn(n, generator=gen, dtype=torch.float64)
    return a, b, x0


def _grad(a, b, x):
    return a.T @ (a @ x - b) / a.shape[0]


def _cfg(name: str, **section) -> CompensationConfig:
    cfg = OmegaConf.structured(CompensationConfig(name=name))
    for key, value in section.items():
        cfg[key] = OmegaConf.merge(cfg[key], value)
    return cfg


def _wrap(params, name: str, delays, base=None, **section):
    base = base or torch.optim.SGD(params, lr=LR)
    return comp.build(base, _cfg(name, **section), {p: k for p, k in zip(params, delays)})


def _run(opt, params, dw, loss_fn, steps=STEPS):
    """The simulator's order: forward/backward at W(t-k) (inside the weight hook), hooks, advance, step."""
    trace = [[p.detach().clone() for p in params]]
    for _ in range(steps):
        with dw.stale(), forward_weights(opt):
            loss_fn().backward()
        compensate_grads(opt, dw.stale_weights())
        dw.advance()
        opt.step()
        opt.zero_grad()
        trace.append([p.detach().clone() for p in params])
    return trace


def _ls(a, b, w):
    return lambda: 0.5 * (a @ w - b).pow(2).mean()


# -- EF: lambda schedule ------------------------------------------------------------------------------------
def test_ef_warmup_schedule_matches_formula() -> None:
    a, b, x0 = _problem()
    w = nn.Parameter(x0.clone())
    opt = _wrap([w], "ef", [1], ef={"lam": 0.8, "schedule": "warmup", "warmup_steps": 5})
    got = _run(opt, [w], DelayedWeights([w], [1]), _ls(a, b, w))
    hist, u_prev = [x0.clone()], None
    for t in range(STEPS):
        u = LR * _grad(a, b, hist[max(t - 1, 0)])
        lam = 0.8 * min(1.0, (t + 1) / 5)
        hist.append(hist[t] - u - (0 if u_prev is None else lam * (u - u_prev)))
        u_prev = u
    for t in range(STEPS + 1):
        torch.testing.assert_close(got[t][0], hist[t], atol=1e-12, rtol=0)


def test_ef_presets_are_the_compensation_bit_for_bit() -> None:
    """optimizer=adamw_ef and compensation=ef (constant lam) build the same wrapper and the same trajectory."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    plain = OmegaConf.structured(OptimizerConfig(name="adamw", lr=0.01))
    preset = OmegaConf.create({"optimizer": OmegaConf.structured(OptimizerConfig(name="adamw", lr=0.01, ef=EFSwitch(
        enabled=True, lam=0.7))), "compensation": _cfg("none")})
    resolve_switch(preset)  # what composition does with the *_ef presets' switch
    assert preset.optimizer == plain
    opts = [build_optimizer(models[0], preset.optimizer, compensation=preset.compensation),
            build_optimizer(models[1], plain, compensation=_cfg("ef", ef={"lam": 0.7}))]
    assert all(isinstance(o, ErrorFeedback) for o in opts)
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        x = torch.randn(16, 4, generator=gen)
        for model, opt in zip(models, opts):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)
    both = OmegaConf.create({"optimizer": {"ef": {"enabled": True, "lam": 1.0}}, "compensation": _cfg("dc")})
    with pytest.raises(UserError, match="choose one"):
        resolve_switch(both)


# -- adaptive lambda -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2])
def test_adaptive_lambda_matches_hand_recursion(k: int) -> None:
    a, b, x0 = _problem(1)
    w = nn.Parameter(x0.clone())
    beta, lam_init, lam_max = 0.8, 0.6, 3.0
    opt = _wrap([w], "ef_adaptive", [k], adaptive={"beta": beta, "lam_init": lam_init, "lam_max": lam_max})
    got = _run(opt, [w], DelayedWeights([w], [k]), _ls(a, b, w))
    hist, u_prev, d_prev, stat, lams = [x0.clone()], None, None, None, []
    for t in range(STEPS):
        u = LR * _grad(a, b, hist[max(t - k, 0)])
        if u_prev is None:
            hist.append(hist[t] - u)
        else:
            d = u - u_prev
            if d_prev is not None and t >= k + 2:
                obs = (float(d @ d_prev), float(d_prev @ d_prev))
                stat = obs if stat is None else (beta * stat[0] + (1 - beta) * obs[0], beta * stat[1] + (1 - beta) * obs[1])
            lam = lam_init if stat is None else min(max(k * (1 + 2 * stat[0] / stat[1]) / 3, 0.0), lam_max)
            lams.append(lam)
            hist.append(hist[t] - u - lam * d)
            d_prev = d
        u_prev = u
    for t in range(STEPS + 1):
        torch.testing.assert_close(got[t][0], hist[t], atol=1e-12, rtol=0)
    assert len(set(round(x, 6) for x in lams)) > 3  # lambda really moves


def test_adaptive_model_scope_pools_the_statistics() -> None:
    a, b, x0 = _problem(2)
    w1, w2 = nn.Parameter(x0[:2].clone()), nn.Parameter(x0[2:].clone())
    opt = _wrap([w1, w2], "ef_adaptive", [1, 1], adaptive={"beta": 0.5, "scope": "model"})
    _run(opt, [w1, w2], DelayedWeights([w1, w2], [1, 1]), lambda: 0.5 * (a @ torch.cat([w1, w2]) - b).pow(2).mean(), 6)
    assert list(opt.stats) == [0]
    per_tensor = _wrap([w1, w2], "ef_adaptive", [1, 1], adaptive={"beta": 0.5, "scope": "tensor"})
    _run(per_tensor, [w1, w2], DelayedWeights([w1, w2], [1, 1]), lambda: 0.5 * (a @ torch.cat([w1, w2]) - b).pow(2).mean(), 6)
    assert sorted(per_tensor.stats) == [0, 1]


# -- update averaging (this project's idea, formerly nag_lookahead) ------------------------------------------
def test_update_averaging_matches_hand_recursion() -> None:
    a, b, x0 = _problem(3)
    w = nn.Parameter(x0.clone())
    g = 0.7
    opt = _wrap([w], "update_averaging", [1], nag={"gamma": g})
    got = _run(opt, [w], DelayedWeights([w], [1]), _ls(a, b, w))
    hist, m = [x0.clone()], None
    for t in range(STEPS):
        u = LR * _grad(a, b, hist[max(t - 1, 0)])
        m = u.clone() if m is None else g * m + (1 - g) * u
        hist.append(hist[t] - (g * m + (1 - g) * u))
    for t in range(STEPS + 1):
        torch.testing.assert_close(got[t][0], hist[t], atol=1e-12, rtol=0)


# -- weight prediction ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("k,beta", [(1, 0.0), (2, 0.0), (2, 0.5)])
def test_weight_prediction_matches_hand_recursion(k: int, beta: float) -> None:
    a, b, x0 = _problem(4)
    w = nn.Parameter(x0.clone())
    opt = _wrap([w], "weight_prediction", [k], prediction={"beta": beta, "horizon": 1.0})
    got = _run(opt, [w], DelayedWeights([w], [k]), _ls(a, b, w))
    hist, v = [x0.clone()], None
    for t in range(STEPS):
        stale = hist[max(t - k, 0)]
        if t == 0:
            pred = stale
        else:
            step = stale - hist[max(t - k - 1, 0)]
            v = step if beta == 0 else ((1 - beta) * step if v is None else beta * v + (1 - beta) * step)
            pred = stale + k * v
        hist.append(hist[t] - LR * _grad(a, b, pred))
    for t in range(STEPS + 1):
        torch.testing.assert_close(got[t][0], hist[t], atol=1e-12, rtol=0)
    assert w.data_ptr() != 0 and opt.extra_bytes > 0


# -- DC-ASGD -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k,adaptive", [(1, False), (2, False), (2, True)])
def test_dc_matches_hand_recursion(k: int, adaptive: bool) -> None:
    a, b, x0 = _problem(5)
    w = nn.Parameter(x0.clone())
    lam, rho, eps = 0.5, 0.9, 1e-7
    opt = _wrap([w], "dc", [k], dc={"lam": lam, "adaptive": adaptive, "rho": rho, "eps": eps})
    got = _run(opt, [w], DelayedWeights([w], [k]), _ls(a, b, w))
    hist, v = [x0.clone()], None
    for t in range(STEPS):
        g = _grad(a, b, hist[max(t - k, 0)])
        if adaptive:  # DC-ASGD-a: the EMA of g*g starts at 0, eps inside the square root (changed on purpose)
            v = (1 - rho) * g * g if v is None else rho * v + (1 - rho) * g * g
            scale = lam / (v + eps).sqrt()
        else:
            scale = lam
        g_dc = g + scale * g * g * (hist[t] - hist[max(t - k, 0)])
        hist.append(hist[t] - LR * g_dc)
    for t in range(STEPS + 1):
        torch.testing.assert_close(got[t][0], hist[t], atol=1e-12, rtol=0)
    assert opt.diagnostics["dc_rel"] > 0


# -- basis rotation ------------------------------------------------------------------------------------------
def _matrix_problem(seed: int = 6):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(20, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(20, 4, generator=gen, dtype=torch.float64)
    x0 = torch.randn(4, 3, generator=gen, dtype=torch.float64) / 2
    return a, y, x0


def _mgrad(a, y, x):
    return (a @ x.T - y).T @ a / a.shape[0]  # of 0.5 * mean_rows |a x^T - y|^2


def test_basis_rotation_leaves_sgd_alone() -> None:
    """Plain SGD commutes with rotations: rotating in and out must give plain delayed SGD back."""
    a, y, x0 = _matrix_problem()
    w = nn.Parameter(x0.clone())
    opt = _wrap([w], "basis_rotation", [1], rotation={"every": 2})
    got = _run(opt, [w], DelayedWeights([w], [1]), lambda: 0.5 * (a @ w.T - y).pow(2).sum(1).mean())
    hist = [x0.clone()]
    for t in range(STEPS):
        hist.append(hist[t] - LR * _mgrad(a, y, hist[max(t - 1, 0)]))
    for t in range(STEPS + 1):
        torch.testing.assert_close(got[t][0], hist[t], atol=1e-10, rtol=0)


def test_basis_rotation_adamw_matches_hand_recursion() -> None:
    a, y, x0 = _matrix_problem(7)
    w = nn.Parameter(x0.clone())
    lr, wd, (b1, b2), eps, beta, every = 0.02, 0.1, (0.9, 0.95), 1e-8, 0.9, 3
    base = torch.optim.AdamW([w], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    opt = _wrap([w], "basis_rotation", [1], base=base, rotation={"beta": beta, "every": every})
    got = _run(opt, [w], DelayedWeights([w], [1]), lambda: 0.5 * (a @ w.T - y).pow(2).sum(1).mean())
    hist = [x0.clone()]
    m = v = L = R = ql = qr = None
    for t in range(STEPS):
        g = _mgrad(a, y, hist[max(t - 1, 0)])
        L = g @ g.T if L is None else beta * L + (1 - beta) * g @ g.T
        R = g.T @ g if R is None else beta * R + (1 - beta) * g.T @ g
        if t % every == 0:
            new_l, new_r = torch.linalg.eigh(L).eigenvectors, torch.linalg.eigh(R).eigenvectors
            if m is not None:
                m = new_l.T @ (ql @ m @ qr.T) @ new_r  # the first moment follows the basis; the second stays
            ql, qr = new_l, new_r
        gr = ql.T @ g @ qr
        m = (1 - b1) * gr if m is None else b1 * m + (1 - b1) * gr
        v = (1 - b2) * gr * gr if v is None else b2 * v + (1 - b2) * gr * gr
        u_rot = lr * (m / (1 - b1 ** (t + 1))) / ((v / (1 - b2 ** (t + 1))).sqrt() + eps)
        hist.append(hist[t] - lr * wd * hist[t] - ql @ u_rot @ qr.T)
    for t in range(STEPS + 1):
        torch.testing.assert_close(got[t][0], hist[t], atol=1e-7, rtol=1e-6)
    assert opt.extra_bytes == 2 * (16 + 9) * 8


# -- stage-wise lr ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("anneal", [0, 10])
def test_stage_lr_matches_hand_recursion(anneal: int) -> None:
    a, b, x0 = _problem(8)
    w1, w2 = nn.Parameter(x0[:2].clone()), nn.Parameter(x0[2:].clone())
    delays, power = [2, 0], 1.5  # a pipedream-like pair: the first stage 2 steps stale, the last fresh
    opt = _wrap([w1, w2], "stage_lr", delays, stage_lr={"power": power, "anneal_steps": anneal, "anneal_frac": 0.0})
    got = _run(opt, [w1, w2], DelayedWeights([w1, w2], delays), lambda: 0.5 * (a @ torch.cat([w1, w2]) - b).pow(2).mean())
    hist = [x0.clone()]
    for t in range(STEPS):
        stale = torch.cat([hist[max(t - 2, 0)][:2], hist[t][2:]])
        g = _grad(a, b, stale)
        decay = 1 - min((t + 1) / anneal, 1.0) if anneal else 1.0  # PipeMare: lr / k^p(t) (changed on purpose)
        scale = torch.tensor([2.0 ** (-power * decay)] * 2 + [1.0] * 2, dtype=torch.float64)
        hist.append(hist[t] - LR * scale * g)
    for t in range(STEPS + 1):
        torch.testing.assert_close(torch.cat(got[t]), hist[t], atol=1e-12, rtol=0)


# -- every method: zero strength is the plain optimizer, checkpoints resume exactly --------------------------
NEUTRAL = {
    "ef": {"ef": {"lam": 0.0}},
    "ef_adaptive": {"adaptive": {"lam_init": 0.0, "lam_max": 0.0}},
    "update_averaging": {"nag": {"gamma": 0.0}},
    "weight_prediction": {"prediction": {"horizon": 0.0}},
    "dc": {"dc": {"lam": 0.0}},
    "stage_lr": {"stage_lr": {"power": 0.0, "anneal_frac": 0.0}},
}


@pytest.mark.parametrize("name", sorted(NEUTRAL))
def test_zero_strength_is_the_plain_optimizer(name: str) -> None:
    a, b, x0 = _problem(9)
    w1, w2 = nn.Parameter(x0.clone()), nn.Parameter(x0.clone())
    plain = torch.optim.AdamW([w1], lr=0.05)
    wrapped = _wrap([w2], name, [1], base=torch.optim.AdamW([w2], lr=0.05), **NEUTRAL[name])
    _run(plain, [w1], DelayedWeights([w1], [1]), _ls(a, b, w1), 8)
    _run(wrapped, [w2], DelayedWeights([w2], [1]), _ls(a, b, w2), 8)
    torch.testing.assert_close(w1.detach(), w2.detach(), atol=1e-14, rtol=0)


@pytest.mark.parametrize("name", [m for m in comp.available() if m != "none"])
def test_state_dict_round_trip_resumes_exactly(name: str) -> None:
    a, y, x0 = _matrix_problem(10)

    def fresh():
        w = nn.Parameter(x0.clone())
        base = torch.optim.AdamW([w], lr=0.02, weight_decay=0.1)
        opt = _wrap([w], name, [1], base=base, rotation={"every": 2}, stage_lr={"run_steps": 20})
        return w, opt, DelayedWeights([w], [1])

    def loss(w):
        return lambda: 0.5 * (a @ w.T - y).pow(2).sum(1).mean()

    w, opt, dw = fresh()
    _run(opt, [w], dw, loss(w), 5)
    buf = io.BytesIO()
    torch.save({"w": w.detach().clone(), "opt": opt.state_dict(), "dw": dw.state_dict()}, buf)
    _run(opt, [w], dw, loss(w), 4)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    w2, opt2, dw2 = fresh()
    with torch.no_grad():
        w2.copy_(saved["w"])
    opt2.load_state_dict(saved["opt"])
    dw2.load_state_dict(saved["dw"])
    _run(opt2, [w2], dw2, loss(w2), 4)
    assert torch.equal(w.detach(), w2.detach())


def test_pipeline_refuses_what_does_not_fit_2bw() -> None:
    w = nn.Parameter(torch.zeros(2))
    with pytest.raises(UserError, match="weight_prediction does not run in engine=pipeline"):
        comp.build(torch.optim.SGD([w], lr=0.1), _cfg("weight_prediction"), {w: 1}, pipeline=True)
    fits = {m: comp.method(m).fits_2bw for m in comp.available()}
    assert fits["weight_prediction"] is False and sum(fits.values()) == len(fits) - 1


# -- every method in the simulator on the tiny model, at delay 1 and 2 ---------------------------------------
SIM = ["train.steps=4", "train.seq_len=32", "train.micro_batches=2", "train.micro_batch_size=4", "run.dir=unused",
       "compensation.stage_lr.anneal_frac=1"]  # stage_lr anneals over the 4 steps (0.14 of 4 steps: none left)


def _simulate(delay: int, method: str) -> torch.Tensor:
    from asyncpipe.config import compose
    from asyncpipe.trainer import Trainer

    trainer = Trainer(compose([*SIM, f"delay={delay}", f"compensation={method}"])).engine
    results = [trainer.train_step() for _ in range(4)]
    assert all(torch.isfinite(torch.tensor(r.train_loss)) for r in results)
    return torch.cat([p.detach().reshape(-1) for p in trainer.params])


@pytest.fixture(scope="module")
def uncompensated() -> dict[int, torch.Tensor]:
    return {delay: _simulate(delay, "none") for delay in (1, 2)}


@pytest.mark.parametrize("name", [m for m in comp.available() if m != "none"])
def test_every_method_runs_in_the_simulator_at_delay_1_and_2(name: str, uncompensated) -> None:
    for delay in (1, 2):
        same = name == "stage_lr" and delay == 1  # PipeMare's lr / k^p leaves k = 1 alone (changed on purpose)
        assert torch.equal(uncompensated[delay], _simulate(delay, name)) == same, f"{name} at delay {delay}"
