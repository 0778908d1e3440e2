"""EF, the paper's correction (Zmushko et al. 2026, "One-Step Gradient Delay is Not a Barrier for Large-Scale
Asynchronous Pipeline Parallel LLM Pretraining"), with lambda as a schedule.

Update rule, with u(t) the wrapped optimizer's own weight change from the stale gradient g(W(t-k)):

    x(t+1) = x(t) - u(t) - lam(t) * (u(t) - u(t-1))

i.e. the paper's x(t+1) = x(t) - u(t-1) - lam (u(t-1) - u(t-2)) with its update indexed by the gradient's step.
For SGD, u(t) - u(t-1) = lr (g(x(t-1)) - g(x(t-2))) ~ lr H (x(t-1) - x(t-2)): with lam = 1 the applied step is a
first-order estimate of lr g(x(t)), the fresh gradient. ``schedule=constant``: lam(t) = lam;
``schedule=warmup``: lam(t) = lam * min(1, (t + 1) / warmup_steps), so the correction grows in as the early,
large and erratic updates settle. The maths is `asyncpipe.optim.ef.ErrorFeedback`. This is EF's one home: the
``adamw_ef`` / ``muon_ef`` presets' ``optimizer.ef.enabled=true`` (and that override in sweep files and run
records) runs this method with lam = ``optimizer.ef.lam`` and a constant schedule
(`asyncpipe.registry.effective_compensation`). Memory: u(t-1) plus the step's snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from asyncpipe.errors import ConfigError, UserError
from asyncpipe.optim.compensation.registry import register
from asyncpipe.optim.ef import ErrorFeedback

SCHEDULES = ("constant", "warmup")


@dataclass
class EFCompensation:
    lam: float = 1.0  # EF strength lambda (>= 0): x -= u(t-1) + lam * (u(t-1) - u(t-2))
    schedule: str = "constant"  # constant, or warmup: lam * min(1, (t+1) / warmup_steps)
    warmup_steps: int = 0  # steps of the linear lambda warm-up (schedule=warmup)


def check_ef(c: Any, cfg: Any) -> None:
    if c.lam < 0:
        raise ConfigError(f"compensation.ef.lam={c.lam} must be >= 0")
    if c.schedule not in SCHEDULES:
        raise ConfigError(f"compensation.ef.schedule={c.schedule} is not allowed; choose one of: {', '.join(SCHEDULES)}")
    if c.warmup_steps < 0 or (c.schedule == "warmup" and c.warmup_steps < 1):
        raise ConfigError(f"compensation.ef.warmup_steps={c.warmup_steps} must be >= 1 with schedule=warmup (>= 0 always)")


def lam_schedule(lam: float, schedule: str, warmup_steps: int) -> Callable[[int], float]:
    """lambda at optimizer step t (0-based)."""
    if schedule == "constant":
        return lambda t: lam
    if schedule == "warmup":
        if warmup_steps < 1:
            raise UserError(f"compensation.ef.warmup_steps={warmup_steps} must be >= 1 with schedule=warmup")
        return lambda t: lam * min(1.0, (t + 1) / warmup_steps)
    raise UserError(f"compensation.ef.schedule={schedule} is not allowed; choose one of: {', '.join(SCHEDULES)}")


@register("ef", fits_2bw=True, note="one parameter-sized buffer u(t-1) (optimizer state, no weight version)",
          buffers=2, key="ef", config=EFCompensation, check=check_ef)
def build_ef(optimizer: torch.optim.Optimizer, cfg: Any, delays: Mapping[torch.Tensor, int]) -> torch.optim.Optimizer:
    c = cfg.ef
    at = lam_schedule(c.lam, c.schedule, c.warmup_steps)
    return ErrorFeedback(optimizer, c.lam, lam_at=None if c.schedule == "constant" else at)
