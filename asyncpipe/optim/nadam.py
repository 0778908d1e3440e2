"""NAdam (torch) with decoupled weight decay: Nesterov momentum looks one step ahead, which is why it is a
natural baseline against gradient staleness (the shipped config uses beta1 = 0.99)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from asyncpipe.optim.registry import HiddenFn, decay_groups, register, trainable


@register("nadam")
def build_nadam(module: nn.Module, cfg: Any, hidden: Optional[HiddenFn]) -> torch.optim.Optimizer:
    groups = decay_groups(trainable(module), cfg.lr, cfg.weight_decay)
    return torch.optim.NAdam(
        groups,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        momentum_decay=cfg.momentum_decay,
        decoupled_weight_decay=True,
    )
