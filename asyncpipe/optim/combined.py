"""Several torch optimizers over disjoint parameters that look like one optimizer to the trainer and engine.

Muon only takes 2-D hidden matrices, so a Muon run is Muon + AdamW; callers see one ``param_groups`` list
(the inner optimizers' own group dicts, so setting ``group["lr"]`` reaches them) and one state dict.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Optional

import torch

from asyncpipe.optim.closure import evaluate_closure


class _MergedState(Mapping):
    """Read view of the inner optimizers' ``state`` dicts (never creates entries, unlike a defaultdict)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self._optimizers = optimizers

    def __getitem__(self, param: torch.Tensor) -> Any:
        for opt in self._optimizers:
            if param in opt.state:
                return opt.state[param]
        raise KeyError(param)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for opt in self._optimizers:
            yield from opt.state

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._optimizers)


class CombinedOptimizer(torch.optim.Optimizer):
    """``step``, ``zero_grad``, ``state_dict`` and ``load_state_dict`` go to every inner optimizer in order."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        if not optimizers:
            raise ValueError("CombinedOptimizer needs at least one optimizer")
        self.optimizers = list(optimizers)
        self._ready = False
        # Passing the inner group dicts (not copies) makes lr changes by the trainer reach the inner optimizers.
        super().__init__([g for opt in self.optimizers for g in opt.param_groups], {})
        self.state = _MergedState(self.optimizers)  # type: ignore[assignment]
        self._ready = True

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = evaluate_closure(closure)
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._ready:
            raise NotImplementedError("add the group to one of CombinedOptimizer.optimizers instead")
        super().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["optimizers"]
        if len(saved) != len(self.optimizers):
            raise ValueError(f"state dict holds {len(saved)} optimizers, this one has {len(self.optimizers)}")
        for opt, sd in zip(self.optimizers, saved):
            opt.load_state_dict(sd)
        # torch's load_state_dict replaces each inner group dict; share the new ones again.
        self.param_groups = [g for opt in self.optimizers for g in opt.param_groups]

    def __repr__(self) -> str:
        inner = ", ".join(type(opt).__name__ for opt in self.optimizers)
        return f"CombinedOptimizer({inner})"
