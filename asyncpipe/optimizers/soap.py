"""SOAP (Adam in the eigenbasis of Shampoo's preconditioner) from the ``pytorch-optimizer`` package.

Its first step only initialises the preconditioner and leaves the weights unchanged; the eigenbasis is
refreshed every 10 steps (the package default). Matrices get weight decay, norms and biases do not.
State: Adam's two buffers, plus G G^T and its eigenbasis (n x n each) per dimension n <= 10000 of every 2+-D
tensor (the package's max_precond_dim; `tests/test_plan.py` compares this with what it allocates).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from asyncpipe.registry import declare_optimizer

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from asyncpipe.optim.registry import HiddenFn

MAX_PRECOND_DIM = 10000  # pytorch-optimizer's default


def soap_bytes(cfg: Any, shapes: list) -> float:
    params = sum(s.params for s in shapes)
    precond = sum(
        2 * c * sum(n * n for n in shape if n <= MAX_PRECOND_DIM) for s in shapes for c, shape, _ in s.tensors
    )
    return 4.0 * (2 * params + precond)


@declare_optimizer("soap", memory=soap_bytes)
def build_soap(module: nn.Module, cfg: Any, hidden: Optional[HiddenFn]) -> torch.optim.Optimizer:
    from pytorch_optimizer import SOAP

    from asyncpipe.optim.registry import decay_groups, trainable

    groups = decay_groups(trainable(module), cfg.lr, cfg.weight_decay)
    return SOAP(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
