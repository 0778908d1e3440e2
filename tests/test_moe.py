"""Mixture of experts: routing against a per-token reference, the aux losses' gradients, capacity dropping,
expert-aware Muon (each expert's update orthogonal), and `asyncpipe train model=moe_tiny` learning on CPU."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from asyncpipe.config.schema import CompensationConfig, ModelConfig, OptimizerConfig
from asyncpipe.model import GPT, MoE, Router, lm_loss, pop_moe_stats, set_aux_grad_scale
from asyncpipe.optim import CombinedOptimizer, build_optimizer
from asyncpipe.optim.expert_muon import ExpertMuon, orthogonalize
from helpers import asyncpipe, read_metrics

CONF = Path(__file__).resolve().parents[1] / "conf" / "model"


def _moe(shared: bool = False, capacity=None, e: int = 4, k: int = 2) -> MoE:
    moe = MoE(16, 24, e, k, shared_expert=shared, capacity_factor=capacity)
    moe.init_weights(0.2, 0.2, torch.Generator().manual_seed(0))
    return moe


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax router, top-k, renormalised weights, sum of the chosen experts' SwiGLU."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(flat)
    for i, tok in enumerate(flat):
        probs = F.softmax(moe.router(tok), dim=-1)
        w, idx = probs.topk(moe.top_k)
        for wi, e in zip(w / w.sum(), idx.tolist()):
            h = F.silu(moe.w_gate[e] @ tok) * (moe.w_up[e] @ tok)
            out[i] += wi * (moe.w_down[e] @ h)
        if moe.shared is not None:
            s = moe.shared
            out[i] += s["down"](F.silu(s["gate"](tok)) * s["up"](tok))
    return out.reshape(x.shape)


@pytest.mark.parametrize("shared", [False, True])
def test_dropless_routing_matches_a_per_token_reference(shared: bool) -> None:
    moe = _moe(shared).eval()
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(moe(x), _reference(moe, x), atol=1e-5)


def test_top_k_combine_accumulates_in_fp32_under_bf16_autocast() -> None:
    """The experts' bf16 outputs are weighted and summed per token in fp32 (the output is fp32): the combine adds
    no bf16 rounding of its own, so it matches the fp32 sum of the same bf16 expert outputs exactly."""
    moe = _moe(e=4, k=4).eval()  # every token takes every expert: the combine sums 4 outputs per token
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x)
        flat = x.reshape(-1, 16)
        w = F.softmax(moe.router(flat).float(), dim=-1)
        want = torch.zeros(flat.shape[0], 16)
        for e in range(4):  # expert order = the layer's (assignments grouped by expert)
            h = F.silu(F.linear(flat, moe.w_gate[e])) * F.linear(flat, moe.w_up[e])
            want += F.linear(h, moe.w_down[e]).float() * (w[:, e:e + 1] / w.sum(-1, keepdim=True))
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.reshape(-1, 16), want, rtol=1e-6, atol=1e-6)


def test_capacity_factor_drops_assignments_beyond_capacity() -> None:
    moe = _moe(capacity=0.25, e=4, k=1).eval()  # capacity ceil(0.25 * 40 / 4) = 3 tokens per expert
    x = torch.randn(1, 40, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y = moe(x)[0]
        full = _reference(moe, x)[0]
        chosen = moe.router(x[0]).argmax(-1)
    kept = torch.zeros(40, dtype=torch.bool)
    for e in range(4):
        kept[(chosen == e).nonzero().flatten()[:3]] = True  # the first 3 tokens of each expert, in token order
    assert 0 < int(kept.sum()) < 40
    assert torch.allclose(y[kept], full[kept], atol=1e-5)
    assert torch.all(y[~kept] == 0)


def test_aux_losses_enter_the_gradient_scaled_like_the_lm_loss() -> None:
    """d/dW of scale * (task + a * lb + b * z), with lb and z written out here by hand, equals what backward of
    scale * task gives once `AddAuxLoss` has injected the block's aux gradient."""
    moe = _moe()
    moe.aux_loss_coef, moe.z_loss_coef = 0.3, 0.05
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(3))
    target = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(4))
    scale = 0.25
    set_aux_grad_scale(moe, scale)
    (scale * (moe(x) - target).square().mean()).backward()
    injected = {n: p.grad.clone() for n, p in moe.named_parameters()}
    stats = pop_moe_stats(moe)

    moe.zero_grad()
    moe.eval()  # no injection: the aux terms are added explicitly below
    task = (moe(x) - target).square().mean()
    logits = moe.router(x.reshape(-1, 16))
    probs = logits.softmax(-1)
    counts = torch.bincount(probs.topk(2, -1).indices.reshape(-1), minlength=4).float()
    lb = 4 * torch.sum(counts / (18 * 2) * probs.mean(0))
    z = torch.logsumexp(logits, -1).square().mean()
    (scale * (task + 0.3 * lb + 0.05 * z)).backward()
    for n, p in moe.named_parameters():
        assert torch.allclose(injected[n], p.grad, atol=1e-6, rtol=1e-5), n
    assert stats["moe_lb_loss"] == pytest.approx(lb.item(), rel=1e-6)
    assert stats["moe_z_loss"] == pytest.approx(z.item(), rel=1e-6)
    assert pop_moe_stats(moe) == {}  # popped: cleared


