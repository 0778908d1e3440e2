"""Global gradient-norm clipping: one rule for the simulator and the pipeline (where the squared norms of
all stages are all-reduced first, then passed in as ``total_norm``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional, Union

import torch


def _grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def grad_sq_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of all gradients as a float32 scalar on the parameters' device (0 when none)."""
    params = list(params)
    grads = _grads(params)
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=params[0].device if params else None)
    norms = torch._foreach_norm(grads, 2, dtype=torch.float32)  # fp32 accumulation even for bf16 grads
    return torch.stack(norms).square().sum()


def clip_grads(
    params: Iterable[torch.Tensor], max_norm: float, total_norm: Optional[Union[float, torch.Tensor]] = None
) -> float:
    """Scale gradients by min(1, max_norm / (total_norm + 1e-6)); ``max_norm <= 0`` leaves them alone.

    ``total_norm`` defaults to the global L2 norm of ``params``' gradients. Returns the (pre-clip) norm.
    """
    params = list(params)
    if total_norm is None:
        total_norm = grad_sq_norm(params).sqrt()
    norm = float(total_norm)
    if max_norm > 0:
        scale = max_norm / (norm + 1e-6)
        if scale < 1:
            grads = _grads(params)
            if grads:
                torch._foreach_mul_(grads, scale)
    return norm
