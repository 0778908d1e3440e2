"""Muon for stacked expert weights ``[E, rows, cols]``: the update of each expert's matrix is orthogonalised on
its own (Newton-Schulz batched over the expert dimension), never the flattened or stacked tensor.

The step is `torch.optim.Muon`'s, per expert: momentum buffer B <- mu B + (1 - mu) g (a lerp), Nesterov update
g + mu (B - g), quintic Newton-Schulz in bf16 on the matrix scaled to unit Frobenius norm (transposed when it
has more rows than columns), decoupled weight decay, and the learning rate scaled by the matrix's own shape
(``original``: sqrt(max(1, rows/cols)); ``match_rms_adamw``: 0.2 sqrt(max(rows, cols))).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Optional

import torch

from asyncpipe.optim.closure import evaluate_closure

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic of torch.optim.Muon (maximal slope at zero)
NS_EPS = 1e-7


def orthogonalize(g: torch.Tensor, steps: int, eps: float = NS_EPS) -> torch.Tensor:
    """Approximate U V^T of every matrix in ``g [..., rows, cols]`` by ``steps`` Newton-Schulz iterations
    (in bf16; singular values land near 1, roughly in [0.7, 1.2], as with torch's Muon)."""
    a, b, c = NS_COEFFICIENTS
    x = g.bfloat16()
    tall = g.shape[-2] > g.shape[-1]
    if tall:
        x = x.transpose(-2, -1)
    x = x / torch.linalg.matrix_norm(x.float(), keepdim=True).clamp(min=eps).to(x.dtype)
    mm = torch.baddbmm if x.dim() == 3 else torch.addmm  # batched over experts, or one matrix
    for _ in range(steps):
        gram = x @ x.transpose(-2, -1)
        poly = mm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
        x = mm(x, poly, x, beta=a)  # a X + (b G + c G^2) X
    return x.transpose(-2, -1) if tall else x


def lr_scale(rows: int, cols: int, adjust_lr_fn: Optional[str]) -> float:
    """Muon's shape factor on the learning rate of one ``rows x cols`` matrix."""
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn={adjust_lr_fn} is not supported")


class ExpertMuon(torch.optim.Optimizer):
    """Muon over 3-D parameters whose leading dimension indexes independent matrices (MoE experts)."""

    def __init__(
        self,
        params: Any,
        lr: float = 0.02,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr_fn: Optional[str] = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 3:
                    raise ValueError(f"ExpertMuon takes [experts, rows, cols] parameters, got shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            lr, mu = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                ortho = orthogonalize(update, group["ns_steps"])
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(ortho.to(p.dtype), alpha=-lr * lr_scale(p.shape[-2], p.shape[-1], group["adjust_lr_fn"]))
        return loss
