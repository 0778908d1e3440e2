"""Staleness mitigations ("compensation") behind one interface, orthogonal to the optimizer: their update rules.

``compensation=<name>`` (conf/compensation/<name>.yaml) wraps whatever optimizer ``optimizer=`` builds. A method
is declared, torch-free, in `asyncpipe.compensation` (its settings, checks, memory model), which names its builder
in the module of the same name here (its rule, a `base.Compensated` wrapper, imported when a run builds it). The
engines only call the hooks below, which are no-ops for an unwrapped optimizer, so ``compensation=none`` runs
exactly the plain optimizer.

- `build` (used by `asyncpipe.optim.build_optimizer`): wrap an optimizer for the config node ``compensation``;
- `compensate_grads(optimizer, stale)`: between clipping and the step, with W(t-k) of every parameter;
- `forward_weights(optimizer)`: a context around the forward/backward, entered while parameters hold W(t-k);
- `extra_bytes(optimizer)`: the persistent memory a method adds.

Whether a method runs inside the real 2BW engine is part of its declaration (``fits_2bw`` and why not).
"""

from __future__ import annotations

from asyncpipe.optim.compensation.registry import (
    Method,
    available,
    build,
    compensate_grads,
    extra_bytes,
    forward_weights,
    method,
    register,
)

__all__ = ["Method", "available", "build", "compensate_grads", "extra_bytes", "forward_weights", "method", "register"]
