"""Muon (torch's own `torch.optim.Muon`) on the hidden matrices of the transformer blocks, `ExpertMuon` (the same
step, per expert) on MoE experts' stacked weights, AdamW on the rest (MoE routers too unless
``optimizer.muon_router``).

Embeddings, the output head, norms and biases are not hidden matrices: orthogonalising their updates is not
what Muon is designed for, so they get AdamW at ``aux_lr`` (``lr`` when unset). Both show as one optimizer.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from asyncpipe.optim.combined import CombinedOptimizer
from asyncpipe.optim.expert_muon import ExpertMuon
from asyncpipe.optim.registry import HiddenFn, block_matrices, decay_groups, register, trainable


@register("muon")
def build_muon(module: nn.Module, cfg: Any, hidden: Optional[HiddenFn]) -> torch.optim.Optimizer:
    adjust = cfg.adjust_lr_fn  # values checked by asyncpipe.config.validate
    is_hidden = hidden if hidden is not None else block_matrices(module, routers=bool(getattr(cfg, "muon_router", False)))
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
            ExpertMuon([group], lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum,
                       nesterov=cfg.nesterov, ns_steps=cfg.ns_steps, adjust_lr_fn=adjust)  # fmt: skip
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
