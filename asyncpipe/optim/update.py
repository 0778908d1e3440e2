"""One optimizer update, the sequence both engines run after a batch's gradients are in (and averaged over
replicas): clip, compensate for staleness, the engine's weight bookkeeping, the lr of this step, the step, zero
the gradients. The simulator (`engines.simulator`) and the pipeline engine (`engines.pipeline.deepspeed_engine`)
differ only in what they pass: which parameters clip together and by which norm, the stale weights, and what
happens to their weight versions around the step."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Optional, Union

import torch

from asyncpipe.lr_schedule import LRSchedule
from asyncpipe.optim.clip import clip_grads
from asyncpipe.optim.compensation import compensate_grads

Norm = Optional[Union[float, torch.Tensor]]


def set_lr(optimizer: torch.optim.Optimizer, schedule: LRSchedule, step: int) -> None:
    """Every group's lr at optimizer step ``step`` (0-based): its base lr times the schedule's factor."""
    scale = schedule.factor(step)
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * scale


def apply_update(
    optimizer: torch.optim.Optimizer,
    step: int,
    lr: LRSchedule,
    max_norm: float,
    clip_groups: Sequence[tuple[Sequence[torch.Tensor], Norm]],
    stale: Mapping[torch.Tensor, torch.Tensor],
    before_step: Optional[Callable[[], None]] = None,
    after_step: Optional[Callable[[], None]] = None,
) -> list[torch.Tensor]:
    """Clip each group (its parameters, and its norm when already known, e.g. all-reduced across stages; None:
    computed here) to ``max_norm``, apply the compensation method with the weights the gradients were taken at
    (``stale``), run ``before_step`` (the engine's version bookkeeping), set the lr of ``step``, step, zero the
    gradients, run ``after_step``. Returns each group's pre-clip norm (0-dim tensors on the device: read
    them when recording)."""
    norms = [clip_grads(params, max_norm, total_norm=norm) for params, norm in clip_groups]
    compensate_grads(optimizer, stale)
    if before_step is not None:
        before_step()
    set_lr(optimizer, lr, step)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if after_step is not None:
        after_step()
    return norms
