"""What both engines run on and neither owns: device and precision choice (`device`), stop signals (`signals`),
checkpoint files (`checkpoint`), the engine protocol and the trainer's `Setup` (`protocol`) and the divergence rule
below. The trainer (`asyncpipe.trainer`, the one module that builds an engine), the session helpers
(`asyncpipe.session`) and the engines (`asyncpipe.engines`: the simulator and `engines.pipeline`) import from here; the
engines never import each other, the trainer or the session, and the session imports no engine."""

from __future__ import annotations

import math


def diverged(loss: float, limit: float) -> bool:
    """A train loss that ends the run: NaN/inf, or above ``train.diverge_loss``."""
    return not math.isfinite(loss) or loss > limit
