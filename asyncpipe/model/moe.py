"""Mixture-of-experts MLP: a top-k router over E SwiGLU experts (plus an optional shared expert), dropless by
default, with the load-balancing and router z-losses entering the training loss through autograd.

Expert weights are stored as one 3-D tensor per projection, ``[E, rows, cols]``: each ``w[e]`` is expert e's own
matrix, which is how `asyncpipe.optim.expert_muon` orthogonalises them (per expert, batched over E).

Auxiliary losses. A block's layer interface is one tensor in, one tensor out, so the aux loss cannot be returned
next to the hidden states. Instead `AddAuxLoss` passes the MoE output through unchanged and, in backward, gives the
aux loss the gradient ``aux_grad_scale`` (the factor the engine applies to the LM loss, 1/micro-batches): the
result is the gradient of ``sum_mb (lm_loss + sum_blocks aux) / micro_batches``, computed inside each block. The
simulator and every pipeline stage therefore add their blocks' aux losses the same way, with no extra messages.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from asyncpipe.model.init import normal_


class AddAuxLoss(torch.autograd.Function):
    """Forward: ``out`` unchanged. Backward: ``out``'s gradient, and ``scale`` as the gradient of ``aux``."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:  # type: ignore[override]
        shape, dtype, device = ctx.aux_meta
        return grad_out, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class Router(nn.Linear):
    """Token -> expert logits (no bias). Its own class so optimizers can tell it from the hidden matrices."""


def _swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


class MoE(nn.Module):
    """x [B, T, D] -> sum over the top-k experts of (renormalised router weight x expert(x)), + shared expert.

    Forward in training records this micro-batch's raw aux losses in ``stats`` (summed; `pop_moe_stats` reads
    and clears them) and attaches ``aux_loss_coef * lb + z_loss_coef * z`` to the output through `AddAuxLoss`.
    """

    def __init__(
        self,
        d_model: int,
        d_expert: int,
        experts: int,
        top_k: int,
        shared_expert: bool = False,
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 0.001,
        capacity_factor: Optional[float] = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"moe.top_k={top_k} must be in [1, moe.experts={experts}]")
        self.experts, self.top_k = experts, top_k
        self.aux_loss_coef, self.z_loss_coef, self.capacity_factor = aux_loss_coef, z_loss_coef, capacity_factor
        self.aux_grad_scale = 1.0  # set by the engine: the factor its LM loss gets before backward
        self.router = Router(d_model, experts, bias=False)
        self.w_gate = nn.Parameter(torch.empty(experts, d_expert, d_model))
        self.w_up = nn.Parameter(torch.empty(experts, d_expert, d_model))
        self.w_down = nn.Parameter(torch.empty(experts, d_model, d_expert))
        self.shared = (
            nn.ModuleDict(
                {
                    n: nn.Linear(i, o, bias=False)
                    for n, i, o in (("gate", d_model, d_expert), ("up", d_model, d_expert), ("down", d_expert, d_model))
                }
            )
            if shared_expert
            else None
        )
        self.stats = {"lb_loss": 0.0, "z_loss": 0.0, "count": 0}

    def init_weights(self, std: float, out_std: float, gen: torch.Generator) -> None:
        for t in (self.router.weight, self.w_gate, self.w_up):
            normal_(t, std, gen)
        normal_(self.w_down, out_std, gen)
        if self.shared is not None:
            normal_(self.shared["gate"].weight, std, gen)
            normal_(self.shared["up"].weight, std, gen)
            normal_(self.shared["down"].weight, out_std, gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        n, k, e = flat.shape[0], self.top_k, self.experts
        logits = self.router(flat).float()
        probs = logits.softmax(dim=-1)
        weights, chosen = probs.topk(k, dim=-1)  # [N, k]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        choice = chosen.reshape(-1)  # assignment a = token a // k, slot a % k
        counts = torch.bincount(choice, minlength=e)
        order = choice.argsort(stable=True)  # assignments grouped by expert, token order within an expert
        if self.capacity_factor is not None:  # drop each expert's assignments beyond its capacity
            cap = max(1, math.ceil(self.capacity_factor * n * k / e))
            starts = torch.cumsum(counts, 0) - counts
            keep = torch.arange(n * k, device=flat.device) - starts[choice[order]] < cap
            order, kept = order[keep], counts.clamp(max=cap)
        else:
            kept = counts
        token = order // k
        xs = flat.index_select(0, token)
        gates, ups, downs = self.w_gate.unbind(0), self.w_up.unbind(0), self.w_down.unbind(0)
        # Dropless experts of data-dependent sizes: the split needs the counts on the host (one read per layer and
        # micro-batch on a GPU; a grouped-GEMM kernel taking the counts on the device would remove it).
        pieces = [_swiglu(xe, gates[i], ups[i], downs[i]) for i, xe in enumerate(xs.split(kept.tolist())) if len(xe)]
        ys = torch.cat(pieces) if pieces else xs.new_zeros((0, shape[-1]))
        # The top-k combine in fp32 (the weights are fp32 router probabilities): under bf16 autocast the experts'
        # outputs are bf16, and k of them summed per token in bf16 would round every partial sum.
        ys = ys.float() * weights.reshape(-1).index_select(0, order).unsqueeze(-1)
        y = torch.zeros((n, shape[-1]), dtype=torch.float32, device=flat.device).index_add_(0, token, ys)
        if self.shared is not None:
            y = y + _swiglu(flat, self.shared["gate"].weight, self.shared["up"].weight, self.shared["down"].weight)
        y = y.reshape(*shape[:-1], shape[-1])
        if not (self.training and torch.is_grad_enabled()):
            return y
        # Switch/GShard balance: E * sum_e (share of assignments to e) * (mean router probability of e); 1 when even.
        lb = e * torch.sum(counts.to(probs.dtype) / (n * k) * probs.mean(dim=0))
        z = torch.logsumexp(logits, dim=-1).square().mean()  # ST-MoE router z-loss
        self.stats["lb_loss"] = self.stats["lb_loss"] + lb.detach()  # tensors: no device sync per forward
        self.stats["z_loss"] = self.stats["z_loss"] + z.detach()
        self.stats["count"] += 1
        aux = self.aux_loss_coef * lb + self.z_loss_coef * z
        return AddAuxLoss.apply(y, aux, self.aux_grad_scale)


def moe_layers(module: nn.Module) -> list[MoE]:
    """The MoE layers inside ``module`` (a whole GPT or one pipeline stage)."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def set_aux_grad_scale(module: nn.Module, scale: float) -> None:
    """Tell every MoE layer the factor its engine applies to the LM loss of one micro-batch (1/micro-batches)."""
    for m in moe_layers(module):
        m.aux_grad_scale = float(scale)


def pop_moe_sums(module: nn.Module) -> tuple[float, float, int]:
    """(sum of raw load-balancing losses, sum of z-losses, number of (layer, micro-batch) forwards) recorded by
    ``module``'s MoE layers since the last pop; the records are cleared."""
    lb, z, count = 0.0, 0.0, 0
    for m in moe_layers(module):
        if m.stats["count"]:
            lb, z, count = lb + float(m.stats["lb_loss"]), z + float(m.stats["z_loss"]), count + m.stats["count"]
        m.stats = {"lb_loss": 0.0, "z_loss": 0.0, "count": 0}
    return lb, z, count


def pop_moe_stats(module: nn.Module) -> dict[str, float]:
    """Mean raw load-balancing and z-loss per MoE layer and micro-batch since the last pop; {} when none ran."""
    lb, z, count = pop_moe_sums(module)
    return {"moe_lb_loss": lb / count, "moe_z_loss": z / count} if count else {}
