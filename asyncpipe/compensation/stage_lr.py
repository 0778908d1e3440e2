"""``compensation=stage_lr``: PipeMare's stage-wise learning rate, a k-step-stale parameter's lr divided by k to a
power that anneals to 0 (Yang et al., MLSys 2021); its settings, value checks and memory (no buffer). The rule:
`asyncpipe.optim.compensation.stage_lr`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncpipe.errors import ConfigError
from asyncpipe.registry import declare_method

MAX_POWER = 4.0  # 1 in the sources; lr / k^4 already divides a 3-step-stale stage's lr by 81


@dataclass
class StageLRCompensation:
    power: float = 1.0  # p(0): lr of a parameter with delay k >= 1 divided by k ** p(t) (PipeMare)
    anneal_steps: int = 0  # > 0: p(t) reaches 0 after these steps (overrides anneal_frac)
    anneal_frac: float = 0.14  # p(t) reaches 0 after this share of run_steps (0 with anneal_steps 0: p constant)
    run_steps: int = 0  # the run's train.steps (the YAML interpolates it; 0 = unknown)


def check_stage_lr(c: Any, cfg: Any) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    need(
        0 <= c.power <= MAX_POWER,
        f"compensation.stage_lr.power={c.power:g} must be in [0, {MAX_POWER:g}] (1 = "
        "PipeMare's: a k-step-stale parameter's lr is divided by k^power)",
    )
    need(c.anneal_steps >= 0, f"compensation.stage_lr.anneal_steps={c.anneal_steps} must be >= 0")
    need(0 <= c.anneal_frac <= 1, f"compensation.stage_lr.anneal_frac={c.anneal_frac} must be in [0, 1]")


declare_method(
    "stage_lr",
    build="asyncpipe.optim.compensation.stage_lr:build_stage_lr",
    fits_2bw=True,
    note="no buffer; under 2BW's uniform delay of 1 it changes nothing",
    buffers=0,
    key="stage_lr",
    config=StageLRCompensation,
    check=check_stage_lr,
    needs_delay=True,
    revision=2,
)  # r1 (to 262fe8d): lr / (1 + k) for the whole run (asyncpipe.report.revisions)
