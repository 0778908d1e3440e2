"""Nesterov look-ahead for asynchronous pipelines (after Ajanthan et al., ICML 2025, "Nesterov Method for
Asynchronous Pipeline Parallel Optimization"; code PluralisResearch/AsyncPP), as a wrapper of any optimizer.

Their observation: in NAG the step is dominated by the momentum direction, which is built from weights the
stage already has (fresh), while the delayed gradient enters with weight (1 - gamma); with gamma close to 1 the
look-ahead along the momentum carries the iterate where the stale gradient would have pointed, and the delay
matters less (they run NAdam with beta1 = 0.99: ``optimizer=nadam``, kept as their baseline setting). Here the
look-ahead acts on the applied updates, so it composes with AdamW, Muon or SOAP. With u(t) the wrapped
optimizer's update from the stale gradient g(W(t-k)):

    m(t)    = gamma m(t-1) + (1 - gamma) u(t)          (m(0) = u(0): no start-up bias)
    x(t+1)  = x(t) - [gamma m(t) + (1 - gamma) u(t)]    (Nesterov's look-ahead: one more momentum step)

gamma = 0 is the plain optimizer; a constant u is applied unchanged (the lr keeps its meaning). Where EF
extrapolates the newest update (a high-pass correction), this smooths it (a low-pass one): the sweep compares
both. Memory: one parameter-sized buffer m (optimizer state, no weight version): runs in the 2BW engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from asyncpipe.errors import UserError
from asyncpipe.optim.compensation.registry import register
from asyncpipe.optim.compensation.base import Compensated


class NesterovLookahead(Compensated):
    name = "nag_lookahead"
    buffer_names = ("m",)

    def __init__(self, optimizer: torch.optim.Optimizer, delays: Mapping[torch.Tensor, int], gamma: float) -> None:
        if not 0 <= gamma < 1:
            raise UserError(f"compensation.nag.gamma={gamma} must be in [0, 1)")
        super().__init__(optimizer, delays)
        self.gamma = float(gamma)

    def _step(self) -> None:
        params = self._with_grad()
        updates = self.inner_updates(params)
        m, g = self.buffers["m"], self.gamma
        for p, u in zip(params, updates):
            prev = m.get(p)
            if prev is None:
                m[p] = u.clone()  # applied step is u itself
                continue
            prev.mul_(g).add_(u, alpha=1 - g)
            # p holds x - u; the applied step is g m + (1 - g) u = u + g (m - u).
            p.sub_(prev - u, alpha=g)


@register("nag_lookahead", fits_2bw=True, note="one parameter-sized buffer m (optimizer state, no weight version)")
def build_nag(optimizer: torch.optim.Optimizer, cfg: Any, delays: Mapping[torch.Tensor, int]) -> torch.optim.Optimizer:
    return NesterovLookahead(optimizer, delays, cfg.nag.gamma)
