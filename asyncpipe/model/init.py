"""Weight initialisation shared by the model's modules: seeded draws that do not depend on the device."""

from __future__ import annotations

import torch


def layer_generator(seed: int, index: int) -> torch.Generator:
    """The generator of layer ``index``: a layer's weights depend only on (seed, index), not on how it is cut."""
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


def normal_(t: torch.Tensor, std: float, gen: torch.Generator) -> None:
    """Fill ``t`` with N(0, std^2) drawn on the CPU from ``gen`` (the same weights on every device); meta: no-op."""
    if t.is_meta:
        return
    with torch.no_grad():
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).mul_(std))
