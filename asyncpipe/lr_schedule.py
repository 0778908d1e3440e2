"""The learning-rate schedule both engines apply (`train.lr_schedule`), as plain arithmetic: config checks and the
sweep's budget families read it too, so it imports neither torch nor the optimizers.

- ``cosine`` (the paper's recipe, the default): linear warm-up, then a cosine from the peak down to
  ``min_lr_frac`` at the last step.
- ``wsd`` (warmup-stable-decay): linear warm-up over ``warmup_steps``, the peak lr held, then a linear decay to
  ``min_lr_frac`` over the last ``decay_frac`` of the steps. Warm-up and the stable phase do not depend on
  ``train.steps``, so runs of different lengths share every step before their own decay starts: a longer run's
  checkpoint at a shorter run's decay start is that run's state (`asyncpipe sweep`'s ``budgets:``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

from asyncpipe.errors import UserError

SCHEDULES = ("cosine", "wsd")


@dataclass(frozen=True)
class LRSchedule:
    """The multiplier of the peak lr at each optimizer step of one run (`factor`), and where its decay starts."""

    kind: str  # cosine or wsd
    steps: int  # train.steps
    warmup: int  # warm-up steps
    min_lr_frac: float = 0.1  # the lr at the last step, as a fraction of the peak
    decay_frac: float = 0.2  # wsd: share of the steps in the final decay

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise UserError(f"train.lr_schedule={self.kind} is not allowed; choose one of: {', '.join(SCHEDULES)}")
        if self.steps < 1:
            raise UserError(f"train.steps={self.steps} must be >= 1")
        if not 0 <= self.min_lr_frac <= 1:
            raise UserError(f"train.min_lr_frac={self.min_lr_frac} must be in [0, 1]")
        if not 0 < self.decay_frac < 1:
            raise UserError(f"train.decay_frac={self.decay_frac} must be in (0, 1)")
        if not 0 <= self.warmup <= self.steps:
            raise UserError(
                f"the warm-up of {self.warmup} steps (train.warmup_steps, or warmup_frac x steps) is longer "
                f"than train.steps={self.steps}"
            )
        if self.warmup > self.decay_start:
            raise UserError(
                f"the warm-up of {self.warmup} steps (train.warmup_steps) runs past the wsd decay start, "
                f"step {self.decay_start} of train.steps={self.steps} (train.decay_frac={self.decay_frac:g}); "
                "shorten the warm-up or lower train.decay_frac"
            )

    @classmethod
    def of(cls, train: Any) -> "LRSchedule":
        """The schedule of a run's ``train`` config node (``warmup_steps`` unset: ``warmup_frac`` of the steps)."""
        warmup_steps: Optional[int] = getattr(train, "warmup_steps", None)
        warmup = int(warmup_steps) if warmup_steps is not None else int(train.warmup_frac * train.steps)
        return cls(
            str(getattr(train, "lr_schedule", "cosine")),
            int(train.steps),
            warmup,
            float(train.min_lr_frac),
            float(getattr(train, "decay_frac", 0.2)),
        )

    def at_steps(self, steps: int) -> "LRSchedule":
        """The same schedule for a run of ``steps`` (wsd: the same warm-up and stable phase, its own decay)."""
        return dataclasses.replace(self, steps=steps)

    @property
    def decay_steps(self) -> int:
        """wsd: round(decay_frac x steps), at least 1; cosine decays over every step after the warm-up."""
        if self.kind == "wsd":
            return max(1, round(self.decay_frac * self.steps))
        return self.steps - self.warmup

    @property
    def decay_start(self) -> int:
        """The first step whose lr is below the peak after the warm-up: the steps before it do not depend on
        ``steps`` for wsd (a checkpoint after ``decay_start`` steps is where a shorter run branches off)."""
        return self.steps - self.decay_steps

    def factor(self, step: int) -> float:
        """Multiplier of the peak lr at optimizer step ``step`` (0-based).

        Warm-up: (step + 1) / W over the first W steps (never 0 at step 0). cosine: from 1 at step W down to
        ``min_lr_frac`` at the last step, ``steps - 1``. wsd: 1 until ``decay_start`` S, then
        1 - (1 - min_lr_frac) (step - S + 1) / D over the D = ``decay_steps`` last steps (``min_lr_frac`` at the last).
        """
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "wsd":
            if step < self.decay_start:
                return 1.0
            done = min(1.0, (step - self.decay_start + 1) / self.decay_steps)
            return 1.0 - (1.0 - self.min_lr_frac) * done
        progress = min(1.0, max(0.0, (step - self.warmup) / max(1, self.steps - 1 - self.warmup)))
        return self.min_lr_frac + (1 - self.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress))


def lr_factor(step: int, total_steps: int, warmup_frac: float = 0.1, min_lr_frac: float = 0.1) -> float:
    """The cosine schedule's multiplier at ``step`` of ``total_steps`` with a ``warmup_frac`` warm-up."""
    if not 0 <= warmup_frac <= 1:
        raise UserError(f"train.warmup_frac={warmup_frac} must be in [0, 1]")
    if total_steps < 1:
        raise UserError(f"train.steps={total_steps} must be >= 1")
    return LRSchedule("cosine", total_steps, int(warmup_frac * total_steps), min_lr_frac).factor(step)
