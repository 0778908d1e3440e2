"""Weight prediction (SpecTrain, Chen et al. 2018, "Efficient and Robust Parallel DNN Training through Model
Parallelism on Multi-GPU Platform"; PipeMare, Yang et al., MLSys 2021): the forward and backward of a delayed
step run on weights extrapolated toward W(t) instead of on W(t-k).

A stage that starts the forward of step t holds W(t-k) and knows how the weights have been moving. With
v the observed per-step velocity of the weights it reads (an EMA with decay beta; beta = 0 is the last change):

    v(t)     = beta v(t-1) + (1 - beta) (W(t-k) - W(t-k-1))      (v = 0 until two versions were seen)
    W^(t)    = W(t-k) + horizon * k * v(t)                         (k steps ahead: the prediction of W(t))
    x(t+1)   = x(t) - U(g(W^(t)))                                  (the optimizer itself is unchanged)

SpecTrain extrapolates with the SGD-momentum term, lr * k * momentum; the observed velocity is that term for
SGD with momentum and its analogue for any optimizer (Adam's or Muon's actual step), which keeps this
optimizer-agnostic; PipeMare smooths it with an EMA (``beta``). Only what was known at step t-k is used.

Memory: W(t-k-1) and, with beta > 0, v (two parameter-sized buffers), plus the predicted weights, which autograd
holds until the backward. The 2BW engine keeps exactly two weight versions per stage and a micro-batch's
backward needs the weights its forward saw; predicted weights are a third version per batch in flight (two
batches overlap in 2BW) plus the velocity buffers, so this method does not fit the 2BW budget and runs in the
simulator only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from asyncpipe.errors import UserError
from asyncpipe.optim.compensation.base import Compensated


class WeightPrediction(Compensated):
    name = "weight_prediction"
    buffer_names = ("prev", "v")

    def __init__(
        self, optimizer: torch.optim.Optimizer, delays: Mapping[torch.Tensor, int], beta: float, horizon: float
    ) -> None:
        if not 0 <= beta < 1 or horizon < 0:
            raise UserError(f"compensation.prediction needs 0 <= beta < 1 and horizon >= 0, got {beta}, {horizon}")
        super().__init__(optimizer, delays)
        self.beta, self.horizon = float(beta), float(horizon)

    @contextlib.contextmanager
    def forward_weights(self) -> Iterator[None]:
        """Enter while the parameters hold W(t-k): they hold the prediction W^(t) inside the block."""
        swapped = []
        with torch.no_grad():
            prev, vel = self.buffers["prev"], self.buffers["v"]
            for p in self._params():
                k = self.delays[p]
                if k == 0:
                    continue
                stale = p.data
                before = prev.get(p)
                prev[p] = stale.clone()
                if before is None:
                    continue
                step = stale - before  # W(t-k) - W(t-k-1)
                if self.beta > 0:
                    v = vel.get(p)
                    step = step.mul_(1 - self.beta) if v is None else v.mul_(self.beta).add_(step, alpha=1 - self.beta)
                    vel[p] = step
                p.data = stale + step * (self.horizon * k)
                swapped.append((p, stale))
        try:
            yield
        finally:
            for p, stale in swapped:
                p.data = stale


def build_prediction(
    optimizer: torch.optim.Optimizer, cfg: Any, delays: Mapping[torch.Tensor, int]
) -> torch.optim.Optimizer:
    """The method ``weight_prediction`` (declared in `asyncpipe.compensation.prediction`) around ``optimizer``."""
    c = cfg.prediction
    return WeightPrediction(optimizer, delays, c.beta, c.horizon)
