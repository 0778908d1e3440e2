"""EF, the paper's correction (Zmushko et al. 2026, "One-Step Gradient Delay is Not a Barrier for Large-Scale
Asynchronous Pipeline Parallel LLM Pretraining"), with lambda as a schedule: EF's rule (its declaration, settings,
value check and memory model, torch-free: `asyncpipe.compensation.ef`).

Update rule, with u(t) the wrapped optimizer's own weight change (learning rate and weight decay included) from
the stale gradient g(W(t-k)):

    x(t+1) = x(t) - u(t) - lam(t) * (u(t) - u(t-1))

i.e. the paper's x(t+1) = x(t) - u(t-1) - lam (u(t-1) - u(t-2)) with its update indexed by the gradient's step.
For SGD, u(t) - u(t-1) = lr (g(x(t-1)) - g(x(t-2))) ~ lr H (x(t-1) - x(t-2)): with lam = 1 the applied step is a
first-order estimate of lr g(x(t)), the fresh gradient. ``schedule=constant``: lam(t) = lam;
``schedule=warmup``: lam(t) = lam * min(1, (t + 1) / warmup_steps), so the correction grows in as the early,
large and erratic updates settle. The ``adamw_ef`` / ``muon_ef`` presets' ``optimizer.ef.enabled=true`` (and
that override in sweep files and run records) is an alias of this method with lam = ``optimizer.ef.lam`` and a
constant schedule, resolved once at composition (`asyncpipe.config.alias`). Memory: u(t-1) plus the step's
snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch

from asyncpipe.compensation.ef import SCHEDULES
from asyncpipe.errors import UserError
from asyncpipe.optim.compensation.base import Compensated


def lam_schedule(lam: float, schedule: str, warmup_steps: int) -> Callable[[int], float]:
    """lambda at optimizer step t (0-based)."""
    if schedule == "constant":
        return lambda t: lam
    if schedule == "warmup":
        if warmup_steps < 1:
            raise UserError(f"compensation.ef.warmup_steps={warmup_steps} must be >= 1 with schedule=warmup")
        return lambda t: lam * min(1.0, (t + 1) / warmup_steps)
    raise UserError(f"compensation.ef.schedule={schedule} is not allowed; choose one of: {', '.join(SCHEDULES)}")


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)  # fp32 at least; fp64 params stay fp64


def _sq_norm(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t, dtype=_acc_dtype(t)).square().double()


class ErrorFeedback(Compensated):
    """EF around ``optimizer``; ``param_groups``, ``state`` and ``zero_grad`` are the wrapped optimizer's own.
    ``lam_at(t)`` makes lambda a schedule over optimizer steps t (None: constant ``lam``).

    Memory: one persistent parameter-sized buffer (u(t-1)) plus one transient snapshot during ``step``.
    Parameters whose ``grad`` is None at a step are left alone (no update, no correction, u(t-1) kept). The
    checkpoint layout ({"optimizer", "ef": {lam, t, u_prev}}) is the one EF has always written, so runs resume
    across versions.
    """

    name = "ef"
    buffer_names = ("u_prev",)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lam: float,
        lam_at: Optional[Callable[[int], float]] = None,
        delays: Optional[Mapping[torch.Tensor, int]] = None,
    ) -> None:
        super().__init__(optimizer, delays or {})
        self.lam = float(lam)
        self.lam_at = lam_at
        self._update_sq: Optional[torch.Tensor] = None
        self._correction_sq: Optional[torch.Tensor] = None

    def lam_of(self, t: int) -> float:
        return self.lam_at(t) if self.lam_at is not None else self.lam

    @property
    def last_lam(self) -> Optional[float]:
        """Lambda of the last step (None before the first)."""
        return None if self.t == 0 else self.lam_of(self.t - 1)

    @property
    def last_update_norm(self) -> Optional[float]:
        """L2 norm of the weight change applied by the last step (None before the first step)."""
        return None if self._update_sq is None else float(self._update_sq.sqrt())

    @property
    def last_correction_norm(self) -> Optional[float]:
        """L2 norm of the last EF correction lam * (u(t) - u(t-1)) (0 on the first step)."""
        return None if self._correction_sq is None else float(self._correction_sq.sqrt())

    def _step(self) -> None:
        lam = self.lam_of(self.t)
        params = self._with_grad()
        updates = self.inner_updates(params)  # u(t) = x(t) - x_after, the wrapped optimizer's own step
        u_prev = self.buffers["u_prev"]
        update_sq = torch.zeros((), dtype=torch.float64, device=params[0].device if params else None)
        correction_sq = torch.zeros_like(update_sq)
        for p, u in zip(params, updates):
            u_sq = _sq_norm(u)
            prev = u_prev.get(p)
            if prev is None:  # first step: nothing to extrapolate from
                update_sq += u_sq
            else:
                # Reuse u(t-1)'s memory for -correction = lam * (u(t-1) - u(t)), then retire it.
                neg_corr = prev.sub_(u).mul_(lam)
                p.add_(neg_corr)
                c_sq = _sq_norm(neg_corr)
                correction_sq += c_sq
                # |u + correction|^2 without a temporary: |u|^2 - 2 <u, neg_corr> + |neg_corr|^2.
                acc = _acc_dtype(u)
                dot = torch.vdot(u.reshape(-1).to(acc), neg_corr.reshape(-1).to(acc)).double()
                update_sq += (u_sq - 2 * dot + c_sq).clamp_min(0)
            u_prev[p] = u
        self._update_sq, self._correction_sq = update_sq, correction_sq

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._ready:
            self.optimizer.add_param_group(param_group)
        else:  # called by the base constructor: the groups already belong to the wrapped optimizer
            super().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus u(t-1), indexed by position in ``param_groups``."""
        u_prev = {i: self.buffers["u_prev"][p] for i, p in enumerate(self._params()) if p in self.buffers["u_prev"]}
        return {"optimizer": self.optimizer.state_dict(), "ef": {"lam": self.lam, "t": self.t, "u_prev": u_prev}}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "ef" not in state_dict:
            raise UserError("checkpoint optimizer state has no error-feedback buffer (was it saved without EF?)")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        # torch's load_state_dict replaces the wrapped optimizer's group list and state dict: share the new ones.
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        params = self._params()
        self.buffers["u_prev"] = {
            params[i]: u.detach().to(device=params[i].device, dtype=params[i].dtype).clone()
            for i, u in state_dict["ef"]["u_prev"].items()
        }
        self.t = int(state_dict["ef"].get("t", 0))
        self._update_sq = self._correction_sq = None

    def __repr__(self) -> str:
        return f"ErrorFeedback(lam={self.lam}, {self.optimizer!r})"


def build_ef(optimizer: torch.optim.Optimizer, cfg: Any, delays: Mapping[torch.Tensor, int]) -> torch.optim.Optimizer:
    """The method ``ef`` (declared in `asyncpipe.compensation.ef`) around ``optimizer``."""
    c = cfg.ef
    at = lam_schedule(c.lam, c.schedule, c.warmup_steps)
    return ErrorFeedback(optimizer, c.lam, lam_at=None if c.schedule == "constant" else at, delays=delays)
