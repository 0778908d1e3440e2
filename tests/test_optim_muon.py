"""The optimizer registry: Muon gets exactly the blocks' hidden matrices and orthogonalises their updates;
every shipped optimizer YAML composes and builds."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from omegaconf import OmegaConf

from asyncpipe.config.compose import compose
from asyncpipe.config.schema import ModelConfig, OptimizerConfig
from asyncpipe.errors import UserError
from asyncpipe.model import GPT, Block, lm_loss
from asyncpipe.optim import CombinedOptimizer, ErrorFeedback, available, build_optimizer

CONF = Path(__file__).resolve().parents[1] / "conf" / "optimizer"
VOCAB = 32


def _gpt(tie: bool = False) -> GPT:
    cfg = OmegaConf.structured(ModelConfig(name="t", n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64))
    cfg.tie_embeddings = tie
    return GPT(cfg, VOCAB, seed=0)


def _opt_cfg(name: str, **kw) -> OptimizerConfig:
    return OmegaConf.structured(OptimizerConfig(name=name, **kw))


def _ids(params) -> set[int]:
    return {id(p) for p in params}


@pytest.mark.parametrize("tie", [False, True])
def test_muon_takes_exactly_the_block_matrices(tie: bool) -> None:
    model = _gpt(tie)
    opt = build_optimizer(model, _opt_cfg("muon", lr=0.02, aux_lr=0.003))
    assert isinstance(opt, CombinedOptimizer)
    muon, adamw = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    expected = {id(p) for m in model.modules() if isinstance(m, Block) for p in m.parameters() if p.dim() == 2}
    assert len(expected) == 2 * 7  # q, k, v, o, gate, up, down per block
    got_muon = [p for g in muon.param_groups for p in g["params"]]
    got_adamw = [p for g in adamw.param_groups for p in g["params"]]
    assert _ids(got_muon) == expected
    # Everything else (embedding, head, norms) goes to AdamW, each parameter exactly once.
    assert len(got_muon) + len(got_adamw) == len(list(model.parameters()))
    assert _ids(got_muon) | _ids(got_adamw) == _ids(model.parameters())
    assert model.layers[0].weight in [p for p in got_adamw]
    for g in adamw.param_groups:
        assert g["base_lr"] == g["lr"] == 0.003
        assert g["weight_decay"] == (0.1 if all(p.dim() >= 2 for p in g["params"]) else 0.0)
    assert muon.param_groups[0]["base_lr"] == 0.02


def test_hidden_predicate_overrides_and_stage_without_blocks() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    opt = build_optimizer(model, _opt_cfg("muon"), hidden=lambda name, p: name == "0.weight")
    assert [p for g in opt.optimizers[0].param_groups for p in g["params"]] == [model[0].weight]
    # A module with no Block (e.g. a head-only stage) is all AdamW.
    opt = build_optimizer(model, _opt_cfg("muon"))
    assert [type(o) for o in opt.optimizers] == [torch.optim.AdamW]


def _planted_grad(shape: torch.Size, cond: float, gen: torch.Generator) -> torch.Tensor:
    m, n = shape
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=gen))
    return (u * torch.logspace(0, torch.log10(torch.tensor(cond)).item(), k)) @ v.T


def test_muon_update_is_orthogonalised() -> None:
    """With momentum 0 and no weight decay, the update is lr_adj * NS5(G): singular values all near 1.

    torch's quintic Newton-Schulz (Keller Jordan's coefficients) lands singular values in about [0.7, 1.2],
    not exactly 1; measured max/min ratio about 1.76 for a gradient of condition number 100 (2 NS steps: ~28).
    """
    gen = torch.Generator().manual_seed(0)
    block = Block(64, 4, 2, 176, 1e4, 1e-5)
    cfg = _opt_cfg("muon", lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False, ns_steps=5)
    opt = build_optimizer(block, cfg)
    for p in block.parameters():
        p.grad = _planted_grad(p.shape, 100.0, gen) if p.dim() == 2 else torch.randn(p.shape, generator=gen)
    before = {n: p.detach().clone() for n, p in block.named_parameters()}
    opt.step()
    for name, p in block.named_parameters():
        if p.dim() != 2:
            continue
        rows, cols = p.shape
        update = (before[name] - p.detach()).double() / max(1.0, rows / cols) ** 0.5  # undo torch's shape scaling
        sv = torch.linalg.svdvals(update)
        assert sv.max() / sv.min() < 2.0, name
        assert 0.5 < sv.min() and sv.max() < 1.5, name
        g_sv = torch.linalg.svdvals(p.grad.double())
        assert g_sv.max() / g_sv.min() > 50  # the input really was ill-conditioned


def test_registry_and_unknown_name() -> None:
    assert {"adamw", "muon", "nadam", "soap"} <= set(available())
    with pytest.raises(UserError, match="choose one of"):
        build_optimizer(_gpt(), _opt_cfg("sgdd"))


def test_adamw_decay_split() -> None:
    model = _gpt()
    opt = build_optimizer(model, _opt_cfg("adamw", weight_decay=0.1))
    assert isinstance(opt, torch.optim.AdamW)
    for g in opt.param_groups:
        dims = {p.dim() for p in g["params"]}
        assert g["weight_decay"] == (0.1 if min(dims) >= 2 else 0.0)
        assert dims <= {2} or dims == {1}


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 0) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (4, 17), generator=gen)
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", sorted(p.stem for p in CONF.glob("*.yaml")))
def test_every_optimizer_yaml_composes_and_trains(name: str) -> None:
    full = compose([f"optimizer={name}"])
    cfg = full.optimizer
    OmegaConf.merge(OmegaConf.structured(OptimizerConfig), cfg)  # only schema keys
    model = _gpt()
    opt = build_optimizer(model, cfg, compensation=full.compensation)
    assert isinstance(opt, torch.optim.Optimizer)
    # the *_ef presets' switch is an alias, resolved at composition into compensation=ef
    assert isinstance(opt, ErrorFeedback) == name.endswith("_ef") == (full.compensation.name == "ef")
    assert not cfg.ef.enabled
    assert all("base_lr" in g for g in opt.param_groups)
    start = copy.deepcopy(model.state_dict())
    x = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(5))
    loss0 = lm_loss(model(x[:, :-1]), x[:, 1:]).item()
    for _ in range(8):  # one fixed batch: every optimizer must fit it a little
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert lm_loss(model(x[:, :-1]), x[:, 1:]).item() < loss0
    assert any(not torch.equal(start[k], v) for k, v in model.state_dict().items())


def test_ef_yamls_are_their_base_plus_ef() -> None:
    for base in ("adamw", "muon"):
        plain, ef = compose([f"optimizer={base}"]), compose([f"optimizer={base}_ef"])
        assert ef.optimizer == plain.optimizer  # the switch is resolved: the optimizer is the plain one
        assert (ef.compensation.name, ef.compensation.ef.lam, ef.compensation.ef.schedule) == ("ef", 1.0, "constant")
        assert plain.compensation.name == "none"


def test_combined_state_dict_round_trip_and_shared_groups() -> None:
    model = _gpt()
    opt = build_optimizer(model, _opt_cfg("muon", lr=0.02, aux_lr=0.003))
    _train(model, opt, 3, seed=1)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    _train(model, opt, 3, seed=2)

    model2 = _gpt()
    opt2 = build_optimizer(model2, _opt_cfg("muon", lr=0.02, aux_lr=0.003))
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    _train(model2, opt2, 3, seed=2)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    # After loading, setting a group's lr still reaches the inner optimizer that owns the group.
    opt2.param_groups[0]["lr"] = 0.123
    assert opt2.optimizers[0].param_groups[0]["lr"] == 0.123
    assert opt2.state[model2.layers[1].q.weight]["momentum_buffer"].shape == (32, 32)
