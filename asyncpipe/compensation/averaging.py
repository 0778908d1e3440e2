"""``compensation=update_averaging``: an EMA over the wrapped optimizer's applied updates with a Nesterov-style extra
step (this project's own idea, not a published method); its setting ``compensation.nag.gamma``, its value check and
its memory (one buffer m and the step's snapshot). The rule, and why it adds lag rather than compensating it:
`asyncpipe.optim.compensation.averaging`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncpipe.errors import ConfigError
from asyncpipe.registry import declare_method


@dataclass
class AveragingCompensation:
    gamma: float = 0.9  # update_averaging: EMA decay over applied updates (0 = the plain optimizer)


def check_averaging(c: Any, cfg: Any) -> None:
    if not 0 <= c.gamma < 1:
        raise ConfigError(f"compensation.nag.gamma={c.gamma} must be in [0, 1)")


# key "nag": the v3 run records' name for this node (the report compares every recorded key)
declare_method(
    "update_averaging",
    build="asyncpipe.optim.compensation.averaging:build_averaging",
    fits_2bw=True,
    note="one parameter-sized buffer m (optimizer state, no weight version)",
    buffers=2,
    key="nag",
    config=AveragingCompensation,
    check=check_averaging,
)