def _model(name: str = "moe_tiny") -> GPT:
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF / f"{name}.yaml"))
    return GPT(cfg, 64, seed=0)


def _muon_cfg(**kw) -> OptimizerConfig:
    return OmegaConf.structured(OptimizerConfig(name="muon", **kw))


def test_muon_gives_experts_to_expert_muon_and_routers_to_adamw() -> None:
    model = _model()
    opt = build_optimizer(model, _muon_cfg(lr=0.02, aux_lr=0.003))
    assert isinstance(opt, CombinedOptimizer)
    muon, experts, adamw = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(experts, ExpertMuon)
    routers = {id(m.weight) for m in model.modules() if isinstance(m, Router)}
    stacked = {id(p) for m in model.modules() if isinstance(m, MoE) for p in (m.w_gate, m.w_up, m.w_down)}
    assert {id(p) for g in experts.param_groups for p in g["params"]} == stacked
    assert routers <= {id(p) for g in adamw.param_groups for p in g["params"]}
    assert all(p.dim() == 2 for g in muon.param_groups for p in g["params"])
    with_router = build_optimizer(model, _muon_cfg(muon_router=True))
    assert routers <= {id(p) for g in with_router.optimizers[0].param_groups for p in g["params"]}


def test_each_experts_muon_update_is_orthogonal() -> None:
    """Momentum 0, no weight decay: expert e's update is lr_adj * NS5(G_e), singular values near 1 for every e,
    from gradients whose experts differ in scale by 1e4 (a stacked or flattened orthogonalisation would not
    give every expert unit singular values). It also matches torch's Muon run on each expert's matrix alone."""
    gen = torch.Generator().manual_seed(0)
    e, rows, cols = 4, 48, 32
    w = torch.nn.Parameter(torch.randn(e, rows, cols, generator=gen))
    grads = []
    for i in range(e):
        u, _ = torch.linalg.qr(torch.randn(rows, cols, generator=gen))
        v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=gen))
        grads.append((u * torch.logspace(0, 2, cols)) @ v.T * 10.0 ** (2 * i - 4))
    w.grad = torch.stack(grads)
    before = w.detach().clone()
    ExpertMuon([w], lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False, ns_steps=5).step()
    update = (before - w.detach()).double() / max(1.0, rows / cols) ** 0.5
    for i in range(e):
        sv = torch.linalg.svdvals(update[i])
        assert sv.max() / sv.min() < 2.0 and 0.5 < sv.min() and sv.max() < 1.5, i
        single = torch.nn.Parameter(before[i].clone())
        single.grad = w.grad[i].clone()
        torch.optim.Muon([single], lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False, ns_steps=5).step()
        torch.testing.assert_close(w.detach()[i], single.detach(), atol=2e-2, rtol=0)  # bf16 NS rounding
    assert orthogonalize(w.grad, 5).shape == w.shape


_EF = OmegaConf.structured(CompensationConfig(name="ef"))


def test_expert_muon_with_ef_trains_and_round_trips_state() -> None:
    model = _model()
    opt = build_optimizer(model, _muon_cfg(lr=0.02, aux_lr=0.003), compensation=_EF)
    x = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(5))
    loss0 = lm_loss(model(x[:, :-1]), x[:, 1:]).item()
    for _ in range(6):
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    assert lm_loss(model(x[:, :-1]), x[:, 1:]).item() < loss0
    saved = copy.deepcopy(opt.state_dict())
    again = build_optimizer(model, _muon_cfg(lr=0.02, aux_lr=0.003), compensation=_EF)
    again.load_state_dict(saved)
    w = model.layers[1].moe.w_gate
    assert torch.equal(again.state[w]["momentum_buffer"], opt.state[w]["momentum_buffer"])


def test_train_moe_tiny_muon_ef_delay1_learns(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = asyncpipe("train", "model=moe_tiny", "optimizer=muon_ef", "delay=1", "train.steps=40",
                     "train.eval_every=40", f"run.dir={run}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    metrics = read_metrics(run)
    steps = [m for m in metrics if m["step"] > 0]
    assert len(steps) == 40
    assert steps[-1]["val_loss"] < metrics[0]["val_loss"] - 0.5
    assert sum(m["train_loss"] for m in steps[-5:]) < sum(m["train_loss"] for m in steps[:5])
    assert all(0.9 < m["moe_lb_loss"] < 2.0 and m["moe_z_loss"] > 0 for m in steps)  # balanced-ish, logged
