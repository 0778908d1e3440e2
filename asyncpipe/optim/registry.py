"""Building an optimizer: `build_optimizer`, the one entry point, and the helpers optimizer modules share.

Optimizers declare themselves with `asyncpipe.registry.declare_optimizer` (builder, config keys, checks, memory
model) in their own module (the built-ins: `asyncpipe.optimizers`, torch-free; their builders import this module when
called). A builder receives the module (a whole model or one pipeline stage), the `OptimizerConfig`-shaped node and an
optional predicate naming the hidden matrices (None = `block_matrices`); it returns a torch optimizer whose
every group carries ``base_lr``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from asyncpipe.registry import declare_optimizer, names, optimizer_spec, optimizers, resolve, target_of

HiddenFn = Callable[[str, nn.Parameter], bool]
Builder = Callable[[nn.Module, Any, Optional[HiddenFn]], torch.optim.Optimizer]


def register(name: str, memory: Any = None, **declaration: Any) -> Callable[[Builder], Builder]:
    """Decorator: make ``builder`` available as ``optimizer.name=<name>`` (`asyncpipe.registry.declare_optimizer`;
    ``memory`` is required: for Adam-like state pass `asyncpipe.optimizers.adamw.adam_bytes`)."""
    if memory is None:
        raise TypeError(
            f"optimizer {name!r}: declare its memory model (memory=adam_bytes for Adam-like state, "
            "asyncpipe.optimizers.adamw)"
        )
    return declare_optimizer(name, memory=memory, **declaration)


def available() -> list[str]:
    """Declared optimizer names, sorted."""
    return names(optimizers())


def trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Named parameters that require grad (a tied weight appears once)."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def block_matrices(module: nn.Module, routers: bool = False) -> HiddenFn:
    """Default hidden-matrix rule: the 2-D weights of the model's transformer `Block`s and their MoE experts'
    stacked ``[E, rows, cols]`` weights (one matrix per expert); MoE routers only when ``routers``."""
    from asyncpipe.model import Block, Router

    skip = set() if routers else {id(p) for m in module.modules() if isinstance(m, Router) for p in m.parameters()}
    ids = {
        id(p)
        for m in module.modules()
        if isinstance(m, Block)
        for p in m.parameters()
        if p.dim() in (2, 3) and id(p) not in skip
    }
    return lambda name, p: id(p) in ids


def decay_groups(named: list[tuple[str, nn.Parameter]], lr: float, weight_decay: float) -> list[dict[str, Any]]:
    """nanoGPT's split: weight decay on 2-D+ tensors (matrices, embeddings), none on norms and biases."""
    decay = [p for _, p in named if p.dim() >= 2]
    no_decay = [p for _, p in named if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay, "lr": lr, "base_lr": lr, "group": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "lr": lr, "base_lr": lr, "group": "no_decay"},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(
    module: nn.Module,
    cfg: Any,
    hidden: Optional[HiddenFn] = None,
    compensation: Any = None,
    delays: Union[int, Mapping[str, int]] = 0,
    pipeline: bool = False,
) -> torch.optim.Optimizer:
    """The optimizer ``cfg.name`` (or ``cfg._target_``) over ``module``'s trainable parameters, wrapped by the
    staleness mitigation ``compensation`` (a `CompensationConfig` node; None = none; EF is the method ``ef``, which
    the *_ef presets' ``optimizer.ef.enabled`` becomes at composition: `asyncpipe.config.alias`). ``delays``: every
    parameter's delay k (an int, or by ``named_parameters`` name). ``pipeline``: refuse methods that do not fit
    the 2BW engine. ``hidden(name, param)`` overrides which matrices count as hidden (Muon's share)."""
    from asyncpipe.optim import compensation as comp

    spec = optimizer_spec(cfg.name, target_of(cfg))
    if not trainable(module):
        raise ValueError("the module has no trainable parameters to optimise")
    optimizer = resolve(spec.builder)(module, cfg, hidden)
    for group in optimizer.param_groups:
        group.setdefault("base_lr", group["lr"])
    if compensation is None or compensation.name == "none":
        return optimizer
    by_param = {p: (delays if isinstance(delays, int) else delays.get(n, 0)) for n, p in module.named_parameters()}
    is_hidden = hidden or block_matrices(module)  # what basis_rotation rotates unless rotation.all_matrices
    optimizer.hidden_params = {p for n, p in trainable(module) if is_hidden(n, p)}  # type: ignore[attr-defined]
    return comp.build(optimizer, compensation, by_param, pipeline=pipeline)
