"""The registry of compensation methods: `register` (a decorator each method module applies), `method`, `build`,
and the engine hooks (`compensate_grads`, `forward_weights`, `extra_bytes`). See the package docstring."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ContextManager

import torch

from asyncpipe.errors import UserError

Builder = Callable[[torch.optim.Optimizer, Any, Mapping[torch.Tensor, int]], torch.optim.Optimizer]


@dataclass(frozen=True)
class Method:
    name: str
    build: Builder
    fits_2bw: bool
    note: str  # memory / engine remark: why it does not fit 2BW, or what it keeps


_METHODS: dict[str, Method] = {}


def register(name: str, fits_2bw: bool, note: str) -> Callable[[Builder], Builder]:
    """Decorator: make ``builder(optimizer, cfg_compensation, delays)`` available as ``compensation=<name>``."""

    def wrap(builder: Builder) -> Builder:
        if name in _METHODS:
            raise ValueError(f"compensation {name!r} is registered twice")
        _METHODS[name] = Method(name, builder, fits_2bw, note)
        return builder

    return wrap


def available() -> list[str]:
    """Registered method names (``none`` included), sorted."""
    return sorted(_METHODS)


def method(name: str) -> Method:
    found = _METHODS.get(name)
    if found is None:
        raise UserError(f"compensation.name={name} is unknown; choose one of: {', '.join(available())}")
    return found


def build(
    optimizer: torch.optim.Optimizer, cfg: Any, delays: Mapping[torch.Tensor, int], pipeline: bool = False
) -> torch.optim.Optimizer:
    """``optimizer`` wrapped by the method ``cfg.name``; ``pipeline`` refuses methods that do not fit 2BW."""
    m = method(cfg.name)
    if pipeline and not m.fits_2bw:
        raise UserError(f"compensation={m.name} does not run in engine=pipeline: {m.note}; use engine=simulate")
    return m.build(optimizer, cfg, delays)


def compensate_grads(optimizer: torch.optim.Optimizer, stale: Mapping[torch.Tensor, torch.Tensor]) -> None:
    hook = getattr(optimizer, "compensate_grads", None)
    if hook is not None:
        hook(stale)


def forward_weights(optimizer: torch.optim.Optimizer) -> ContextManager[None]:
    hook = getattr(optimizer, "forward_weights", None)
    return hook() if hook is not None else contextlib.nullcontext()


def extra_bytes(optimizer: torch.optim.Optimizer) -> int:
    return int(getattr(optimizer, "extra_bytes", 0))


@register("none", fits_2bw=True, note="no extra memory")
def _build_none(optimizer: torch.optim.Optimizer, cfg: Any, delays: Mapping[torch.Tensor, int]) -> torch.optim.Optimizer:
    return optimizer
