"""NAdam (torch) with decoupled weight decay: Nesterov momentum looks one step ahead, which is why it is a
natural baseline against gradient staleness (the shipped config uses beta1 = 0.99). State: two fp32 buffers per
parameter (torch's per-parameter mu_product is a scalar)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from asyncpipe.errors import ConfigError
from asyncpipe.optimizers.adamw import adam_bytes
from asyncpipe.registry import declare_optimizer

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from asyncpipe.optim.registry import HiddenFn


@dataclass
class NAdamConfig:
    momentum_decay: float = 0.004  # NAdam momentum decay psi


def check_nadam(o: Any, cfg: Any) -> None:
    if not 0 <= o.momentum_decay <= 1:
        raise ConfigError(f"optimizer.momentum_decay={o.momentum_decay} must be in [0, 1] (torch's default 0.004)")


@declare_optimizer("nadam", memory=adam_bytes, config=NAdamConfig, check=check_nadam)
def build_nadam(module: nn.Module, cfg: Any, hidden: Optional[HiddenFn]) -> torch.optim.Optimizer:
    import torch

    from asyncpipe.optim.registry import decay_groups, trainable

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
