"""Error feedback (EF) for delayed optimisation, as a wrapper around any torch optimizer.

With u(t) the wrapped optimizer's own weight change at step t (learning rate and weight decay included), the
applied change is u(t) + lam * (u(t) - u(t-1)): the update is extrapolated along its own drift, which cancels the
first-order error of a one-step-stale gradient. The wrapped optimizer's state is never touched. ``lam_at(t)``
makes lambda a schedule over optimizer steps t (`asyncpipe.optim.compensation.ef`: constant or warm-up).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from asyncpipe.errors import UserError
from asyncpipe.optim.closure import evaluate_closure


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)  # fp32 at least; fp64 params stay fp64


def _sq_norm(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t, dtype=_acc_dtype(t)).square().double()


class ErrorFeedback(torch.optim.Optimizer):
    """Wraps ``optimizer``; ``param_groups``, ``state`` and ``zero_grad`` are the wrapped optimizer's own.

    Memory: one persistent parameter-sized buffer (u(t-1)) plus one transient snapshot during ``step``.
    Parameters whose ``grad`` is None at a step are left alone (no update, no correction, u(t-1) kept).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, lam: float, lam_at: Optional[Callable[[int], float]] = None
    ) -> None:
        if lam < 0:
            raise UserError(f"optimizer.ef.lam={lam} must be >= 0")
        self.optimizer = optimizer
        self.lam = float(lam)
        self.lam_at = lam_at
        self._t = 0  # optimizer steps taken (the schedule's clock)
        self._ready = False
        # The base class only sets up hooks here; groups and state are then shared with the wrapped optimizer.
        super().__init__(optimizer.param_groups, dict(optimizer.defaults))
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._u_prev: dict[torch.Tensor, torch.Tensor] = {}
        self._update_sq: Optional[torch.Tensor] = None
        self._correction_sq: Optional[torch.Tensor] = None
        self._ready = True

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @property
    def extra_bytes(self) -> int:
        """Persistent memory of the wrapper: the u(t-1) buffers."""
        return sum(u.numel() * u.element_size() for u in self._u_prev.values())

    @property
    def last_lam(self) -> Optional[float]:
        """Lambda of the last step (None before the first)."""
        return None if self._t == 0 else (self.lam_at(self._t - 1) if self.lam_at else self.lam)

    @property
    def last_update_norm(self) -> Optional[float]:
        """L2 norm of the weight change applied by the last step (None before the first step)."""
        return None if self._update_sq is None else float(self._update_sq.sqrt())

    @property
    def last_correction_norm(self) -> Optional[float]:
        """L2 norm of the last EF correction lam * (u(t) - u(t-1)) (0 on the first step)."""
        return None if self._correction_sq is None else float(self._correction_sq.sqrt())

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = evaluate_closure(closure)
        lam = self.lam_at(self._t) if self.lam_at is not None else self.lam
        self._t += 1
        params = [p for p in self._params() if p.grad is not None]
        snapshot = [p.detach().clone() for p in params]  # x(t); turned into u(t) in place below
        self.optimizer.step()
        update_sq = torch.zeros((), dtype=torch.float64, device=params[0].device if params else None)
        correction_sq = torch.zeros_like(update_sq)
        for p, u in zip(params, snapshot):
            u.sub_(p.detach())  # u(t) = x(t) - x_after
            u_sq = _sq_norm(u)
            prev = self._u_prev.get(p)
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
            self._u_prev[p] = u
        self._update_sq, self._correction_sq = update_sq, correction_sq
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._ready:
            self.optimizer.add_param_group(param_group)
        else:  # called by the base constructor: the groups already belong to the wrapped optimizer
            super().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus u(t-1), indexed by position in ``param_groups``."""
        u_prev = {i: self._u_prev[p] for i, p in enumerate(self._params()) if p in self._u_prev}
        return {"optimizer": self.optimizer.state_dict(), "ef": {"lam": self.lam, "t": self._t, "u_prev": u_prev}}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "ef" not in state_dict:
            raise UserError("checkpoint optimizer state has no error-feedback buffer (was it saved without EF?)")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        # torch's load_state_dict replaces the wrapped optimizer's group list and state dict: share the new ones.
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        params = self._params()
        self._u_prev = {
            params[i]: u.detach().to(device=params[i].device, dtype=params[i].dtype).clone()
            for i, u in state_dict["ef"]["u_prev"].items()
        }
        self._t = int(state_dict["ef"].get("t", 0))
        self._update_sq = self._correction_sq = None

    def __repr__(self) -> str:
        return f"ErrorFeedback(lam={self.lam}, {self.optimizer!r})"
