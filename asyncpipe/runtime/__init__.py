"""What both engines run on and neither owns: device and precision choice (`device`), stop signals (`signals`),
checkpoint files (`checkpoint`) and the divergence rule below. The run lifecycle (`asyncpipe.session`) and the
engines (`asyncpipe.engines`, `asyncpipe.pipe`) import from here, never from each other."""

from __future__ import annotations

import math


def diverged(loss: float, limit: float) -> bool:
    """A train loss that ends the run: NaN/inf, or above ``train.diverge_loss``."""
    return not math.isfinite(loss) or loss > limit
