"""`Compensated`: the base of every staleness mitigation that wraps an optimizer.

A wrapper shares ``param_groups`` and ``state`` with the optimizer it wraps (so the trainer's lr schedule and
the wrapped optimizer's own checkpoint state are untouched) and adds three hooks the engines call:

- ``step()``: the update rule (default: the wrapped optimizer's step; methods rewrite the applied update);
- ``compensate_grads(stale)``: after clipping, before the step, with W(t-k) of every parameter at hand;
- ``forward_weights()``: a context around the forward/backward, entered while the parameters hold W(t-k).

Buffers a method keeps per parameter live in ``self.buffers[name][param]`` and travel in ``state_dict``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Optional

import torch

from asyncpipe.errors import UserError
from asyncpipe.optim.closure import evaluate_closure


class Compensated(torch.optim.Optimizer):
    """Wraps ``optimizer``; ``delays`` maps each of its parameters to its delay k (0 = fresh)."""

    name = "compensated"
    buffer_names: tuple[str, ...] = ()

    def __init__(self, optimizer: torch.optim.Optimizer, delays: Mapping[torch.Tensor, int]) -> None:
        self.optimizer = optimizer
        self._ready = False
        super().__init__(optimizer.param_groups, dict(optimizer.defaults))
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.delays = {p: int(delays.get(p, 0)) for p in self._params()}
        self.buffers: dict[str, dict[torch.Tensor, torch.Tensor]] = {n: {} for n in self.buffer_names}
        self.t = 0  # optimizer steps taken
        self.diagnostics: dict[str, float] = {}
        self._ready = True

    # -- parameters ------------------------------------------------------------------------------------
    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _with_grad(self) -> list[torch.Tensor]:
        return [p for p in self._params() if p.grad is not None]

    def group_of(self) -> dict[torch.Tensor, dict[str, Any]]:
        return {p: group for group in self.param_groups for p in group["params"]}

    # -- hooks -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = evaluate_closure(closure)
        self._step()
        self.t += 1
        return loss

    def _step(self) -> None:
        self.optimizer.step()

    @torch.no_grad()
    def inner_updates(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Run the wrapped optimizer's step; return u = x_before - x_after for ``params`` (learning rate and
        weight decay included), computed in the memory of a snapshot."""
        snapshot = [p.detach().clone() for p in params]
        self.optimizer.step()
        for u, p in zip(snapshot, params):
            u.sub_(p.detach())
        return snapshot

    def compensate_grads(self, stale: Mapping[torch.Tensor, torch.Tensor]) -> None:
        """Gradient-side hook (default: nothing)."""

    @contextlib.contextmanager
    def forward_weights(self) -> Iterator[None]:
        """Weight-side hook around the forward/backward (default: nothing)."""
        yield

    # -- bookkeeping -------------------------------------------------------------------------------------
    @property
    def extra_bytes(self) -> int:
        """Persistent memory this method adds (its buffers), beyond the wrapped optimizer's own state."""
        return sum(t.numel() * t.element_size() for bufs in self.buffers.values() for t in bufs.values())

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._ready:
            raise NotImplementedError("add the group to the wrapped optimizer before wrapping it")
        super().add_param_group(param_group)

    def extra_state(self) -> dict[str, Any]:
        """Scalars beyond the buffers a subclass needs to resume exactly."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        index = {p: i for i, p in enumerate(self._params())}
        buffers = {n: {index[p]: t for p, t in bufs.items()} for n, bufs in self.buffers.items()}
        comp = {"name": self.name, "t": self.t, "buffers": buffers, "extra": self.extra_state()}
        return {"optimizer": self.optimizer.state_dict(), "compensation": comp}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        comp = state_dict.get("compensation")
        if comp is None or comp.get("name") != self.name:
            found = None if comp is None else comp.get("name")
            raise UserError(f"checkpoint optimizer state was saved with compensation {found}, not {self.name}")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        params = self._params()
        self.buffers = {
            n: {
                params[i]: t.detach().to(device=params[i].device).clone() for i, t in comp["buffers"].get(n, {}).items()
            }
            for n in self.buffer_names
        }
        self.t = int(comp["t"])
        self.load_extra_state(comp.get("extra", {}))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"
