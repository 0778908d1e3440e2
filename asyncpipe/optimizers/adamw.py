"""AdamW (torch) with nanoGPT's decay split: the default optimizer. State: two fp32 buffers per parameter."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from asyncpipe.registry import declare_optimizer

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from asyncpipe.optim.registry import HiddenFn


def adam_bytes(cfg: Any, shapes: list) -> float:
    """Memory model of Adam-like state: two fp32 buffers per parameter."""
    return 4.0 * 2 * sum(s.params for s in shapes)


@declare_optimizer("adamw", memory=adam_bytes)
def build_adamw(module: nn.Module, cfg: Any, hidden: Optional[HiddenFn]) -> torch.optim.Optimizer:
    import torch

    from asyncpipe.optim.registry import decay_groups, trainable

    groups = decay_groups(trainable(module), cfg.lr, cfg.weight_decay)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
