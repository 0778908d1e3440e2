"""Basis rotation (Jung, Shin & Lee, ICML 2026, "Mitigating Staleness in Asynchronous Pipeline Parallelism via
Basis Rotation", arXiv 2602.03515; code LOG-postech/basis-rotation).

Their finding: a delayed update hurts most when the Hessian's eigenbasis is misaligned with the coordinate axes,
because a coordinate-wise adaptive optimizer (Adam) then oscillates, and a stale oscillating update points the
wrong way. The cure is to run the optimizer in a basis aligned with the curvature. For a weight matrix G's
gradient, the Kronecker factors of Shampoo's preconditioner give that basis:

    L <- beta L + (1 - beta) G G^T,    R <- beta R + (1 - beta) G^T G        (every step)
    Q_L, Q_R = eigenvectors(L), eigenvectors(R)                             (every ``every`` steps)
    G' = Q_L^T G Q_R;   u' = the wrapped optimizer's step on G' (its moments live in the rotated basis)
    x(t+1) = x(t) - lr wd x(t) - Q_L u' Q_R^T                               (decoupled weight decay unrotated)

When the basis is refreshed, the first moment (Adam's ``exp_avg``, SGD/Muon's ``momentum_buffer``) is carried
into the new basis; the second moment stays (as SOAP does). With ``optimizer=adamw`` this is the same algorithm
as ``optimizer=soap`` (Vyas et al. 2024: Adam in Shampoo's eigenbasis), which is why SOAP is refused as a base
here; unlike SOAP it wraps any coordinate-wise optimizer (AdamW, NAdam) and uses exact eigendecompositions.
Muon's own matrices are left alone: Newton-Schulz orthogonalisation commutes with rotations, Q^T orth(M) Q =
orth(Q^T M Q), so rotating them changes nothing; under Muon only its AdamW share (embeddings, head) rotates.
Matrices with a side above ``max_dim`` and non-matrix parameters are not rotated. The wrapped optimizer must use
decoupled weight decay (AdamW, NAdam and Muon here do). Memory: L, R, Q_L, Q_R per rotated matrix, 2 (m^2 + n^2)
numbers (optimizer state, no weight version): it runs in the 2BW engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from asyncpipe.errors import UserError
from asyncpipe.optim.compensation.registry import register
from asyncpipe.optim.compensation.base import Compensated

_MOMENTS = ("exp_avg", "momentum_buffer")


class BasisRotation(Compensated):
    name = "basis_rotation"
    buffer_names = ("L", "R", "QL", "QR")

    def __init__(
        self, optimizer: torch.optim.Optimizer, delays: Mapping[torch.Tensor, int], beta: float, every: int, max_dim: int
    ) -> None:
        if not 0 <= beta < 1 or every < 1 or max_dim < 1:
            raise UserError("compensation.rotation needs 0 <= beta < 1, every >= 1 and max_dim >= 1")
        super().__init__(optimizer, delays)
        self.beta, self.every = float(beta), int(every)
        self.rotated = [
            p
            for group in self.param_groups
            if not str(group.get("group", "")).startswith("muon")
            for p in group["params"]
            if p.dim() == 2 and max(p.shape) <= max_dim
        ]

    @torch.no_grad()
    def _refresh(self, p: torch.Tensor) -> None:
        b = self.buffers
        ql = torch.linalg.eigh(b["L"][p].double()).eigenvectors.to(p.dtype)
        qr = torch.linalg.eigh(b["R"][p].double()).eigenvectors.to(p.dtype)
        if p in b["QL"]:
            state = self.optimizer.state.get(p, {})
            for key in _MOMENTS:
                m = state.get(key)
                if isinstance(m, torch.Tensor) and m.shape == p.shape:
                    # old rotated basis -> weights' basis -> new rotated basis
                    m.copy_(ql.T @ (b["QL"][p] @ m @ b["QR"][p].T) @ qr)
        b["QL"][p], b["QR"][p] = ql, qr

    def _step(self) -> None:
        b, beta = self.buffers, self.beta
        rotated = [p for p in self.rotated if p.grad is not None]
        for p in rotated:
            g = p.grad
            if p not in b["L"]:
                b["L"][p], b["R"][p] = g @ g.T, g.T @ g
            else:
                b["L"][p].mul_(beta).add_(g @ g.T, alpha=1 - beta)
                b["R"][p].mul_(beta).add_(g.T @ g, alpha=1 - beta)
            if p not in b["QL"] or self.t % self.every == 0:
                self._refresh(p)
            p.grad = b["QL"][p].T @ g @ b["QR"][p]
        groups = self.group_of()
        before = [p.detach().clone() for p in rotated]
        self.optimizer.step()
        for p, x in zip(rotated, before):
            group = groups[p]
            decay = x * (group["lr"] * group.get("weight_decay", 0.0))
            u_rot = x - p.detach() - decay  # the wrapped optimizer's step in the rotated basis
            p.copy_(x - decay - b["QL"][p] @ u_rot @ b["QR"][p].T)


@register("basis_rotation", fits_2bw=True, note="L, R, Q_L, Q_R per matrix (optimizer state, no weight version)")
def build_rotation(optimizer: torch.optim.Optimizer, cfg: Any, delays: Mapping[torch.Tensor, int]) -> torch.optim.Optimizer:
    c = cfg.rotation
    return BasisRotation(optimizer, delays, c.beta, c.every, c.max_dim)
