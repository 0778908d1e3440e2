"""Adaptive-lambda EF: EF whose lambda is set every step from the run's own consecutive updates.

Update rule (u(t): the wrapped optimizer's weight change from the gradient at W(t-k); d(t) = u(t) - u(t-1)):

    x(t+1) = x(t) - u(t) - lam(t) * d(t),   lam(t) = clip(k * (1 + 2 rho(t)) / 3, 0, lam_max)
    rho(t) = A(t) / B(t),   A <- beta A + (1 - beta) <d(t), d(t-1)>,   B <- beta B + (1 - beta) |d(t-1)|^2

one rho per tensor (``scope=tensor``), per param group or for the whole model; lam = lam_init until the first
observation, at step t = k + 2 (before it, W(t-k) = W(0) for several steps and the differences say nothing about
staleness). Cost: two parameter-sized buffers (u(t-1), d(t-1)) and two dot products; no extra
forward or backward.

Derivation. EF estimates the update a fresh gradient would give, u*(t) = U(g_t(W(t))), from the stale one,
u(t) = U(g_t(W(t-k))), by extrapolating along the last update difference: u(t) + lam d(t). Linearise the
optimizer (SGD, or Adam with a slowly moving preconditioner): u*(t) - u(t) ~ H (W(t) - W(t-k)) ~ k s, with s the
per-step drift of the update caused by moving along the curvature. The observed difference is
d(t) = s + n(t) - n(t-1), where n(t) is the mini-batch noise of step t's update: white, variance sigma^2 per
step. The fresh and the stale update share step t's batch, so n(t) cancels in the target, and the error of the
estimate is (lam - k) s + lam (n(t) - n(t-1)) with mean square (lam - k)^2 S + 2 lam^2 sigma^2, S = |s|^2.
It is smallest at

    lam* = k S / (S + 2 sigma^2)                       (in [0, k]; k when the updates are noise-free, the paper's
                                                        lam = 1 at k = 1; 0 when consecutive differences are noise)

S and sigma^2 are not observed separately, but the lag-one statistics of d are: E<d(t), d(t-1)> = S - sigma^2
(the shared n(t-1) enters with opposite signs) and E|d|^2 = S + 2 sigma^2. Their ratio rho (the least-squares
coefficient of d(t) on d(t-1), in [-1/2, 1] under the model) gives S / (S + 2 sigma^2) = (1 + 2 rho) / 3, hence
the rule above. Ratios of EMAs of A and B estimate rho over the last ~1/(1-beta) steps (their bias cancels in the
ratio). The measured cosine between a stale and a fresh gradient (``diagnostics.fresh_grad_every``) would give
the same quantity directly but costs a backward, so it is not used here. Full write-up: docs/compensation.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from asyncpipe.compensation.adaptive import SCOPES
from asyncpipe.errors import UserError
from asyncpipe.optim.compensation.base import Compensated


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    acc = torch.promote_types(a.dtype, torch.float32)
    return torch.vdot(a.reshape(-1).to(acc), b.reshape(-1).to(acc)).double()


class AdaptiveEF(Compensated):
    name = "ef_adaptive"
    buffer_names = ("u_prev", "d_prev")

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        delays: Mapping[torch.Tensor, int],
        lam_init: float,
        lam_max: float,
        beta: float,
        scope: str,
    ) -> None:
        if scope not in SCOPES:
            raise UserError(f"compensation.adaptive.scope={scope} is not allowed; choose one of: {', '.join(SCOPES)}")
        super().__init__(optimizer, delays)
        self.lam_init, self.lam_max, self.beta, self.scope = float(lam_init), float(lam_max), float(beta), scope
        self.stats: dict[Any, list[torch.Tensor]] = {}  # scope key -> [A, B]
        group_index = {p: j for j, group in enumerate(self.param_groups) for p in group["params"]}
        self._scope_of = {
            p: (i if scope == "tensor" else group_index[p] if scope == "group" else 0)
            for i, p in enumerate(self._params())
        }

    def lam_for(self, p: torch.Tensor, rho: torch.Tensor | None) -> torch.Tensor | float:
        """lam for ``p``: 0 without delay, ``lam_init`` until its scope has a correlation (``rho`` None or NaN:
        no squared norm observed yet), else k (1 + 2 rho) / 3 clamped to [0, lam_max]. Formed on the device: no
        host read per parameter."""
        k = self.delays[p]
        if k == 0:
            return 0.0
        if rho is None:
            return self.lam_init
        lam = (k * (1 + 2 * rho) / 3).clamp(0.0, self.lam_max)
        return torch.where(rho.isnan(), torch.full_like(lam, self.lam_init), lam)

    def rho(self, key: Any) -> torch.Tensor | None:
        """The scope's correlation estimate (NaN while its squared norm is not positive), None before any."""
        stat = self.stats.get(key)
        if stat is None:
            return None
        return torch.where(stat[1] > 0, stat[0] / stat[1], torch.full_like(stat[1], math.nan))

    def _step(self) -> None:
        params = self._with_grad()
        updates = self.inner_updates(params)
        u_prev, d_prev = self.buffers["u_prev"], self.buffers["d_prev"]
        observed: dict[Any, list[torch.Tensor]] = {}
        diffs = []
        for p, u in zip(params, updates):
            up = u_prev.get(p)
            u_prev[p] = u
            if up is None:
                continue
            d = up.neg_().add_(u)  # d(t) = u(t) - u(t-1), in u(t-1)'s memory
            dp = d_prev.get(p)
            if dp is not None and self.t >= self.delays[p] + 2:  # d(t-1) spans two distinct stale weights
                obs = observed.setdefault(self._scope_of[p], [d.new_zeros((), dtype=torch.float64)] * 2)
                obs[0] = obs[0] + _dot(d, dp)
                obs[1] = obs[1] + _dot(dp, dp)
            diffs.append((p, d))
        b = self.beta
        for key, (cross, sq) in observed.items():
            stat = self.stats.get(key)
            self.stats[key] = (
                [cross, sq] if stat is None else [b * stat[0] + (1 - b) * cross, b * stat[1] + (1 - b) * sq]
            )
        lams = []
        for p, d in diffs:
            rho = self.rho(self._scope_of[p])
            lam = self.lam_for(p, rho)
            p.sub_(d * lam)
            d_prev[p] = d
            lams.append(lam)
        if lams:  # one host read for all of them, summed as Python floats
            device = next((x.device for x in lams if torch.is_tensor(x)), None)
            values = torch.stack([torch.as_tensor(x, dtype=torch.float64, device=device) for x in lams]).tolist()
            self.diagnostics = {"ef_lam": sum(values) / len(values)}

    def extra_state(self) -> dict[str, Any]:
        return {"stats": {k: [float(a), float(b)] for k, (a, b) in self.stats.items()}}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.stats = {
            k: [torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)]
            for k, (a, b) in state.get("stats", {}).items()
        }


def build_adaptive(
    optimizer: torch.optim.Optimizer, cfg: Any, delays: Mapping[torch.Tensor, int]
) -> torch.optim.Optimizer:
    """The method ``ef_adaptive`` (declared in `asyncpipe.compensation.adaptive`) around ``optimizer``."""
    c = cfg.adaptive
    return AdaptiveEF(optimizer, delays, c.lam_init, c.lam_max, c.beta, c.scope)
