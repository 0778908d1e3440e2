"""AdamW (torch) with nanoGPT's decay split: the default optimizer. State: two fp32 buffers per parameter."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from asyncpipe.optim.registry import HiddenFn, adam_bytes, decay_groups, trainable
from asyncpipe.registry import declare_optimizer


@declare_optimizer("adamw", memory=adam_bytes)
def build_adamw(module: nn.Module, cfg: Any, hidden: Optional[HiddenFn]) -> torch.optim.Optimizer:
    groups = decay_groups(trainable(module), cfg.lr, cfg.weight_decay)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
