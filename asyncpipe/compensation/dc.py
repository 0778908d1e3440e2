"""``compensation=dc``: the delay-compensated gradient of DC-ASGD (Zheng et al., ICML 2017), g + lam(t) g*g
(W(t) - W(t-k)), with DC-ASGD-a's adaptive lambda; its settings, value checks and memory model. The rule:
`asyncpipe.optim.compensation.dc`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncpipe.errors import ConfigError
from asyncpipe.registry import declare_method


@dataclass
class DCCompensation:
    lam: float = 2.0  # DC-ASGD lambda: g + lam(t) * g*g*(W(t) - W(t-k))
    adaptive: bool = True  # DC-ASGD-a: lam(t) = lam / sqrt(EMA(g*g) + eps), elementwise, the EMA starting at 0
    rho: float = 0.95  # EMA decay of g*g (adaptive)
    eps: float = 1e-7


def check_dc(c: Any, cfg: Any) -> None:
    if c.lam < 0:
        raise ConfigError(f"compensation.dc.lam={c.lam} must be >= 0")
    if not (0 <= c.rho < 1 and c.eps > 0):
        raise ConfigError(f"compensation.dc needs 0 <= rho < 1 and eps > 0, got rho={c.rho}, eps={c.eps}")


def dc_bytes(cfg: Any, shapes: list) -> float:
    """What `DelayCompensated` keeps: DC-ASGD-a one fp32 buffer v per parameter, DC-ASGD none (the correction is
    made in place, one tensor at a time)."""
    return 4.0 * sum(s.params for s in shapes) if cfg.compensation.dc.adaptive else 0.0


declare_method(
    "dc",
    build="asyncpipe.optim.compensation.dc:build_dc",
    fits_2bw=True,
    note="W(t-k) is still in the 2BW stash at step time; DC-ASGD-a keeps one buffer v",
    buffers=0,
    memory=dc_bytes,
    key="dc",
    config=DCCompensation,
    check=check_dc,
    needs_delay=True,
    revision=2,
)  # r1 (to 262fe8d): eps outside the root, MeanSquare seeded with g*g (asyncpipe.report.revisions)
