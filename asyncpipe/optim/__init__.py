"""Optimisation for delayed (asynchronous-pipeline) training, the torch side: building the declared optimizer
(`build_optimizer`; the built-ins AdamW, Muon + AdamW, NAdam, SOAP are declared, torch-free, in
`asyncpipe.optimizers`), stale weights for a k-step delay, the staleness mitigations' update rules (`compensation`:
EF and the rest, wrapping any optimizer; declared in `asyncpipe.compensation`), clipping, the one update, and the lr
schedule (`asyncpipe.lr_schedule`, re-exported). Only a run that builds an optimizer imports this package."""

from asyncpipe.lr_schedule import LRSchedule, lr_factor
from asyncpipe.optim.clip import clip_grads, grad_sq_norm
from asyncpipe.optim.compensation import compensate_grads, forward_weights
from asyncpipe.optim.combined import CombinedOptimizer
from asyncpipe.optim.delay import DelayedWeights, delays_for
from asyncpipe.optim.compensation.ef import ErrorFeedback
from asyncpipe.optim.registry import available, block_matrices, build_optimizer, register
from asyncpipe.optim.update import apply_update, set_lr

__all__ = [
    "CombinedOptimizer",
    "apply_update",
    "set_lr",
    "DelayedWeights",
    "ErrorFeedback",
    "LRSchedule",
    "available",
    "block_matrices",
    "build_optimizer",
    "clip_grads",
    "compensate_grads",
    "forward_weights",
    "delays_for",
    "grad_sq_norm",
    "lr_factor",
    "register",
]
