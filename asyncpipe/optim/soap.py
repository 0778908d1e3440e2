"""SOAP (Adam in the eigenbasis of Shampoo's preconditioner) from the ``pytorch-optimizer`` package.

Its first step only initialises the preconditioner and leaves the weights unchanged; the eigenbasis is
refreshed every 10 steps (the package default). Matrices get weight decay, norms and biases do not.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from asyncpipe.optim.registry import HiddenFn, decay_groups, register, trainable


@register("soap")
def build_soap(module: nn.Module, cfg: Any, hidden: Optional[HiddenFn]) -> torch.optim.Optimizer:
    from pytorch_optimizer import SOAP

    groups = decay_groups(trainable(module), cfg.lr, cfg.weight_decay)
    return SOAP(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
