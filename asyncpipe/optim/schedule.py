"""The learning-rate schedule shared by both engines: linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math

from asyncpipe.errors import UserError


def lr_factor(step: int, total_steps: int, warmup_frac: float = 0.1, min_lr_frac: float = 0.1) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based) of ``total_steps``.

    Warm-up: (step + 1) / W over the first W = floor(warmup_frac * total_steps) steps (never 0 at step 0);
    then a cosine from 1 at step W down to ``min_lr_frac`` at the last step, ``total_steps - 1``.
    """
    if total_steps < 1:
        raise UserError(f"train.steps={total_steps} must be >= 1")
    if not 0 <= warmup_frac <= 1:
        raise UserError(f"train.warmup_frac={warmup_frac} must be in [0, 1]")
    if not 0 <= min_lr_frac <= 1:
        raise UserError(f"train.min_lr_frac={min_lr_frac} must be in [0, 1]")
    warmup = int(warmup_frac * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, max(0.0, (step - warmup) / max(1, total_steps - 1 - warmup)))
    return min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress))
