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
) -> torch.Tensor:
    """Scale gradients by min(1, max_norm / (total_norm + 1e-6)); ``max_norm <= 0`` leaves them alone.

    ``total_norm`` defaults to the global L2 norm of ``params``' gradients. Returns the (pre-clip) norm as a 0-dim
    tensor on the gradients' device, and never reads it on the host: the scale is formed on the device (in float64,
    the arithmetic a Python float would do, so the clipped gradients are bit for bit those of a host-side rule),
    and a caller reads the norm when it records it."""
    params = list(params)
    if total_norm is None:
        total_norm = grad_sq_norm(params).sqrt()
    grads = _grads(params)
    total_norm = torch.as_tensor(total_norm, device=grads[0].device if grads else None)
    if max_norm > 0 and grads:
        scale = max_norm / (total_norm.double() + 1e-6)
        # Where the scale is not below 1 (NaN included) the gradients are multiplied by exactly 1: unchanged.
        torch._foreach_mul_(grads, torch.where(scale < 1, scale, torch.ones_like(scale)))
    return total_norm
