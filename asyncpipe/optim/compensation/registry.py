"""Compensation methods on the torch side: `build` (the declared method's builder around an optimizer), `method`,
`available`, `register` (the decorator form of `asyncpipe.registry.declare_method`, for a method in one module of
its own) and the engine hooks (`compensate_grads`, `forward_weights`, `extra_bytes`). See the package docstring."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, ContextManager

import torch

from asyncpipe.errors import UserError
from asyncpipe.registry import MethodSpec, declare_method, method_spec, methods, names, resolve

Builder = Callable[[torch.optim.Optimizer, Any, Mapping[torch.Tensor, int]], torch.optim.Optimizer]
Method = MethodSpec


def register(name: str, fits_2bw: bool, note: str, **declaration: Any) -> Callable[[Builder], Builder]:
    """Decorator: make ``builder(optimizer, cfg_compensation, delays)`` available as ``compensation=<name>``;
    ``declaration``: the rest of its `asyncpipe.registry.declare_method` (buffers, key, config, check, memory)."""
    declaration.setdefault("buffers", None)
    return declare_method(name, fits_2bw=fits_2bw, note=note, **declaration)


def available() -> list[str]:
    """Registered method names (``none`` included), sorted."""
    return names(methods())


def method(name: str) -> MethodSpec:
    return method_spec(name)


def build(
    optimizer: torch.optim.Optimizer, cfg: Any, delays: Mapping[torch.Tensor, int], pipeline: bool = False
) -> torch.optim.Optimizer:
    """``optimizer`` wrapped by the method ``cfg.name``; ``pipeline`` refuses methods that do not fit 2BW."""
    m = method_spec(cfg.name, cfg.get("_target_"))
    if pipeline and not m.fits_2bw:
        raise UserError(f"compensation={m.name} does not run in engine=pipeline: {m.note}; use engine=simulate")
    return resolve(m.builder)(optimizer, cfg, delays)


def compensate_grads(optimizer: torch.optim.Optimizer, stale: Mapping[torch.Tensor, torch.Tensor]) -> None:
    hook = getattr(optimizer, "compensate_grads", None)
    if hook is not None:
        hook(stale)


def forward_weights(optimizer: torch.optim.Optimizer) -> ContextManager[None]:
    hook = getattr(optimizer, "forward_weights", None)
    return hook() if hook is not None else contextlib.nullcontext()


def extra_bytes(optimizer: torch.optim.Optimizer) -> int:
    return int(getattr(optimizer, "extra_bytes", 0))
