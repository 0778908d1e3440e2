"""Update averaging: an EMA over the wrapped optimizer's applied updates, with a Nesterov-style extra step.

THIS PROJECT'S OWN IDEA, not a published method. It was shipped as ``nag_lookahead`` "after Ajanthan et al.,
ICML 2025", but that paper's method, as the authors run it, is NAdamW with beta1 = 0.99 (``optimizer=nag``,
docs/compensation.md). This wrapper instead smooths updates that already carry the wrapped optimizer's momentum:
with u(t) the wrapped optimizer's update from the stale gradient g(W(t-k)),

    m(t)    = gamma m(t-1) + (1 - gamma) u(t)          (m(0) = u(0): no start-up bias)
    x(t+1)  = x(t) - [gamma m(t) + (1 - gamma) u(t)]

i.e. the applied step is gamma^2 m(t-1) + (1 - gamma^2) u(t): an average of past updates, which adds lag rather
than compensating it (docs/results/compensation.md: AdamW's delay-1 gap +0.92, 40% wider than with no
mitigation). It stays so that the previous results can be reproduced and compared; its setting keeps the old key, ``compensation.nag.gamma``, so
that v3 run records and new ones share their config keys (a renamed key would split the report's tables).
gamma = 0 is the plain optimizer; a constant u is applied
unchanged. Memory: one parameter-sized buffer m (optimizer state, no weight version): runs in the 2BW engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from asyncpipe.errors import UserError
from asyncpipe.optim.compensation.base import Compensated


class UpdateAveraging(Compensated):
    name = "update_averaging"
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


def build_averaging(
    optimizer: torch.optim.Optimizer, cfg: Any, delays: Mapping[torch.Tensor, int]
) -> torch.optim.Optimizer:
    """The method ``update_averaging`` (declared in `asyncpipe.compensation.averaging`) around ``optimizer``."""
    return UpdateAveraging(optimizer, delays, cfg.nag.gamma)
