"""Stage-wise learning rate: the lr of a parameter scaled down by its delay (PipeMare's learning-rate
rescheduling, Yang et al., MLSys 2021; the PipeDream-LR baseline of Jung et al. 2026).

With delay_profile=pipedream, stage s of P is k = P-1-s steps stale; the early stages, the most stale, get the
smallest steps. With u(t) the wrapped optimizer's update (lr and decoupled weight decay included, so scaling it
is scaling that parameter's lr):

    x(t+1) = x(t) - s_k(t) u(t),   s_k(t) = (1 + k) ** (-power * a(t))
    a(t)   = max(0, 1 - t / anneal_steps) if anneal_steps > 0 else 1

(PipeMare anneals the delay-dependent reduction away over training; ``anneal_steps=0`` keeps it.) A fresh
parameter (k = 0) keeps the full lr. Under a uniform delay every parameter gets the same factor, i.e. a plain lr
change. Memory: no buffer (one transient snapshot per step); runs in the 2BW engine, where the delay is uniform.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from asyncpipe.errors import UserError
from asyncpipe.optim.compensation.registry import register
from asyncpipe.optim.compensation.base import Compensated


class StageLR(Compensated):
    name = "stage_lr"

    def __init__(
        self, optimizer: torch.optim.Optimizer, delays: Mapping[torch.Tensor, int], power: float, anneal_steps: int
    ) -> None:
        if power < 0 or anneal_steps < 0:
            raise UserError("compensation.stage_lr.power and anneal_steps must be >= 0")
        super().__init__(optimizer, delays)
        self.power, self.anneal_steps = float(power), int(anneal_steps)

    def scale(self, k: int, t: int) -> float:
        a = max(0.0, 1 - t / self.anneal_steps) if self.anneal_steps > 0 else 1.0
        return float((1 + k) ** (-self.power * a))

    def _step(self) -> None:
        params = self._with_grad()
        scales = [self.scale(self.delays[p], self.t) for p in params]
        scaled = [(p, s) for p, s in zip(params, scales) if s != 1.0]
        before = [p.detach().clone() for p, _ in scaled]
        self.optimizer.step()
        for (p, s), x in zip(scaled, before):
            p.lerp_(x, 1 - s)  # x - s u = x_after + (1 - s) (x - x_after)
        self.diagnostics = {"lr_scale_min": min(scales)} if scales else {}


@register("stage_lr", fits_2bw=True, note="no buffer; under 2BW's uniform delay it is a plain lr change")
def build_stage_lr(optimizer: torch.optim.Optimizer, cfg: Any, delays: Mapping[torch.Tensor, int]) -> torch.optim.Optimizer:
    c = cfg.stage_lr
    return StageLR(optimizer, delays, c.power, c.anneal_steps)
