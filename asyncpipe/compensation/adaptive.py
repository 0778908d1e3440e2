"""``compensation=ef_adaptive``: EF whose lambda is set every step from the run's own consecutive updates,
lam(t) = clip(k (1 + 2 rho(t)) / 3, 0, lam_max); its settings, value checks and memory (u(t-1), d(t-1) and the
step's snapshot). The rule and its derivation: `asyncpipe.optim.compensation.adaptive`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncpipe.errors import ConfigError
from asyncpipe.registry import declare_method

SCOPES = ("tensor", "group", "model")


@dataclass
class AdaptiveEFCompensation:
    lam_init: float = 1.0  # lambda until two update differences exist
    lam_max: float = 2.0  # upper clamp of the per-step lambda (the rule gives [0, k])
    beta: float = 0.9  # EMA decay of the update-difference statistics
    scope: str = "tensor"  # one lambda per tensor, per param group, or for the whole model (engine=pipeline: tensor)


def check_adaptive(a: Any, cfg: Any) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    need(a.lam_init >= 0 and a.lam_max >= 0, "compensation.adaptive.lam_init and lam_max must be >= 0")
    need(
        a.lam_init <= a.lam_max,
        f"compensation.adaptive.lam_init={a.lam_init} is above lam_max={a.lam_max}: every "
        "later lambda is clamped to lam_max, so the first steps would be corrected harder than any the rule allows",
    )
    need(0 <= a.beta < 1, f"compensation.adaptive.beta={a.beta} must be in [0, 1)")
    need(a.scope in SCOPES, f"compensation.adaptive.scope={a.scope} is not allowed; choose one of: {', '.join(SCOPES)}")
    need(
        cfg.engine != "pipeline" or a.scope == "tensor",
        "engine=pipeline computes lambda per stage: use compensation.adaptive.scope=tensor",
    )


declare_method(
    "ef_adaptive",
    build="asyncpipe.optim.compensation.adaptive:build_adaptive",
    fits_2bw=True,
    note="two parameter-sized buffers u(t-1), d(t-1); scope=tensor in engine=pipeline",
    buffers=3,
    key="adaptive",
    config=AdaptiveEFCompensation,
    check=check_adaptive,
    needs_delay=True,
)
