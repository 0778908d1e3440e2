"""Stage-wise learning rate: PipeMare's learning-rate rescheduling (Yang et al., MLSys 2021, "PipeMare:
Asynchronous Pipeline Parallel DNN Training", technique 1), as both reference codebases run it: the PipeDream-LR
baseline of Jung, Shin & Lee (ICML 2026, LOG-postech/basis-rotation) and of Ajanthan et al. (ICML 2025,
PluralisResearch/AsyncPP), each in ``main_with_runtime.py``'s ``adjust_learning_rate`` under ``--lr_correction``.

A parameter whose stage is k steps stale (k = num_versions - 1 there; with delay_profile=pipedream, stage s of P
has k = P-1-s) takes its lr divided by k to a power that anneals linearly from ``power`` (1 in the sources) to 0:

    lr_k(t) = lr(t) / k ** p(t),   p(t) = power * (1 - min((t + 1) / T, 1))      (k >= 1; t = 0-based step)

so the most stale stages start with the smallest steps and every stage is back at the scheduled lr after T steps.
k = 0 and k = 1 keep the lr (k ** p = 1; the sources skip stages with one weight version). With u(t) the wrapped
optimizer's update (lr and decoupled weight decay included), the applied step is u(t) / k ** p(t).

T, the annealing length: the sources use ``--lr_correction_epoch`` (default 7) epochs, a fixed length rather than
the whole run; AsyncPP's training script runs 50 epochs, so T is 14% of that run, which is asyncpipe's default
``anneal_frac = 0.14`` of ``run_steps`` (= train.steps, interpolated by the YAML). ``anneal_steps > 0`` sets T in
steps instead; T = 0 (both 0) keeps p = power for the whole run.

Departures: none in the rule. The sources rescale the whole stage's lr; here it is per parameter, which is the
same thing because a stage's parameters share k. Under a uniform delay (the 2BW engine, delay=1) k = 1 for every
parameter and the method does nothing; it is meant for delay_profile=pipedream. Memory: no buffer (one transient
snapshot of the rescaled parameters per step).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from asyncpipe.errors import UserError
from asyncpipe.optim.compensation.base import Compensated


def anneal_length(anneal_steps: int, anneal_frac: float, run_steps: int) -> int:
    """T, the step at which p(t) reaches 0: ``anneal_steps`` if > 0, else ``anneal_frac`` of ``run_steps``
    (at least 1 step when the fraction is > 0); 0 = no annealing."""
    if anneal_steps < 0 or not 0 <= anneal_frac <= 1:
        raise UserError(
            f"compensation.stage_lr needs anneal_steps >= 0 and 0 <= anneal_frac <= 1, got {anneal_steps}, {anneal_frac}"
        )
    if anneal_steps > 0 or anneal_frac == 0:
        return int(anneal_steps)
    if run_steps < 1:
        raise UserError(
            "compensation.stage_lr.anneal_frac needs run_steps (the YAML sets it to train.steps) or anneal_steps > 0"
        )
    return max(1, round(anneal_frac * run_steps))


class StageLR(Compensated):
    name = "stage_lr"

    def __init__(
        self, optimizer: torch.optim.Optimizer, delays: Mapping[torch.Tensor, int], power: float, anneal: int
    ) -> None:
        if power < 0 or anneal < 0:
            raise UserError("compensation.stage_lr.power and the annealing length must be >= 0")
        super().__init__(optimizer, delays)
        self.power, self.anneal = float(power), int(anneal)

    def exponent(self, t: int) -> float:
        """p(t) at 0-based optimizer step t."""
        if self.anneal == 0:
            return self.power
        return self.power * (1 - min((t + 1) / self.anneal, 1.0))

    def scale(self, k: int, t: int) -> float:
        """The lr multiplier 1 / k ** p(t) of a parameter k steps stale at step t."""
        return 1.0 if k <= 1 else float(k ** -self.exponent(t))

    def _step(self) -> None:
        params = self._with_grad()
        scales = [self.scale(self.delays[p], self.t) for p in params]
        scaled = [(p, s) for p, s in zip(params, scales) if s != 1.0]
        before = [p.detach().clone() for p, _ in scaled]
        self.optimizer.step()
        for (p, s), x in zip(scaled, before):
            p.lerp_(x, 1 - s)  # x - s u = x_after + (1 - s) (x - x_after)
        self.diagnostics = {"lr_scale_min": min(scales)} if scales else {}


def build_stage_lr(
    optimizer: torch.optim.Optimizer, cfg: Any, delays: Mapping[torch.Tensor, int]
) -> torch.optim.Optimizer:
    """The method ``stage_lr`` (declared in `asyncpipe.compensation.stage_lr`) around ``optimizer``."""
    c = cfg.stage_lr
    return StageLR(optimizer, delays, c.power, anneal_length(c.anneal_steps, c.anneal_frac, c.run_steps))
