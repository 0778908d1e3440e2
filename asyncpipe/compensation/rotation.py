"""``compensation=basis_rotation``: the wrapped optimizer runs in the eigenbasis of Shampoo's Kronecker factors
(Jung, Shin & Lee, ICML 2026); its settings, value checks, which tensors rotate (`rotates`, shared with the rule)
and its memory model (L, R, Q_L, Q_R per rotated matrix). The rule: `asyncpipe.optim.compensation.rotation`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncpipe.errors import ConfigError
from asyncpipe.registry import declare_method


def rotates(shape: tuple[int, ...], hidden: bool, muon: bool, max_dim: int, all_matrices: bool) -> bool:
    """Whether a tensor of ``shape`` gets a rotation: a matrix (or a stack of expert matrices) no side of which
    exceeds ``max_dim``, hidden (a block or expert matrix) unless ``all_matrices``, and not Muon's own."""
    return len(shape) in (2, 3) and max(shape[-2:]) <= max_dim and (hidden or all_matrices) and not muon


def rotation_numbers(shape: tuple[int, ...]) -> int:
    """Numbers kept for one rotated tensor: L, R, Q_L, Q_R, per expert for a 3-D stack."""
    count = shape[0] if len(shape) == 3 else 1
    return 2 * count * (shape[-2] ** 2 + shape[-1] ** 2)


@dataclass
class RotationCompensation:
    beta: float = 0.95  # EMA decay of the Kronecker factors G G^T and G^T G
    every: int = 10  # steps between eigenbasis refreshes
    max_dim: int = 4096  # matrices with a side above this are left unrotated
    all_matrices: bool = False  # also rotate the embedding, head and MoE routers (default: block/expert matrices)


def check_rotation(r: Any, cfg: Any) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    o = cfg.optimizer
    need(0 <= r.beta < 1, f"compensation.rotation.beta={r.beta} must be in [0, 1)")
    need(r.every >= 1 and r.max_dim >= 1, "compensation.rotation.every and max_dim must be >= 1")
    need(
        o.name != "soap",
        "optimizer=soap already runs Adam in a rotated eigenbasis; use basis_rotation with adamw, nadam or muon",
    )
    need(
        o.name != "muon" or r.all_matrices,
        "compensation=basis_rotation under optimizer=muon rotates nothing (Muon's "
        "matrices commute with rotation; embedding and head are skipped): set compensation.rotation.all_matrices=true",
    )


def rotation_bytes(cfg: Any, shapes: list) -> float:
    """L, R, Q_L, Q_R per rotated matrix (per expert), fp32, by the rule `rotates` applies."""
    r, muon = cfg.compensation.rotation, cfg.optimizer.name == "muon"
    return 4.0 * sum(
        c * rotation_numbers(tuple(shape))
        for s in shapes
        for c, shape, hidden in s.tensors
        if rotates(tuple(shape), hidden, muon and hidden, r.max_dim, r.all_matrices)
    )


declare_method(
    "basis_rotation",
    build="asyncpipe.optim.compensation.rotation:build_rotation",
    fits_2bw=True,
    note="L, R, Q_L, Q_R per matrix (optimizer state, no weight version)",
    buffers=0,
    memory=rotation_bytes,
    key="rotation",
    config=RotationCompensation,
    check=check_rotation,
    revision=2,
)  # r1 (to 262fe8d): embedding and head rotated too (asyncpipe.report.revisions)
