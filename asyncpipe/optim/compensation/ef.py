"""EF, the paper's correction (Zmushko et al. 2026, "One-Step Gradient Delay is Not a Barrier for Large-Scale
Asynchronous Pipeline Parallel LLM Pretraining"), with lambda as a schedule.

Update rule, with u(t) the wrapped optimizer's own weight change from the stale gradient g(W(t-k)):

    x(t+1) = x(t) - u(t) - lam(t) * (u(t) - u(t-1))

i.e. the paper's x(t+1) = x(t) - u(t-1) - lam (u(t-1) - u(t-2)) with its update indexed by the gradient's step.
For SGD, u(t) - u(t-1) = lr (g(x(t-1)) - g(x(t-2))) ~ lr H (x(t-1) - x(t-2)): with lam = 1 the applied step is a
first-order estimate of lr g(x(t)), the fresh gradient. ``schedule=constant``: lam(t) = lam;
``schedule=warmup``: lam(t) = lam * min(1, (t + 1) / warmup_steps), so the correction grows in as the early,
large and erratic updates settle. The maths is `asyncpipe.optim.ef.ErrorFeedback` (``optimizer=adamw_ef`` /
``muon_ef`` build the same object with a constant lam). Memory: one parameter-sized buffer, u(t-1).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from asyncpipe.errors import UserError
from asyncpipe.optim.compensation.registry import register
from asyncpipe.optim.ef import ErrorFeedback

SCHEDULES = ("constant", "warmup")


def lam_schedule(lam: float, schedule: str, warmup_steps: int) -> Callable[[int], float]:
    """lambda at optimizer step t (0-based)."""
    if schedule == "constant":
        return lambda t: lam
    if schedule == "warmup":
        if warmup_steps < 1:
            raise UserError(f"compensation.ef.warmup_steps={warmup_steps} must be >= 1 with schedule=warmup")
        return lambda t: lam * min(1.0, (t + 1) / warmup_steps)
    raise UserError(f"compensation.ef.schedule={schedule} is not allowed; choose one of: {', '.join(SCHEDULES)}")


@register("ef", fits_2bw=True, note="one parameter-sized buffer u(t-1) (optimizer state, no weight version)")
def build_ef(optimizer: torch.optim.Optimizer, cfg: Any, delays: Mapping[torch.Tensor, int]) -> torch.optim.Optimizer:
    c = cfg.ef
    at = lam_schedule(c.lam, c.schedule, c.warmup_steps)
    return ErrorFeedback(optimizer, c.lam, lam_at=None if c.schedule == "constant" else at)
