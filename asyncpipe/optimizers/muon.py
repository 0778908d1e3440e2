"""Muon (torch's own `torch.optim.Muon`) on the hidden matrices of the transformer blocks, `ExpertMuon` (the same
step, per expert) on MoE experts' stacked weights, AdamW on the rest (MoE routers too unless
``optimizer.muon_router``).

Embeddings, the output head, norms and biases are not hidden matrices: orthogonalising their updates is not
what Muon is designed for, so they get AdamW at ``aux_lr`` (``lr`` when unset). Both show as one optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from asyncpipe.errors import ConfigError
from asyncpipe.registry import declare_optimizer

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from asyncpipe.optim.registry import HiddenFn

ADJUST_LR_FNS = ("original", "match_rms_adamw")  # torch.optim.Muon; null = original


@dataclass
class MuonConfig:
    momentum: float = 0.95  # Muon momentum
    nesterov: bool = True  # Muon Nesterov momentum
    ns_steps: int = 5  # Muon Newton-Schulz iterations
    adjust_lr_fn: Optional[str] = None  # Muon: None/original or match_rms_adamw
    aux_lr: Optional[float] = None  # AdamW lr for non-matrix params under Muon (None = lr)
    muon_router: bool = False  # Muon: also orthogonalise MoE router weights (default: AdamW at aux_lr)


def check_muon(o: Any, cfg: Any) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    need(o.aux_lr is None or o.aux_lr > 0, f"optimizer.aux_lr={o.aux_lr} must be > 0 (or null = optimizer.lr)")
    need(0 <= o.momentum < 1, f"optimizer.momentum={o.momentum} must be in [0, 1)")
    need(
        o.adjust_lr_fn in (None, "null") + ADJUST_LR_FNS,
        f"optimizer.adjust_lr_fn={o.adjust_lr_fn} is not allowed; choose one of: null, {', '.join(ADJUST_LR_FNS)}",
    )
    need(1 <= o.ns_steps <= 100, f"optimizer.ns_steps={o.ns_steps} must be >= 1 (and <= 100: 5 already converges)")
    need(
        not o.muon_router or cfg.model.moe.experts > 0,
        f"optimizer.muon_router=true does nothing: model '{cfg.model.name}' is dense (no MoE router)",
    )


def muon_bytes(cfg: Any, shapes: list) -> float:
    """One momentum buffer on the hidden matrices and expert stacks (routers with muon_router), AdamW's two on
    the rest."""
    params = sum(s.params for s in shapes)
    router = bool(getattr(cfg.optimizer, "muon_router", False))
    hidden = sum(s.hidden + (s.router if router else 0) for s in shapes)
    return 4.0 * (hidden + 2 * (params - hidden))


@declare_optimizer("muon", memory=muon_bytes, config=MuonConfig, check=check_muon)
def build_muon(module: nn.Module, cfg: Any, hidden: Optional[HiddenFn]) -> torch.optim.Optimizer:
    import torch

    from asyncpipe.optim.combined import CombinedOptimizer
    from asyncpipe.optim.expert_muon import ExpertMuon
    from asyncpipe.optim.registry import block_matrices, decay_groups, trainable

    adjust = cfg.adjust_lr_fn  # values checked by asyncpipe.config.validate
    is_hidden = (
        hidden if hidden is not None else block_matrices(module, routers=bool(getattr(cfg, "muon_router", False)))
    )
    named = trainable(module)
    matrices = [(n, p) for n, p in named if p.dim() == 2 and is_hidden(n, p)]
    experts = [(n, p) for n, p in named if p.dim() == 3 and is_hidden(n, p)]
    taken = {id(p) for _, p in matrices + experts}
    rest = [(n, p) for n, p in named if id(p) not in taken]
    optimizers: list[torch.optim.Optimizer] = []
    if matrices:
        group = {"params": [p for _, p in matrices], "lr": cfg.lr, "base_lr": cfg.lr, "group": "muon"}
        optimizers.append(
            torch.optim.Muon(
                [group],
                lr=cfg.lr,
                weight_decay=cfg.weight_decay,
                momentum=cfg.momentum,
                nesterov=cfg.nesterov,
                ns_steps=cfg.ns_steps,
                adjust_lr_fn=adjust,
            )
        )
    if experts:  # MoE experts: each expert's matrix orthogonalised on its own, batched over experts
        group = {"params": [p for _, p in experts], "lr": cfg.lr, "base_lr": cfg.lr, "group": "muon_experts"}
        optimizers.append(
            ExpertMuon(
                [group],
                lr=cfg.lr,
                weight_decay=cfg.weight_decay,
                momentum=cfg.momentum,
                nesterov=cfg.nesterov,
                ns_steps=cfg.ns_steps,
                adjust_lr_fn=adjust,
            )
        )
    if rest:
        aux_lr = cfg.aux_lr if cfg.aux_lr is not None else cfg.lr
        groups = decay_groups(rest, aux_lr, cfg.weight_decay)
        for g in groups:
            g["group"] = "aux_" + g["group"]
        optimizers.append(
            torch.optim.AdamW(groups, lr=aux_lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
        )
    return CombinedOptimizer(optimizers)
