"""AdamW (torch) with nanoGPT's decay split: the default optimizer."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from asyncpipe.optim.registry import HiddenFn, decay_groups, register, trainable


@register("adamw")
def build_adamw(module: nn.Module, cfg: Any, hidden: Optional[HiddenFn]) -> torch.optim.Optimizer:
    groups = decay_groups(trainable(module), cfg.lr, cfg.weight_decay)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
