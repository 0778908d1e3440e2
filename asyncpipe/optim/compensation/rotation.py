"""Basis rotation (Jung, Shin & Lee, ICML 2026, "Mitigating Staleness in Asynchronous Pipeline Parallelism via
Basis Rotation", arXiv 2602.03515; code LOG-postech/basis-rotation, ``optim/basis_rotation.py``).

Their finding: a delayed update hurts most when the Hessian's eigenbasis is misaligned with the coordinate axes,
because a coordinate-wise adaptive optimizer (Adam) then oscillates, and a stale oscillating update points the
wrong way. The cure is to run the optimizer in a basis aligned with the curvature. For a weight matrix G's
gradient, the Kronecker factors of Shampoo's preconditioner give that basis (their Algorithm 1, Adam in the
rotated space, with Algorithm 2's bilateral geometry and second-order source, the code's defaults
``rotation_geometry=bi``, ``approx_source=2nd``):

    L <- beta L + (1 - beta) G G^T,    R <- beta R + (1 - beta) G^T G        (every step)
    Q_L, Q_R = eigenvectors(L), eigenvectors(R)                             (every ``every`` steps)
    G' = Q_L^T G Q_R;   u' = the wrapped optimizer's step on G' (its moments live in the rotated basis)
    x(t+1) = x(t) - lr wd x(t) - Q_L u' Q_R^T                               (decoupled weight decay unrotated)

When the basis is refreshed, the first moment (Adam's ``exp_avg``, SGD/Muon's ``momentum_buffer``) is carried
into the new basis; the second moment stays. (Their code keeps the first moment unrotated and projects it every
step, the same thing; its second moment stays too, reordered with its eigenvalue-sorted basis.)

Which tensors rotate: the hidden matrices, i.e. the 2-D weights of the transformer blocks, and the stacked
``[E, rows, cols]`` expert weights, each expert with its own L, R, Q_L, Q_R (a batch of E eigendecompositions).
The embedding, the output head and MoE routers are skipped unless ``all_matrices=true``; an optimizer built
outside `asyncpipe.optim.build_optimizer` (no ``hidden_params``) has no roles and rotates every matrix. Muon's
own matrices are always skipped: Newton-Schulz orthogonalisation commutes with rotations, Q^T orth(M) Q =
orth(Q^T M Q), so rotating them changes nothing (config validation refuses Muon without ``all_matrices``, where
nothing would rotate). Matrices with a side above ``max_dim`` are not rotated.

Departures from the reference code: it rotates every 2-D parameter including embeddings and head (skipping them
is this project's default: rotating them is what made basis rotation hurt Muon in the v3 study), it has no
per-expert case (its model is dense), it refreshes the basis by QR power iteration warm-started from the last one
(here exact eigh every time, as at its first refresh), and it is its own Adam (here it wraps any coordinate-wise
optimizer: AdamW, NAdam; ``optimizer=soap``, the same algorithm, is refused as a base). The wrapped optimizer must
use decoupled weight decay (AdamW, NAdam and Muon here do). Memory: L, R, Q_L, Q_R per rotated matrix,
2 (m^2 + n^2) numbers (times E for experts), optimizer state, no weight version: it runs in the 2BW engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

from asyncpipe.compensation.rotation import rotates
from asyncpipe.errors import UserError
from asyncpipe.optim.compensation.base import Compensated

_MOMENTS = ("exp_avg", "momentum_buffer")


class BasisRotation(Compensated):
    name = "basis_rotation"
    buffer_names = ("L", "R", "QL", "QR")

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        delays: Mapping[torch.Tensor, int],
        beta: float,
        every: int,
        max_dim: int,
        all_matrices: bool = False,
        hidden: Optional[set[torch.Tensor]] = None,
    ) -> None:
        if not 0 <= beta < 1 or every < 1 or max_dim < 1:
            raise UserError("compensation.rotation needs 0 <= beta < 1, every >= 1 and max_dim >= 1")
        super().__init__(optimizer, delays)
        self.beta, self.every = float(beta), int(every)
        self.rotated = [
            p
            for group in self.param_groups
            for p in group["params"]
            if rotates(
                tuple(p.shape),
                hidden=hidden is None or p in hidden,
                muon=str(group.get("group", "")).startswith("muon"),
                max_dim=max_dim,
                all_matrices=all_matrices,
            )
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
                    # old rotated basis -> weights' basis -> new rotated basis (per expert for a 3-D stack)
                    m.copy_(ql.mT @ (b["QL"][p] @ m @ b["QR"][p].mT) @ qr)
        b["QL"][p], b["QR"][p] = ql, qr

    def _step(self) -> None:
        b, beta = self.buffers, self.beta
        rotated = [p for p in self.rotated if p.grad is not None]
        for p in rotated:
            g = p.grad
            left, right = g @ g.mT, g.mT @ g
            if p not in b["L"]:
                b["L"][p], b["R"][p] = left, right
            else:
                b["L"][p].mul_(beta).add_(left, alpha=1 - beta)
                b["R"][p].mul_(beta).add_(right, alpha=1 - beta)
            if p not in b["QL"] or self.t % self.every == 0:
                self._refresh(p)
            p.grad = b["QL"][p].mT @ g @ b["QR"][p]
        groups = self.group_of()
        before = [p.detach().clone() for p in rotated]
        self.optimizer.step()
        for p, x in zip(rotated, before):
            group = groups[p]
            decay = x * (group["lr"] * group.get("weight_decay", 0.0))
            u_rot = x - p.detach() - decay  # the wrapped optimizer's step in the rotated basis
            p.copy_(x - decay - b["QL"][p] @ u_rot @ b["QR"][p].mT)


def build_rotation(
    optimizer: torch.optim.Optimizer, cfg: Any, delays: Mapping[torch.Tensor, int]
) -> torch.optim.Optimizer:
    """The method ``basis_rotation`` (declared in `asyncpipe.compensation.rotation`) around ``optimizer``."""
    c = cfg.rotation
    hidden = getattr(optimizer, "hidden_params", None)
    return BasisRotation(optimizer, delays, c.beta, c.every, c.max_dim, c.all_matrices, hidden)
