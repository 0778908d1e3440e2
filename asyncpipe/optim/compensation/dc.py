"""Delay-compensated gradient (Zheng et al., ICML 2017, "Asynchronous Stochastic Gradient Descent with Delay
Compensation": DC-ASGD and its adaptive form DC-ASGD-a).

The gradient at the current weights is approximated from the stale one by a first-order Taylor step whose
Hessian is replaced by the cheap outer-product approximation g g^T, kept diagonal (the paper's delay-compensated
gradient, with W(t-k) the weights the worker's gradient was computed at, w_bak in the paper):

    g~ = g + lam(t) * g * g * (W(t) - W(t-k))          (elementwise; g = the clipped stale gradient g(W(t-k)))

then the wrapped optimizer steps with g~. ``adaptive=false``: lam(t) = lam (DC-ASGD). ``adaptive=true``
(DC-ASGD-a, the paper's adaptive lambda):

    MeanSquare(t) = rho MeanSquare(t-1) + (1 - rho) g * g,   MeanSquare(0) = 0
    lam(t)        = lam / sqrt(MeanSquare(t) + eps)                                  (elementwise)

eps inside the square root and the average starting at 0, as in the paper (its lam0 is ``lam``, its m is ``rho``).
This makes the correction invariant to the gradient's scale (a mean mini-batch gradient is far smaller than the
curvature g g^T is meant to stand for).

Departures: the paper's server applies plain SGD with g~; here any optimizer steps with it. Parameters with
k = 0 are left alone (their W(t) - W(t-k) is 0) and do not update the average. It needs W(t) and W(t-k) at step
time: the simulator's delay ring and the 2BW stash both still hold W(t-k) there, so DC-ASGD costs no buffer and
DC-ASGD-a one (MeanSquare); both run in the 2BW engine. ``lam = 0`` is the plain optimizer. Diagnostic
``dc_rel``: |correction| / |g| of the last step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from asyncpipe.errors import UserError
from asyncpipe.optim.compensation.base import Compensated


class DelayCompensated(Compensated):
    name = "dc"
    buffer_names = ("v",)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        delays: Mapping[torch.Tensor, int],
        lam: float,
        adaptive: bool,
        rho: float,
        eps: float,
    ) -> None:
        if lam < 0 or not 0 <= rho < 1 or eps <= 0:
            raise UserError(f"compensation.dc needs lam >= 0, 0 <= rho < 1, eps > 0; got {lam}, {rho}, {eps}")
        super().__init__(optimizer, delays)
        self.lam, self.adaptive, self.rho, self.eps = float(lam), bool(adaptive), float(rho), float(eps)

    @torch.no_grad()
    def compensate_grads(self, stale: Mapping[torch.Tensor, torch.Tensor]) -> None:
        corr_sq = grad_sq = 0.0  # float64 scalars on the device once a parameter adds to them: no host read
        for p in self._with_grad():
            old = stale.get(p)
            if old is None or self.delays[p] == 0:
                continue
            g = p.grad
            gg = g * g
            if self.adaptive:
                v = self.buffers["v"].get(p)
                v = gg.mul(1 - self.rho) if v is None else v.mul_(self.rho).add_(gg, alpha=1 - self.rho)  # from 0
                self.buffers["v"][p] = v
                corr = gg.mul_(p.detach() - old).div_(v.add(self.eps).sqrt_()).mul_(self.lam)
            else:
                corr = gg.mul_(p.detach() - old).mul_(self.lam)
            corr_sq = corr_sq + corr.double().square().sum()
            grad_sq = grad_sq + g.double().square().sum()
            g.add_(corr)
        rel = (corr_sq / grad_sq).sqrt() if torch.is_tensor(grad_sq) else torch.zeros(())
        self.diagnostics = {"dc_rel": torch.where(grad_sq > 0, rel, torch.zeros_like(rel))}  # read when recorded


def build_dc(optimizer: torch.optim.Optimizer, cfg: Any, delays: Mapping[torch.Tensor, int]) -> torch.optim.Optimizer:
    """The method ``dc`` (declared in `asyncpipe.compensation.dc`) around ``optimizer``."""
    c = cfg.dc
    return DelayCompensated(optimizer, delays, c.lam, c.adaptive, c.rho, c.eps)
